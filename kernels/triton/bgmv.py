"""Multi-adapter LoRA with each row's adapter slot read on the device (BGMV): the LoRA of the
CUDA-graph decode step (:mod:`kvshare.serve.exec.cuda_graphs`).

The segment kernels (:mod:`.lora`) size their grid from the step's segments on the host; a
graph replays one fixed grid over whatever rows the next step brings. Here every row is a
program that reads its own slot and scale from the step's static buffers, as vLLM's punica
BGMV kernels do for decode, and rows of scale 0 (an ICaRus pair's base row, rows without an
adapter, pad rows) return at once. *Shrink* ``t = x A[slot]^T`` (float32) and *expand*
``y += scale * t B[slot]`` into the projection's output columns, in place, are one launch
where each column tile can afford to compute ``t`` again (small models: a launch costs more
than those reads), else two, through float32 scratch. The gather form they replace in the
graph (:func:`kvshare.serve.exec.lora_slots.lora_delta`, their reference) records eight to ten
kernels a projection (``results/engine-gpu/scripts/count_launches.py``).
"""

from __future__ import annotations

import logging

import torch
import triton
import triton.language as tl

from . import _common
from ._common import inner_contiguous, require_gpu_tensor
from .attention import INTERPRETED

# weight elements a program holds at once (rank x features): an ICaRus pair step is a few rows,
# so each launch is latency-bound and fewer, wider loads (SmolLM2's 576 features in one) beat a
# loop of narrow ones; more warps keep the wider tiles in registers
_TILE = 16384
_MAX_WARPS = 8
# one launch instead of two while each row's A, read again by every column tile, stays this small
# (at rank 16, SmolLM2's projections: at most 74k elements a row; Llama-8B's: 1M and up, two launches)
_FUSED_READS = 1 << 18
_parts_failed: str | None = None  # why the multi-part kernel could not launch on this GPU, once it could not

log = logging.getLogger(__name__)


@triton.jit
def _row_shrink(x_ptr, a_ptr, row, slot, stride_xr, stride_as, stride_ar, in_features, rank,
                BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """``x[row] A[slot]^T`` in float32, (BLOCK_R,) with zeros past ``rank``."""
    ranks = tl.arange(0, BLOCK_R)
    rank_ok = ranks < rank
    cols = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_R], tl.float32)
    for k in range(0, in_features, BLOCK_K):
        col_ok = k + cols < in_features
        x = tl.load(x_ptr + row * stride_xr + k + cols, mask=col_ok, other=0.0).to(tl.float32)
        a = tl.load(a_ptr + slot * stride_as + ranks[:, None] * stride_ar + k + cols[None, :],
                    mask=rank_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(a * x[None, :], axis=1)
    return acc


@triton.jit
def _row_expand(t, b_ptr, y_ptr, row, slot, scale, n_block, stride_bs, stride_br, stride_yr, out_features, rank,
                BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    """``y[row, tile] += scale * t B[slot]^T[:, tile]`` for the ``n_block``-th tile of columns."""
    ranks = tl.arange(0, BLOCK_R)
    outs = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    out_ok = outs < out_features
    b = tl.load(b_ptr + slot * stride_bs + ranks[:, None] * stride_br + outs[None, :],
                mask=(ranks < rank)[:, None] & out_ok[None, :], other=0.0).to(tl.float32)
    delta = tl.sum(b * t[:, None], axis=0)
    where = y_ptr + row * stride_yr + outs
    y = tl.load(where, mask=out_ok, other=0.0)
    tl.store(where, (y.to(tl.float32) + delta * scale).to(y_ptr.dtype.element_ty), mask=out_ok)


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, t_ptr, index_ptr, scale_ptr, stride_xr, stride_as, stride_ar, in_features,
                   rank, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    row = tl.program_id(0)
    if tl.load(scale_ptr + row) != 0:
        slot = tl.load(index_ptr + row).to(tl.int64)
        t = _row_shrink(x_ptr, a_ptr, row, slot, stride_xr, stride_as, stride_ar, in_features, rank,
                        BLOCK_R, BLOCK_K)
        tl.store(t_ptr + row * BLOCK_R + tl.arange(0, BLOCK_R), t)


@triton.jit
def _expand_kernel(t_ptr, b_ptr, y_ptr, index_ptr, scale_ptr, stride_bs, stride_br, stride_yr, out_features,
                   rank, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    row = tl.program_id(0)
    scale = tl.load(scale_ptr + row)
    if scale != 0:
        slot = tl.load(index_ptr + row).to(tl.int64)
        t = tl.load(t_ptr + row * BLOCK_R + tl.arange(0, BLOCK_R))
        _row_expand(t, b_ptr, y_ptr, row, slot, scale, tl.program_id(1), stride_bs, stride_br, stride_yr,
                    out_features, rank, BLOCK_R, BLOCK_N)


@triton.jit
def _fused_kernel(x_ptr, a_ptr, b_ptr, y_ptr, index_ptr, scale_ptr, stride_xr, stride_as, stride_ar, stride_bs,
                  stride_br, stride_yr, in_features, out_features, rank,
                  BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    row = tl.program_id(0)
    scale = tl.load(scale_ptr + row)
    if scale != 0:
        slot = tl.load(index_ptr + row).to(tl.int64)
        t = _row_shrink(x_ptr, a_ptr, row, slot, stride_xr, stride_as, stride_ar, in_features, rank,
                        BLOCK_R, BLOCK_K)
        _row_expand(t, b_ptr, y_ptr, row, slot, scale, tl.program_id(1), stride_bs, stride_br, stride_yr,
                    out_features, rank, BLOCK_R, BLOCK_N)


@triton.jit
def _parts_kernel(x_ptr, a_ptr, b_ptr, y_ptr, index_ptr, scale_ptr, a_off1, a_off2, b_off1, b_off2,
                  first1, first2, width0, width1, width2, stride_bs0, stride_bs1, stride_bs2,
                  stride_br0, stride_br1, stride_br2, tiles0, tiles1, stride_xr, stride_as, stride_ar,
                  stride_yr, in_features, rank, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                  BLOCK_N: tl.constexpr):
    """:func:`_fused_kernel` over two or three parts of one fused projection (q/k/v, gate/up):
    the column tiles of part 0, then 1, then 2. Each part's A and B are found from part 0's
    by an element offset, and its columns from the first's by ``first``."""
    row = tl.program_id(0)
    scale = tl.load(scale_ptr + row)
    if scale != 0:
        tile = tl.program_id(1)
        second = tile >= tiles0
        third = tile >= tiles0 + tiles1
        a_off = tl.where(third, a_off2, tl.where(second, a_off1, 0))
        b_off = tl.where(third, b_off2, tl.where(second, b_off1, 0))
        first = tl.where(third, first2, tl.where(second, first1, 0))
        width = tl.where(third, width2, tl.where(second, width1, width0))
        stride_bs = tl.where(third, stride_bs2, tl.where(second, stride_bs1, stride_bs0))
        stride_br = tl.where(third, stride_br2, tl.where(second, stride_br1, stride_br0))
        n_block = tile - tl.where(third, tiles0 + tiles1, tl.where(second, tiles0, 0))
        slot = tl.load(index_ptr + row).to(tl.int64)
        t = _row_shrink(x_ptr, a_ptr + a_off, row, slot, stride_xr, stride_as, stride_ar, in_features, rank,
                        BLOCK_R, BLOCK_K)
        _row_expand(t, b_ptr + b_off, y_ptr + first, row, slot, scale, n_block, stride_bs, stride_br, stride_yr,
                    width, rank, BLOCK_R, BLOCK_N)


def _tile_shape(rank: int, in_features: int, out_features: int) -> tuple[int, int, int, int]:
    """(BLOCK_R, BLOCK_K, BLOCK_N, warps) of a program holding at most ``_TILE`` weight elements."""
    block_r = triton.next_power_of_2(rank)
    block_k = max(16, min(triton.next_power_of_2(in_features), _TILE // block_r))
    block_n = max(16, min(triton.next_power_of_2(out_features), _TILE // block_r))
    warps = max(4, min(_MAX_WARPS, block_r * max(block_k, block_n) // 2048))  # 4 up to 8k elements a tile
    return block_r, block_k, block_n, warps


def _element_offset(t: torch.Tensor, base: torch.Tensor) -> int | None:
    """Where ``t`` starts, in elements from ``base`` (same dtype); None if not a whole number."""
    gap = t.data_ptr() - base.data_ptr()
    return None if gap % t.element_size() else gap // t.element_size()


def _each_part(y: torch.Tensor, x: torch.Tensor, parts, index: torch.Tensor, scale: torch.Tensor) -> None:
    for first, a, b_t in parts:
        bgmv_lora_add(y[:, first:first + b_t.shape[-1]], x, a, b_t, index, scale)


def bgmv_lora_add_parts(y: torch.Tensor, x: torch.Tensor, parts: list[tuple[int, torch.Tensor, torch.Tensor]],
                        index: torch.Tensor, scale: torch.Tensor) -> None:
    """:func:`bgmv_lora_add` for the adapted parts of one fused projection at once: ``parts``
    are ``(first column in y, a, b_t)`` of one rank and input size, in column order. Two or
    three parts are one launch instead of one each (an ICaRus pair step's gate/up, a LoRA's
    q/k/v) where the shrink can be computed again by each column tile (as in the one-launch
    form of :func:`bgmv_lora_add`): on a GPU each launch costs a few microseconds whatever
    its work, which is what a small model's pair step pays (``results/engine-gpu``)."""
    if not parts:  # no part of this projection is adapted (an aLoRA's o, gate/up, down)
        return
    global _parts_failed
    if len(parts) == 1 or len(parts) > 3 or x.shape[0] == 0 or _parts_failed is not None:
        return _each_part(y, x, parts, index, scale)
    require_gpu_tensor(x, INTERPRETED)
    if y.stride(-1) != 1:
        raise ValueError("y must have contiguous columns")
    x = inner_contiguous(x)
    firsts = [first for first, _, _ in parts]
    a_s = [inner_contiguous(a) for _, a, _ in parts]
    b_s = [inner_contiguous(b_t) for _, _, b_t in parts]
    rank, in_features = a_s[0].shape[-2], a_s[0].shape[-1]
    widths = [b.shape[-1] for b in b_s]
    a_offsets = [_element_offset(a, a_s[0]) for a in a_s]
    b_offsets = [_element_offset(b, b_s[0]) for b in b_s]
    if (any(a.shape[-2:] != a_s[0].shape[-2:] or a.stride() != a_s[0].stride() or a.dtype != a_s[0].dtype
            for a in a_s)
            or any(b.shape[-2] != rank or b.dtype != b_s[0].dtype for b in b_s)
            or None in a_offsets + b_offsets or rank == 0):
        return _each_part(y, x, parts, index, scale)  # parts that do not share one layout
    block_r, block_k, block_n, warps = _tile_shape(rank, in_features, max(widths))
    tiles = [triton.cdiv(width, block_n) for width in widths]
    if sum(tiles) * rank * in_features > _FUSED_READS:  # each tile would read A again: too much (large models)
        return _each_part(y, x, parts, index, scale)
    pad = 3 - len(parts)  # a third part that does not exist: no tiles
    a_offsets, b_offsets = a_offsets + [0] * pad, b_offsets + [0] * pad
    rel = [first - firsts[0] for first in firsts] + [0] * pad
    widths, tiles = widths + [0] * pad, tiles + [0] * pad
    bs = [b.stride(0) for b in b_s] + [0] * pad
    br = [b.stride(1) for b in b_s] + [0] * pad
    try:
        _parts_kernel[(x.shape[0], sum(tiles))](
            x, a_s[0], b_s[0], y[:, firsts[0]:], index, scale, a_offsets[1], a_offsets[2], b_offsets[1],
            b_offsets[2], rel[1], rel[2], widths[0], widths[1], widths[2], bs[0], bs[1], bs[2], br[0], br[1], br[2],
            tiles[0], tiles[1], x.stride(0), a_s[0].stride(0), a_s[0].stride(1), y.stride(0), in_features, rank,
            BLOCK_R=block_r, BLOCK_K=block_k, BLOCK_N=block_n, num_warps=warps)
    except Exception as err:  # noqa: BLE001 - a compiler we never ran it on: one launch a part, as before
        if INTERPRETED or _common.compiling_only:  # the offline compile is there to see this fail
            raise
        _parts_failed = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        log.warning("kvshare: the multi-part BGMV kernel failed to launch (%s); LoRA parts launch one by one",
                    _parts_failed)
        _each_part(y, x, parts, index, scale)


def bgmv_lora_add(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b_t: torch.Tensor, index: torch.Tensor,
                  scale: torch.Tensor) -> None:
    """``y[r] += scale[r] * (x[r] A[index[r]]^T) B^T[index[r]]`` for every row r, in place.

    ``a`` is (slots, rank, in), ``b_t`` (slots, rank, out) as the slot stacks hold them;
    ``index`` (rows,) long, ``scale`` (rows,) float32; rows of scale 0 are left as they are.
    ``y`` may be a column slice of a wider output (its columns contiguous). Reads nothing on
    the host, so a CUDA graph can record it.
    """
    require_gpu_tensor(x, INTERPRETED)
    rows, rank = x.shape[0], a.shape[-2]
    if rows == 0 or rank == 0:
        return
    if y.stride(-1) != 1:
        raise ValueError("y must have contiguous columns")
    x, a, b_t = inner_contiguous(x), inner_contiguous(a), inner_contiguous(b_t)
    in_features, out_features = a.shape[-1], b_t.shape[-1]
    block_r, block_k, block_n, warps = _tile_shape(rank, in_features, out_features)
    tiles = triton.cdiv(out_features, block_n)
    if tiles * rank * in_features <= _FUSED_READS:
        _fused_kernel[(rows, tiles)](x, a, b_t, y, index, scale, x.stride(0), a.stride(0), a.stride(1),
                                     b_t.stride(0), b_t.stride(1), y.stride(0), in_features, out_features, rank,
                                     BLOCK_R=block_r, BLOCK_K=block_k, BLOCK_N=block_n, num_warps=warps)
        return
    t = torch.empty(rows, block_r, dtype=torch.float32, device=x.device)
    _shrink_kernel[(rows,)](x, a, t, index, scale, x.stride(0), a.stride(0), a.stride(1), in_features, rank,
                            BLOCK_R=block_r, BLOCK_K=block_k, num_warps=warps)
    _expand_kernel[(rows, tiles)](t, b_t, y, index, scale, b_t.stride(0), b_t.stride(1), y.stride(0),
                                  out_features, rank, BLOCK_R=block_r, BLOCK_N=block_n, num_warps=warps)
