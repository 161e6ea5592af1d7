"""Multi-adapter LoRA with each row's adapter slot read on the device (BGMV): the LoRA of the
CUDA-graph decode step (:mod:`kvshare.serve.cuda_graphs`).

The segment kernels (:mod:`.lora`) size their grid from the step's segments on the host; a
graph replays one fixed grid over whatever rows the next step brings. Here every row is a
program that reads its own slot and scale from the step's static buffers, as vLLM's punica
BGMV kernels do for decode, and rows of scale 0 (an ICaRus pair's base row, rows without an
adapter, pad rows) return at once. *Shrink* ``t = x A[slot]^T`` (float32) and *expand*
``y += scale * t B[slot]`` into the projection's output columns, in place, are one launch
where each column tile can afford to compute ``t`` again (small models: a launch costs more
than those reads), else two, through float32 scratch. The gather form they replace in the
graph (:func:`kvshare.serve.lora_slots.lora_delta`, their reference) records eight to ten
kernels a projection (``results/engine-gpu/scripts/count_launches.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

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
    block_r = triton.next_power_of_2(rank)
    block_k = max(16, min(triton.next_power_of_2(in_features), _TILE // block_r))
    block_n = max(16, min(triton.next_power_of_2(out_features), _TILE // block_r))
    tiles = triton.cdiv(out_features, block_n)
    warps = max(4, min(_MAX_WARPS, block_r * max(block_k, block_n) // 2048))  # 4 up to 8k elements a tile
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
