"""A tied LM head in int8 groups of 32 inputs (llama.cpp's Q8_0 precision), for the int4 backend.

With int4 layers the tied head is the largest weight a decode step reads: SmolLM2-135M's is
49,152 x 576, 57 MB in bfloat16 against 68 MB for all 30 layers in int4. llama.cpp serves a
Q4_1 model's head as Q8_0: int8 in groups of 32 inputs with a float16 scale each. Here the
scales are float32 (so at least Q8_0's precision) and activations stay bfloat16 (llama.cpp
quantises them to 8 bits). The embedding table stays bfloat16 for the token lookup; this is a
second, int8 copy of it (32 MB) that only the head reads.

Why our own kernel (:file:`cpu/linear_q8.cpp`, op ``kvshare::linear_q8``): PyTorch's int8
kernel ``_weight_int8pack_mm`` takes one scale per output row, coarser than Q8_0; its int4
kernel is below it. Where the C++ extension lacks AVX512 the head stays bfloat16
(:func:`q8_head_available`): the reference, which dequantises per call, is for tests.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

Q8_GROUP = 32  # inputs per scale, as in Q8_0
Q8_LANES = 16  # outputs per packed block (the kernel's vector width)


class Q8Weight:
    """A weight [N, K] as int8 ``packed`` [N/16, K, 16] and float32 ``scales`` [N/16, K/32, 16]:
    ``w[n, k] = packed[n // 16, k, n % 16] * scales[n // 16, k // 32, n % 16]``."""

    __slots__ = ("packed", "scales")

    def __init__(self, packed: torch.Tensor, scales: torch.Tensor):
        self.packed, self.scales = packed, scales

    def dequantize(self) -> torch.Tensor:
        """The float32 [N, K] weight this one stands for."""
        blocks, k, lanes = self.packed.shape
        scale = self.scales.repeat_interleave(Q8_GROUP, dim=1)  # [N/16, K, 16]
        return (self.packed.float() * scale).permute(0, 2, 1).reshape(blocks * lanes, k)

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scales.nbytes


def q8_fits(weight: torch.Tensor) -> bool:
    """Whether ``weight`` [N, K] packs: N a multiple of 16, K of the group."""
    return (weight.dim() == 2 and weight.dtype in (torch.float32, torch.bfloat16) and weight.device.type == "cpu"
            and weight.shape[0] % Q8_LANES == 0 and weight.shape[1] % Q8_GROUP == 0)


def quantize_q8(weight: torch.Tensor) -> Q8Weight:
    """Symmetric int8 per group of 32 inputs: ``scale = max|w| / 127``, ``q = round(w / scale)``."""
    n, k = weight.shape
    w = weight.detach().float().reshape(n, k // Q8_GROUP, Q8_GROUP)
    scale = w.abs().amax(-1) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero group: q = 0 with any scale
    q = torch.round(w / scale[..., None]).clamp_(-127, 127).to(torch.int8).reshape(n, k)
    packed = q.view(n // Q8_LANES, Q8_LANES, k).permute(0, 2, 1).contiguous()
    scales = scale.view(n // Q8_LANES, Q8_LANES, k // Q8_GROUP).permute(0, 2, 1).contiguous()
    return Q8Weight(packed, scales)


@functools.cache
def q8_head_available() -> bool:
    """Whether the C++ kernel runs here (the extension built, with AVX512); registers the op's
    fake (shape) function for tracing, once per process."""
    from .cpu import extension

    ext = extension()
    if ext is None or not ext.linear_q8_available():
        return False
    torch.library.register_fake("kvshare::linear_q8")(
        lambda x, packed, scales, bias=None: x.new_empty(*x.shape[:-1], packed.shape[0] * packed.shape[2]))
    return True


def q8_linear(x: torch.Tensor, weight: Q8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x W^T + b`` in ``x``'s dtype (sums in float32, rounded once): the kernel where it runs,
    else the dequantised reference."""
    if q8_head_available():
        return torch.ops.kvshare.linear_q8(x, weight.packed, weight.scales, bias)
    return q8_linear_reference(x, weight, bias)


def q8_linear_reference(x: torch.Tensor, weight: Q8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The oracle: the dequantised float32 weight and ``F.linear`` in float32."""
    y = F.linear(x.float(), weight.dequantize(), None if bias is None else bias.float())
    return y.to(x.dtype)


def prepare_tied_head(weight: torch.Tensor) -> torch.Tensor | Q8Weight:
    """The head a quantising backend multiplies by for a tied embedding: its int8 groups where
    the kernel runs here and the shape packs, else the embedding itself (bfloat16 or float32)."""
    return quantize_q8(weight) if q8_fits(weight) and q8_head_available() else weight
