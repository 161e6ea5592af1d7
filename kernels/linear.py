"""Dense projections (``x W^T + b``): the torch reference and oneDNN's packed CPU path.

On CPU, ``F.linear`` is fast for one row (a matrix-vector product) but about twice as slow
for 2-16 rows (timed once with a loop of 200 calls on a 2-core AVX2 EPYC: 3072x576 fp32, 1 row 182 us,
2 rows 390 us),
so an ICaRus paired step (a base row and an adapter row) paid nearly double. oneDNN with
weights reordered once at load (what PyTorch's own inductor uses for frozen CPU linears)
keeps small batches near the one-row cost (149 / 181 / 252 us for 1 / 2 / 4 rows, same
machine). PyTorch exposes it only as an internal op, so the backend is registered only
where that op exists and the engine falls back to the reference otherwise.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class TorchLinear:
    """The reference: weights as they are, ``F.linear``."""

    @staticmethod
    def prepare(weight: torch.Tensor) -> torch.Tensor:
        return weight

    @staticmethod
    def apply(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, weight, bias)


class OneDNNLinear:
    """oneDNN's packed linear for float32 CPU weights; anything else takes the reference."""

    @staticmethod
    def available() -> bool:
        return (torch.backends.mkldnn.is_available()
                and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
                and hasattr(torch.ops.mkldnn, "_linear_pointwise"))

    @staticmethod
    def prepare(weight: torch.Tensor):
        if weight.device.type != "cpu" or weight.dtype != torch.float32:
            return weight
        return _Packed(torch.ops.mkldnn._reorder_linear_weight(weight, 1))

    @staticmethod
    def apply(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
        if not isinstance(weight, _Packed):
            return F.linear(x, weight, bias)
        return torch.ops.mkldnn._linear_pointwise(x, weight.packed, bias, "none", [], "")


class _Packed:
    """A weight in oneDNN's layout (told apart from a plain tensor, which takes F.linear)."""

    __slots__ = ("packed",)

    def __init__(self, packed: torch.Tensor):
        self.packed = packed
