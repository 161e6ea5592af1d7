"""Triton kernels for the engine's operations, drop-in for the plain-torch references.

Registered as backend ``"triton"`` (see :func:`kvshare.kernels.registry.register_triton`)
when Triton imports and either a GPU is present or ``TRITON_INTERPRET=1`` (Triton's
interpreter runs them on CPU tensors: slow, for tests). Whether these functions run
compiled or interpreted is fixed when this package is imported (:data:`INTERPRETED`).

ForkKV's residual attention is not here yet: its torch reference has not landed.
"""

from __future__ import annotations

from .attention import INTERPRETED, paged_attention, write_kv
from .lora import LoraSegments, gathered_lora, lora_expand, lora_segments, lora_shrink, stack_lora_weights

__all__ = ["INTERPRETED", "LoraSegments", "gathered_lora", "lora_expand", "lora_segments", "lora_shrink",
           "paged_attention", "stack_lora_weights", "write_kv"]
