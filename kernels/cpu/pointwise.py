"""The eager step's pointwise parts in C++ (:file:`pointwise.cpp`): the backend "cpu" of the
kernel operation "pointwise".

Each method takes the C++ op where the extension is built and the tensors suit it (CPU,
float32 or bfloat16, one dtype), else the reference (:class:`~kvshare.kernels.pointwise.TorchPointwise`):
while the extension builds in the background, a first request runs on the reference.
"""

from __future__ import annotations

import torch

from ..pointwise import TorchPointwise
from . import extension

_DTYPES = (torch.float32, torch.bfloat16)


def _ext(*tensors: torch.Tensor):
    """The extension, where it is built and every tensor is a CPU tensor of one supported dtype."""
    first = tensors[0]
    if first.device.type != "cpu" or first.dtype not in _DTYPES:
        return None
    if any(t.device.type != "cpu" or t.dtype != first.dtype for t in tensors[1:]):
        return None
    return extension(wait=False)


class CpuPointwise(TorchPointwise):
    """Fused C++ RMSNorm, residual add + RMSNorm, RoPE and SiLU(gate) * up."""

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        ext = _ext(x, weight) if x.dim() in (2, 3) and x.stride(-1) == 1 else None
        if ext is None:
            return TorchPointwise.rms_norm(x, weight, eps)
        return ext.pointwise_rms_norm(x, weight, eps)

    @staticmethod
    def add_rms_norm(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        fits = h.dim() == 2 and h.shape == delta.shape and h.is_contiguous() and delta.is_contiguous()
        ext = _ext(h, delta, weight) if fits else None
        if ext is None:
            return TorchPointwise.add_rms_norm(h, delta, weight, eps)
        return ext.pointwise_add_rms_norm(h, delta, weight, eps)

    @staticmethod
    def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
             sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        fits = q.dim() == 3 and k.dim() == 3 and q.stride(-1) == 1 and k.stride(-1) == 1
        fits = fits and cos.shape == (q.shape[0], 1, q.shape[-1]) and sin.shape == cos.shape
        ext = _ext(q, k, cos, sin) if fits and cos.is_contiguous() and sin.is_contiguous() else None
        if ext is None:
            return TorchPointwise.rope(q, k, cos, sin)
        return ext.pointwise_rope(q, k, cos, sin)

    @staticmethod
    def silu_mul(gate_up: torch.Tensor, inter: int) -> torch.Tensor:
        fits = gate_up.dim() == 2 and gate_up.stride(-1) == 1 and gate_up.shape[-1] == 2 * inter
        ext = _ext(gate_up) if fits else None
        if ext is None:
            return TorchPointwise.silu_mul(gate_up, inter)
        return ext.pointwise_silu_mul(gate_up, inter)
