"""A decode step's projection and its rows' LoRA deltas in one Triton launch: ``y = x W^T + b +
scale[r] * (x[r] A[slot r]^T) B[slot r]^T``, each row with its own adapter slot (or none).

Why our own: on a GPU an ICaRus pair step (a base row and an adapter row of one token) cost
1.31x a base step replayed from CUDA graphs (session 27, H200, SmolLM2's shapes), where the
issue asks for 1.15x. At a few rows every projection is latency-bound, and the pair paid a
second launch for each of them: cuBLAS's GEMM, then the BGMV kernel (:mod:`.bgmv`) that
reads the same ``x`` again. cuBLAS has no LoRA epilogue, and vLLM and SGLang keep LoRA as
launches of their own (right at their batch sizes, where the GEMM dominates). Here each
program computes a tile of output columns for every row: one loop over the input features
accumulates ``x W^T`` and, for the rows whose tile lies in an adapted part, ``x A^T`` (the
shrink: rank x features, small, so every tile may read it again), then adds the expand of
its own columns and the bias, rounding once. Up to three parts of a fused projection (q/k/v,
gate/up) take their own A and B, found from the first part's by an element offset as in
:func:`.bgmv.bgmv_lora_add_parts`; columns of a part no adapter adapts get no delta.

The plain-torch reference is ``F.linear`` plus :func:`kvshare.serve.exec.lora_slots.lora_delta`.
"""

from __future__ import annotations

import logging

import torch
import triton
import triton.language as tl

from . import _common
from ._common import dot_precision, inner_contiguous, require_gpu_tensor
from .attention import INTERPRETED
from .bgmv import _element_offset

MAX_ROWS = 16  # a decode step's rows this kernel takes (one tl.dot tile); more: cuBLAS + BGMV
_BLOCK_K = 64  # input features a loop step reads
_BLOCK_N = 64  # most output columns a program writes (fewer where a part's width asks)
# every column tile reads its rows' A again (rank x features): at most half what it reads of
# W (BLOCK_N x features), and the (rows, rank, features) shrink tile stays in registers
_MAX_RANK_PER_COLUMN = 0.5
_failed: str | None = None  # why the kernel could not launch on this GPU, once it could not

log = logging.getLogger(__name__)


@triton.jit
def _linear_lora_kernel(
    x_ptr, w_ptr, bias_ptr, y_ptr, a_ptr, b_ptr, index_ptr, scale_ptr,
    first0, first1, first2, width0, width1, width2, a_off1, a_off2, b_off1, b_off2,
    stride_bs0, stride_bs1, stride_bs2, stride_br0, stride_br1, stride_br2,
    rows, in_features, out_features, rank, stride_xr, stride_wn, stride_yr, stride_as, stride_ar,
    HAS_BIAS: tl.constexpr, LORA: tl.constexpr, ROWS_PAD: tl.constexpr, LORA_ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, PRECISION: tl.constexpr,
):
    n0 = tl.program_id(0) * BLOCK_N
    cols = n0 + tl.arange(0, BLOCK_N)
    col_ok = cols < out_features
    lines = tl.arange(0, ROWS_PAD)
    line_ok = lines < rows
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros([ROWS_PAD, BLOCK_N], tl.float32)
    if LORA:
        # the adapted part this tile lies in (the host made every part's edges a multiple of
        # BLOCK_N), if any; a part that does not exist has width 0
        in1 = (n0 >= first1) & (n0 < first1 + width1)
        in2 = (n0 >= first2) & (n0 < first2 + width2)
        in0 = (n0 >= first0) & (n0 < first0 + width0)
        a_part = a_ptr + tl.where(in2, a_off2, tl.where(in1, a_off1, 0))
        b_part = b_ptr + tl.where(in2, b_off2, tl.where(in1, b_off1, 0))
        first = tl.where(in2, first2, tl.where(in1, first1, first0))
        stride_bs = tl.where(in2, stride_bs2, tl.where(in1, stride_bs1, stride_bs0))
        stride_br = tl.where(in2, stride_br2, tl.where(in1, stride_br1, stride_br0))
        lora_lines = tl.arange(0, LORA_ROWS)
        # rows of scale 0 (an ICaRus pair's base row, no adapter, pad rows) read no A or B
        lora_rows = tl.where(in0 | in1 | in2, rows, 0)  # none where the tile is in no adapted part
        scale = tl.load(scale_ptr + lora_lines, mask=lora_lines < lora_rows, other=0.0)
        adapted = scale != 0
        slot = tl.load(index_ptr + lora_lines, mask=adapted, other=0).to(tl.int64)
        ranks = tl.arange(0, BLOCK_R)
        rank_ok = ranks < rank
        t = tl.zeros([LORA_ROWS, BLOCK_R], tl.float32)
    for k in range(0, in_features, BLOCK_K):
        k_ok = k + ks < in_features
        x = tl.load(x_ptr + lines[:, None] * stride_xr + (k + ks)[None, :],
                    mask=line_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + cols[:, None] * stride_wn + (k + ks)[None, :],
                    mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(w), input_precision=PRECISION)
        if LORA:
            xl = tl.load(x_ptr + lora_lines[:, None] * stride_xr + (k + ks)[None, :],
                         mask=adapted[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            a = tl.load(a_part + slot[:, None, None] * stride_as + ranks[None, :, None] * stride_ar
                        + (k + ks)[None, None, :],
                        mask=adapted[:, None, None] & rank_ok[None, :, None] & k_ok[None, None, :], other=0.0)
            t += tl.sum(a.to(tl.float32) * xl[:, None, :], axis=2)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if LORA:
        b = tl.load(b_part + slot[:, None, None] * stride_bs + ranks[None, :, None] * stride_br
                    + (cols - first)[None, None, :],
                    mask=adapted[:, None, None] & rank_ok[None, :, None] & col_ok[None, None, :], other=0.0)
        delta = tl.sum(b.to(tl.float32) * t[:, :, None], axis=1) * scale[:, None]  # (LORA_ROWS, BLOCK_N)
        if LORA_ROWS == ROWS_PAD:
            acc += delta
        else:  # the LORA_ROWS lines of delta onto the first lines of the ROWS_PAD-line tile, by
            # selection: a product with 0 would carry one row's NaN or inf into every other row
            pick = lines[:, None, None] == lora_lines[None, :, None]  # (ROWS_PAD, LORA_ROWS, 1)
            acc += tl.sum(tl.where(pick, delta[None, :, :], 0.0), axis=1)
    tl.store(y_ptr + lines[:, None] * stride_yr + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=line_ok[:, None] & col_ok[None, :])


def _block_n(out_features: int, edges: list[int]) -> int | None:
    """Columns a program writes: ``_BLOCK_N`` or the largest smaller power of two (>= 16, for
    tl.dot) that every adapted part's first column and width are multiples of, so that no
    tile straddles two parts; None if there is none."""
    block = _BLOCK_N
    while block >= 16:
        if all(edge % block == 0 for edge in edges):
            return block
        block //= 2
    return None


def fits(x: torch.Tensor, weight, parts: list[tuple[int, torch.Tensor, torch.Tensor]]) -> bool:
    """Whether :func:`linear_lora` takes this projection: a plain weight of ``x``'s dtype (not
    a quantised or packed one) and features, at most :data:`MAX_ROWS` rows, at most three
    adapted parts of one rank (small beside a tile's columns) and layout whose edges a tile can
    follow; never once the kernel failed to launch on this GPU."""
    if (_failed is not None or not isinstance(weight, torch.Tensor) or weight.dim() != 2
            or weight.dtype != x.dtype or x.dim() != 2 or not 0 < x.shape[0] <= MAX_ROWS
            or x.shape[1] != weight.shape[1] or len(parts) > 3):
        return False
    if not parts:
        return True
    a0, b0 = parts[0][1], parts[0][2]
    if a0.shape[-2] == 0 or any(a.shape[-2:] != a0.shape[-2:] or a.stride() != a0.stride() or a.dtype != a0.dtype
                                or b.shape[-2] != a0.shape[-2] or b.dtype != b0.dtype or a.stride(-1) != 1
                                or b.stride(-1) != 1 or first + b.shape[-1] > weight.shape[0]
                                for first, a, b in parts) or a0.shape[-1] != x.shape[1]:
        return False
    if None in [_element_offset(a, a0) for _, a, _ in parts] + [_element_offset(b, b0) for _, _, b in parts]:
        return False
    block_n = _block_n(weight.shape[0], [e for first, _, b in parts for e in (first, b.shape[-1])])
    return block_n is not None and triton.next_power_of_2(a0.shape[-2]) <= _MAX_RANK_PER_COLUMN * block_n


def linear_lora(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                parts: list[tuple[int, torch.Tensor, torch.Tensor]], index: torch.Tensor,
                scale: torch.Tensor) -> torch.Tensor | None:
    """``x W^T + b`` plus each row's LoRA delta, one launch (the caller checked :func:`fits`).

    ``parts`` are the adapted parts of the fused output, ``(first column, a, b_t)`` with ``a``
    (slots, rank, in) and ``b_t`` (slots, rank, width) as the slot stacks hold them, in column
    order; ``index`` (rows,) long and ``scale`` (rows,) float32 as for :func:`.bgmv.bgmv_lora_add`.
    No parts: a plain projection. Reads nothing on the host, so a CUDA graph can record it.
    None if the GPU's compiler rejects the kernel (logged once, never tried again): the caller
    takes its projection and LoRA apart, instead of failing the graph and the engine's speed.
    """
    global _failed
    require_gpu_tensor(x, INTERPRETED)
    rows, in_features = x.shape
    out_features = weight.shape[0]
    x, weight = inner_contiguous(x), inner_contiguous(weight)
    bias = inner_contiguous(bias) if bias is not None else None
    y = torch.empty(rows, out_features, dtype=x.dtype, device=x.device)
    edges = [e for first, _, b in parts for e in (first, b.shape[-1])]
    block_n = _block_n(out_features, edges) if parts else _BLOCK_N
    if block_n is None:
        raise ValueError("the adapted parts' edges are not multiples of 16 columns (check fits() first)")
    lora = bool(parts)
    a0, b0 = (parts[0][1], parts[0][2]) if lora else (x, x)  # unused without LoRA
    pad = 3 - len(parts)
    firsts = [first for first, _, _ in parts] + [0] * pad
    widths = [b.shape[-1] for _, _, b in parts] + [0] * pad
    a_offs = [_element_offset(a, a0) for _, a, _ in parts] + [0] * pad
    b_offs = [_element_offset(b, b0) for _, _, b in parts] + [0] * pad
    bs = [b.stride(0) for _, _, b in parts] + [0] * pad
    br = [b.stride(1) for _, _, b in parts] + [0] * pad
    rank = a0.shape[-2] if lora else 0
    try:
        _launch(x, weight, bias, y, a0, b0, index, scale, firsts, widths, a_offs, b_offs, bs, br, rank, block_n)
    except Exception as err:  # noqa: BLE001 - a compiler we never ran it on
        if INTERPRETED or _common.compiling_only:
            raise
        _failed = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        log.warning("kvshare: the projection + LoRA kernel failed to launch (%s); projections and their LoRA "
                    "launch apart", _failed)
        return None
    return y


def _launch(x, weight, bias, y, a0, b0, index, scale, firsts, widths, a_offs, b_offs, bs, br, rank, block_n):
    """The kernel over every column tile (apart, so that :func:`linear_lora` catches a rejection)."""
    rows, in_features = x.shape
    out_features, lora = weight.shape[0], rank > 0
    _linear_lora_kernel[(triton.cdiv(out_features, block_n),)](
        x, weight, bias if bias is not None else x, y, a0, b0, index, scale,
        firsts[0], firsts[1], firsts[2], widths[0], widths[1], widths[2], a_offs[1], a_offs[2], b_offs[1], b_offs[2],
        bs[0], bs[1], bs[2], br[0], br[1], br[2],
        rows, in_features, out_features, rank, x.stride(0), weight.stride(0), y.stride(0),
        a0.stride(0) if lora else 0, a0.stride(1) if lora else 0,
        HAS_BIAS=bias is not None, LORA=lora, ROWS_PAD=max(16, triton.next_power_of_2(rows)),
        LORA_ROWS=triton.next_power_of_2(rows), BLOCK_N=block_n, BLOCK_K=_BLOCK_K,
        BLOCK_R=max(2, triton.next_power_of_2(max(rank, 1))), PRECISION=dot_precision(x.dtype),
        num_warps=4 if rows <= 4 else 8,  # more rows: a larger (rows, rank, features) shrink tile
    )
