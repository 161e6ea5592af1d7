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

# From this many rows on (a prompt chunk) a product expands the weight and takes the dense
# GEMM: PyTorch's int8/int4 CPU kernels walk the rows a few at a time, so their cost grows with
# the rows. Timed on 2 Sapphire Rapids cores, bfloat16, a 1536x576 weight: int4 kernel 0.165 /
# 0.321 / 5.04 ms at 16 / 32 / 512 rows, expanding and the GEMM 0.204 / 0.193 / 0.501 ms; int8
# 0.201 / 0.389 / 6.22 ms against 0.174 / 0.188 / 0.687 ms. Decode steps (at most 16 rows in
# the compiled step) keep the packed kernels, whose point is reading fewer bytes.
EXPAND_ROWS = 24


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
        if weight.packed_kernel and x.dtype == weight.scale.dtype and x.numel() < EXPAND_ROWS * x.shape[-1]:
            rows = x.reshape(-1, x.shape[-1]).contiguous()  # the kernel takes (M, K) only
            if rows.data_ptr() % 64:  # a view into another tensor: its aligned loads would fault
                rows = rows.clone()
            y = torch._weight_int8pack_mm(rows, weight.q, weight.scale).reshape(*x.shape[:-1], -1)
        else:
            y = F.linear(x, weight.q.to(x.dtype)) * weight.scale.to(x.dtype)
        return y if bias is None else y + bias


def weight_bytes(prepared) -> int:
    """Bytes a prepared weight holds (an :class:`Int8Weight`, an :class:`Int4Weight` or a plain tensor)."""
    if isinstance(prepared, (Int8Weight, Int4Weight)):
        return prepared.nbytes
    return prepared.numel() * prepared.element_size()


# --- weight-only int4 (backend "int4") -------------------------------------------------------

INT4_GROUP = 32  # llama.cpp's Q4_1 block: 32 inputs share a scale and a minimum


class Int4Weight:
    """A weight as 4-bit integers in groups of ``group`` inputs, each group with a float scale
    and zero: ``w = (q - 8) * scale + zero`` (``q`` in 0..15), the layout PyTorch's CPU kernel
    ``torch._weight_int4pack_mm_for_cpu`` takes (``packed``: (out, in / 2) uint8;
    ``scales_zeros``: (in / group, out, 2) in the activations' dtype)."""

    __slots__ = ("packed", "scales_zeros", "group")

    def __init__(self, packed: torch.Tensor, scales_zeros: torch.Tensor, group: int):
        self.packed, self.scales_zeros, self.group = packed, scales_zeros, group

    def dequantize(self) -> torch.Tensor:
        """The float (out, in) weight this one stands for (the kernel applied to the identity)."""
        n_in = self.packed.shape[1] * 2
        eye = torch.eye(n_in, dtype=self.scales_zeros.dtype)
        return torch._weight_int4pack_mm_for_cpu(eye, self.packed, self.group, self.scales_zeros).T.contiguous()

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scales_zeros.nbytes


def int4_fits(weight: torch.Tensor, group: int = INT4_GROUP) -> bool:
    """Whether PyTorch's int4 CPU kernel takes this (out, in) weight: out a multiple of 16, in of the group."""
    return (hasattr(torch, "_weight_int4pack_mm_for_cpu") and weight.device.type == "cpu"
            and weight.dtype in (torch.float32, torch.bfloat16) and weight.dim() == 2
            and weight.shape[0] % 16 == 0 and weight.shape[1] % group == 0)


def quantize_int4(weight: torch.Tensor, group: int = INT4_GROUP) -> Int4Weight:
    """Asymmetric 4-bit groups of a float32 or bfloat16 (out, in) weight, as Q4_1 does: 16
    levels spread over each group's range. The zero is stored in the weight's dtype, so it is
    rounded first (bfloat16 keeps 8 bits: near a large mean, more than half a level), and the
    scale then sized, rounded up, so that the group's range lies within ``q`` = 0..15 around
    the rounded zero: every value ends within half of its group's stored scale. A constant
    group keeps its value (to the dtype's rounding), not a multiple of a unit scale."""
    n_out, n_in = weight.shape
    w = weight.detach().to(torch.float32).reshape(n_out, n_in // group, group)
    low, high = w.amin(-1), w.amax(-1)
    zero = (low + 8 * (high - low) / 15).to(weight.dtype).float()
    scale = torch.maximum((zero - low) / 8, (high - zero) / 7)
    stored = scale.to(weight.dtype)
    up = torch.nextafter(stored, torch.full_like(stored, float("inf")))  # the next value the dtype holds
    scale = torch.where(stored.float() < scale, up.float(), stored.float())
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # a constant group stored exactly: q = 8
    q = torch.round((w - zero[..., None]) / scale[..., None] + 8).clamp_(0, 15)
    packed = torch._convert_weight_to_int4pack_for_cpu(q.reshape(n_out, n_in).to(torch.int32), 1)
    scales_zeros = torch.stack([scale, zero], -1).transpose(0, 1).to(weight.dtype).contiguous()
    return Int4Weight(packed, scales_zeros, group)


def int4_linear(x: torch.Tensor, weight: Int4Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x W^T + b`` for an int4 weight (any leading dims; computed in the scales' dtype)."""
    rows = x.reshape(-1, x.shape[-1]).to(weight.scales_zeros.dtype).contiguous()  # the kernel takes (M, K)
    block_n = _int4_block_n() if len(rows) >= EXPAND_ROWS else None
    if block_n is not None:
        from .cpu import extension

        expanded = extension().int4_expand(weight.packed, weight.scales_zeros, weight.group, block_n)  # (in, out)
        y = F.linear(rows, expanded.t())
    else:
        y = torch._weight_int4pack_mm_for_cpu(rows, weight.packed, weight.group, weight.scales_zeros)
    y = y.reshape(*x.shape[:-1], -1).to(x.dtype)
    return y if bias is None else y + bias


_block_n: list = []  # [the packed layout's channel block, or None] once probed


def _int4_block_n() -> int | None:
    """The channel block of PyTorch's packed int4 layout on this CPU (64 with AVX-512, 32
    otherwise), found by expanding a probe weight both ways and comparing with PyTorch's own
    kernel; None where the C++ extension is missing or neither matches (then chunks keep the
    int4 kernel)."""
    if not _block_n:
        from .cpu import extension

        found = None
        if extension() is not None:
            # 80 channels: a full block and a short one on either layout
            probe = quantize_int4(torch.randn(80, 64, generator=torch.Generator().manual_seed(0)))
            truth = probe.dequantize().t()
            for block_n in (64, 32):
                expanded = extension().int4_expand(probe.packed, probe.scales_zeros, probe.group, block_n)
                if torch.allclose(expanded, truth, rtol=1e-5, atol=1e-6):  # another layout misplaces whole channels
                    found = block_n
                    break
        _block_n.append(found)
    return _block_n[0]


class Int4WeightOnlyLinear:
    """Weight-only int4 linear (Q4_1's precision: groups of 32 with a scale and a minimum) on
    PyTorch's CPU int4 kernel, for the weights it takes (:func:`int4_fits`); others stay float.
    As with int8, a tied lm_head stays the float embedding table (``quantized``): an int4 copy
    was measured 1.2x faster at batch 1 (results/engine-cpu-int4/), but below the precision of
    llama.cpp's Q8_0 head, and the head scores every token."""

    quantized = True

    @staticmethod
    def prepare(weight: torch.Tensor):
        return quantize_int4(weight) if int4_fits(weight) else weight

    @staticmethod
    def apply(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
        if not isinstance(weight, Int4Weight):
            return F.linear(x, weight, bias)
        return int4_linear(x, weight, bias)
