"""A decoder layer's pointwise parts, in plain torch: RMSNorm (alone, or after the residual
add), RoPE on queries and keys, and SiLU(gate) * up.

This is the reference the engine's numerics follow (transformers' Llama code: RMSNorm in
float32, each product rounded to the model's dtype) and what the compiled steps trace, where
Inductor fuses it. The eager step, which runs prompt chunks, takes the fused C++ version
(:mod:`kvshare.kernels.cpu.pointwise`) where it is built: one pass over each tensor instead of
a dozen small ops, each reading and writing the whole activation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class TorchPointwise:
    """The reference implementation of every pointwise part."""

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm over the last dim, in float32, rounded to ``x``'s dtype before the weight."""
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return weight * h.to(dtype)

    @classmethod
    def add_rms_norm(cls, h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual sum ``h + delta`` and its RMSNorm."""
        h = h + delta
        return h, cls.rms_norm(h, weight, eps)

    @staticmethod
    def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
             sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotary embedding of queries and keys (rows, heads, head_dim); cos and sin are
        (rows, 1, head_dim)."""
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin

    @staticmethod
    def silu_mul(gate_up: torch.Tensor, inter: int) -> torch.Tensor:
        """SiLU of the first ``inter`` columns times the next ``inter``."""
        gate, up = torch.split(gate_up, [inter, inter], dim=-1)
        return F.silu(gate) * up
