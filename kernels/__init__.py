"""kvshare.kernels: the engine's compute operations, each with a plain-torch reference.

Faster versions (Triton on GPU, fused CPU paths) register beside the references under
another backend name (:func:`register`) and are tested against them; each engine picks its
implementations with a :class:`Kernels` object and passes tensor
:class:`AttentionMetadata` built once per step.
"""

from __future__ import annotations

from .metadata import AttentionMetadata, build_attention_metadata
from .registry import OPERATIONS, Kernels, backends, register

__all__ = ["AttentionMetadata", "Kernels", "OPERATIONS", "backends", "build_attention_metadata", "register"]
