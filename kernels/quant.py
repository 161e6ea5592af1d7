"""Weight-only int8 for the base's dense projections (kernel operation "linear", backend "int8").

Each weight row (output channel) is stored as int8 with one float scale, ``w ≈ q * s`` with
``s = max|w_row| / 127`` (symmetric, no zero point), so the weights take a quarter of their
float32 bytes (half of bfloat16). Activations stay float: ``y = (x q^T) * s + b``. LoRA deltas are
not projections of the base and never pass through here (the engine adds them in float with
``gathered_lora``), so adapters stay exact.

The product runs on PyTorch's ``torch._weight_int8pack_mm(x, q, s)`` (x (M, K) float or
bfloat16, q (N, K) int8, s (N,) in x's dtype; the scale is applied after the dot product).
In PyTorch's CPU source (``aten/src/ATen/native/cpu/int8mm_kernel.cpp``) that kernel is
vectorised on x86 (AVX2 and AVX-512) for bfloat16 activations only, and for every dtype on
Arm; float32 on x86 takes a scalar loop. Timed on a 2-core AVX2 EPYC (3072x576, 1-128 rows,
``results/int8/``): float32 was 6-52x slower than ``F.linear``, bfloat16 2-4x faster than
bfloat16 ``F.linear``. So float32 activations on x86 take the same math by dequantising ``q``
per call, ``F.linear``, then the scale: memory is saved between calls, time is not.

The kernel trusts its inputs: its vector loops step 8 (AVX2, Arm) or 16 (AVX-512) along K with
aligned loads, so another K gives wrong numbers without an error and a misaligned activation
pointer crashes the process (both seen with torch 2.13). It is used only for K a multiple of 16,
and activations not 64-byte aligned are copied first.
"""

from __future__ import annotations

import platform

import torch
import torch.nn.functional as F

QMAX = 127  # symmetric: -127..127 (-128 unused, so q and -q are both representable)


class Int8Weight:
    """A weight as int8 rows (``q``, (out, in)) and their float scales (``scale``, (out,))."""

    __slots__ = ("q", "scale", "packed_kernel")

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, packed_kernel: bool):
        self.q, self.scale, self.packed_kernel = q, scale, packed_kernel

    def dequantize(self) -> torch.Tensor:
        """The float weight this one stands for (``q * s`` per row, in the scale's dtype)."""
        return self.q.to(self.scale.dtype) * self.scale[:, None]

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.scale.nbytes


def quantize_per_channel(weight: torch.Tensor) -> Int8Weight:
    """Symmetric per-output-channel int8 of a float32 or bfloat16 (out, in) weight.

    The scale is rounded to the weight's dtype first and ``q`` computed from the rounded scale,
    so ``|w - q*s| <= s/2`` holds for the scale actually stored.
    """
    w = weight.detach().to(torch.float32)
    scale = (w.abs().amax(dim=1) / QMAX).to(weight.dtype)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row: q = 0 with any scale
    q = torch.round(w / scale.to(torch.float32)[:, None]).clamp_(-QMAX, QMAX).to(torch.int8).contiguous()
    packed = _packed_kernel_is_fast(weight.dtype) and weight.shape[1] % 16 == 0
    return Int8Weight(q, scale.contiguous(), packed_kernel=packed)


def _packed_kernel_is_fast(dtype: torch.dtype) -> bool:
    """Whether PyTorch vectorises ``_weight_int8pack_mm`` for this activation dtype on this machine."""
    if not hasattr(torch, "_weight_int8pack_mm"):
        return False
    return dtype == torch.bfloat16 or platform.machine().lower() in ("aarch64", "arm64")


class Int8WeightOnlyLinear:
    """Weight-only int8 linear for float32/bfloat16 CPU weights; anything else takes the reference.

    ``quantized`` tells the model to keep a *tied* lm_head in float: the embedding table stays
    float for the token lookup anyway, so an int8 copy of it would add memory, not save it.
    """

    quantized = True

    @staticmethod
    def prepare(weight: torch.Tensor):
        if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
            return weight
        return quantize_per_channel(weight)

    @staticmethod
    def apply(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
        if not isinstance(weight, Int8Weight):
            return F.linear(x, weight, bias)
        if weight.packed_kernel and x.dtype == weight.scale.dtype:
            rows = x.reshape(-1, x.shape[-1]).contiguous()  # the kernel takes (M, K) only
            if rows.data_ptr() % 64:  # a view into another tensor: its aligned loads would fault
                rows = rows.clone()
            y = torch._weight_int8pack_mm(rows, weight.q, weight.scale).reshape(*x.shape[:-1], -1)
        else:
            y = F.linear(x, weight.q.to(x.dtype)) * weight.scale.to(x.dtype)
        return y if bias is None else y + bias


def weight_bytes(prepared) -> int:
    """Bytes a prepared weight holds (an :class:`Int8Weight` or a plain tensor)."""
    return prepared.nbytes if isinstance(prepared, Int8Weight) else prepared.numel() * prepared.element_size()
