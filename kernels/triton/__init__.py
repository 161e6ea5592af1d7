"""Triton kernels for the engine's operations, drop-in for the plain-torch references.

Registered as backend ``"triton"`` (see :func:`kvshare.kernels.registry.register_triton`)
when Triton imports and either a GPU is present or ``TRITON_INTERPRET=1`` (Triton's
interpreter runs them on CPU tensors: slow, for tests). Whether these functions run
compiled or interpreted is fixed when this package is imported (:data:`INTERPRETED`).

The CUDA-graph step's LoRA (:mod:`.bgmv`, each row's slot read on the device) mirrors
:func:`kvshare.serve.exec.lora_slots.lora_delta`. ForkKV's residual attention (:mod:`.residual_attention`) mirrors
:func:`kvshare.kernels.residual_attention.residual_attention_ref`.
"""

from __future__ import annotations

from .attention import INTERPRETED, paged_attention, write_kv
from .bgmv import bgmv_lora_add
from .lora import LoraSegments, gathered_lora, lora_expand, lora_segments, lora_shrink, stack_lora_weights
from .residual_attention import residual_attention

__all__ = ["INTERPRETED", "LoraSegments", "bgmv_lora_add", "gathered_lora", "lora_expand", "lora_segments",
           "lora_shrink", "paged_attention", "residual_attention", "stack_lora_weights", "write_kv"]
