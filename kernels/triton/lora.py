"""Multi-adapter LoRA as two Triton kernels over segments of rows (SGMV-style).

A batch's rows are put in segments, one per adapter that adapts the projection (rows with
no adapter, or whose adapter leaves this projection alone, are in none). *Shrink* computes
``x A^T`` for every segment row in one launch, *expand* adds ``scale * (x A^T) B^T`` to the
base output in another (vLLM's lora_shrink/lora_expand and SGLang's sgemm_lora_a/b have
the same split). Each program handles a tile of one segment's rows and reads that
adapter's A or B once for the whole tile, whatever the rows' places in the batch.

Adapters' ranks differ, so their weights are stacked zero-padded to the largest rank;
stacks are built once per weights list (the engine's adapter lookup keeps the same tensors
until adapters change) and cached; the padding adds exact zeros.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from ._common import dot_precision, inner_contiguous, require_gpu_tensor

_BLOCK_M = 16  # segment rows per program
_BLOCK_K = 32  # input features per step of the shrink
_BLOCK_N = 32  # output features per expand program
_CACHED_STACKS = 1024  # one per (layer, fused projection) in use, with room to spare


@dataclass
class LoraSegments:
    """Rows grouped by adapter, as tensors a kernel can walk without asking the host."""

    rows: torch.Tensor  # (n,) long: batch rows, segment after segment
    starts: torch.Tensor  # (S + 1,) int32: segment s is rows[starts[s]:starts[s + 1]]
    adapters: torch.Tensor  # (S,) int32: each segment's adapter slot
    longest: int  # most rows in one segment (host-side, sizes the launch grid)


@dataclass
class StackedLora:
    a: torch.Tensor  # (slots, max rank, in): A of each slot, rows past its rank zero
    b: torch.Tensor  # (slots, out, max rank): B of each slot, columns past its rank zero
    scales: torch.Tensor  # (slots,) float32


_segments: OrderedDict[tuple, tuple[list[weakref.ref], LoraSegments]] = OrderedDict()
_CACHED_SEGMENTS = 16  # a step's groups give one segment set per pattern of adapted slots


def lora_segments(groups: list[tuple[int, torch.Tensor]],
                  weights: list[tuple[torch.Tensor, torch.Tensor, float] | None]) -> LoraSegments | None:
    """Segments for the groups whose adapter adapts this projection; None if there are none.

    Sizes come from tensor shapes and the host-side slot numbers, so nothing waits on the
    device; a step's layers share the result (cached on the groups' row tensors), so the
    small host-to-device copies happen once per step, not once per projection.
    """
    used = [(slot, rows) for slot, rows in groups if weights[slot] is not None and len(rows)]
    if not used:
        return None
    key = tuple((slot, id(rows)) for slot, rows in used)
    hit = _segments.get(key)
    if hit is not None and all(ref() is rows for ref, (_, rows) in zip(hit[0], used)):
        _segments.move_to_end(key)
        return hit[1]
    segments = _build_segments(used)
    _segments[key] = ([weakref.ref(rows) for _, rows in used], segments)
    while len(_segments) > _CACHED_SEGMENTS:
        _segments.popitem(last=False)
    return segments


def _build_segments(used: list[tuple[int, torch.Tensor]]) -> LoraSegments:
    device = used[0][1].device
    starts = [0]
    for _, rows in used:
        starts.append(starts[-1] + len(rows))
    return LoraSegments(
        rows=torch.cat([rows for _, rows in used]),
        starts=torch.tensor(starts, dtype=torch.int32).to(device, non_blocking=True),
        adapters=torch.tensor([slot for slot, _ in used], dtype=torch.int32).to(device, non_blocking=True),
        longest=max(len(rows) for _, rows in used),
    )


_stacks: OrderedDict[tuple, tuple[list[weakref.ref], StackedLora]] = OrderedDict()


def stack_lora_weights(weights: list[tuple[torch.Tensor, torch.Tensor, float] | None]) -> StackedLora:
    """Every slot's (A, B, scale) in three tensors (a None slot: zeros), cached per weights."""
    sources = [t for entry in weights if entry is not None for t in entry[:2]]
    key = tuple(None if entry is None else (id(entry[0]), id(entry[1]), entry[2]) for entry in weights)
    hit = _stacks.get(key)
    if hit is not None and all(ref() is t for ref, t in zip(hit[0], sources)):
        _stacks.move_to_end(key)
        return hit[1]
    present = [entry for entry in weights if entry is not None]
    if not present:
        raise ValueError("no adapter slot has weights for this projection")
    a0, b0, _ = present[0]
    rank = max(a.shape[0] for a, _, _ in present)
    a_stack = a0.new_zeros(len(weights), rank, a0.shape[1])
    b_stack = b0.new_zeros(len(weights), b0.shape[0], rank)
    scales = torch.zeros(len(weights), dtype=torch.float32)
    for slot, entry in enumerate(weights):
        if entry is not None:
            a, b, scale = entry
            a_stack[slot, :a.shape[0]] = a
            b_stack[slot, :, :b.shape[1]] = b
            scales[slot] = scale
    stacked = StackedLora(a_stack, b_stack, scales.to(a0.device))
    for old in [k for k, (refs, _) in _stacks.items() if any(ref() is None for ref in refs)]:
        del _stacks[old]  # weights since unloaded
    _stacks[key] = ([weakref.ref(t) for t in sources], stacked)
    while len(_stacks) > _CACHED_STACKS:
        _stacks.popitem(last=False)
    return stacked


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, out_ptr, rows_ptr, dest_ptr, starts_ptr, adapters_ptr,
                   stride_xr, stride_as, stride_ar, stride_or, in_features, rank,
                   BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                   PRECISION: tl.constexpr):
    tile = tl.program_id(0)
    r_block = tl.program_id(1)
    seg = tl.program_id(2)
    first = tl.load(starts_ptr + seg)
    last = tl.load(starts_ptr + seg + 1)
    lo = first + tile * BLOCK_M
    if lo < last:
        index = lo + tl.arange(0, BLOCK_M)
        row_ok = index < last
        rows = tl.load(rows_ptr + index, mask=row_ok, other=0)
        adapter = tl.load(adapters_ptr + seg).to(tl.int64)
        ranks = r_block * BLOCK_R + tl.arange(0, BLOCK_R)
        rank_ok = ranks < rank
        cols = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
        for k in range(0, in_features, BLOCK_K):
            col_ok = k + cols < in_features
            x = tl.load(x_ptr + rows[:, None] * stride_xr + k + cols[None, :],
                        mask=row_ok[:, None] & col_ok[None, :], other=0.0)
            a = tl.load(a_ptr + adapter * stride_as + ranks[:, None] * stride_ar + k + cols[None, :],
                        mask=rank_ok[:, None] & col_ok[None, :], other=0.0)
            acc += tl.dot(x, tl.trans(a.to(x.dtype)), input_precision=PRECISION)
        dest = tl.load(dest_ptr + index, mask=row_ok, other=0)
        tl.store(out_ptr + dest[:, None] * stride_or + ranks[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & rank_ok[None, :])


@triton.jit
def _expand_kernel(xa_ptr, b_ptr, out_ptr, rows_ptr, starts_ptr, adapters_ptr, scales_ptr,
                   stride_xar, stride_bs, stride_bn, stride_or, out_features, rank,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                   PRECISION: tl.constexpr):
    tile = tl.program_id(0)
    n_block = tl.program_id(1)
    seg = tl.program_id(2)
    first = tl.load(starts_ptr + seg)
    last = tl.load(starts_ptr + seg + 1)
    lo = first + tile * BLOCK_M
    if lo < last:
        index = lo + tl.arange(0, BLOCK_M)
        row_ok = index < last
        rows = tl.load(rows_ptr + index, mask=row_ok, other=0)
        adapter = tl.load(adapters_ptr + seg).to(tl.int64)
        outs = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
        out_ok = outs < out_features
        ranks = tl.arange(0, BLOCK_R)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for r in range(0, rank, BLOCK_R):
            rank_ok = r + ranks < rank
            xa = tl.load(xa_ptr + rows[:, None] * stride_xar + r + ranks[None, :],
                         mask=row_ok[:, None] & rank_ok[None, :], other=0.0).to(tl.float32)
            b = tl.load(b_ptr + adapter * stride_bs + outs[:, None] * stride_bn + r + ranks[None, :],
                        mask=out_ok[:, None] & rank_ok[None, :], other=0.0).to(tl.float32)
            # x·A is not rounded to the weights' dtype (the dot runs in TF32 for a half-precision
            # model, exact float32 for a float32 one); the delta is rounded once, into y
            acc += tl.dot(xa, tl.trans(b), input_precision=PRECISION)
        scale = tl.load(scales_ptr + adapter)
        where = out_ptr + rows[:, None] * stride_or + outs[None, :]
        ok = row_ok[:, None] & out_ok[None, :]
        base = tl.load(where, mask=ok, other=0.0)
        tl.store(where, (base.to(tl.float32) + acc * scale).to(out_ptr.dtype.element_ty), mask=ok)


INTERPRETED = isinstance(_shrink_kernel, InterpretedFunction)  # set by TRITON_INTERPRET at import


def lora_shrink(x: torch.Tensor, a_stack: torch.Tensor, segments: LoraSegments, *,
                out: torch.Tensor | None = None, out_rows: torch.Tensor | None = None) -> torch.Tensor:
    """``x A^T`` (unscaled) of every segment row with its segment's adapter.

    Writes row ``segments.rows[i]`` of the result into row ``out_rows[i]`` of ``out``
    (default: a new float32 (rows of x, max rank) buffer and the same row numbers), so a
    caller can keep x·A in a buffer of its own, e.g. a per-slot residual pool; other rows
    of ``out`` are left as they are.
    """
    require_gpu_tensor(x, INTERPRETED)
    rank, in_features = a_stack.shape[1], a_stack.shape[2]
    if out is None:
        out = torch.empty(x.shape[0], rank, dtype=torch.float32, device=x.device)
    if out_rows is None:
        out_rows = segments.rows
    if out.stride(-1) != 1 or out.shape[-1] < rank:
        raise ValueError("out must hold the largest rank in contiguous columns")
    x, a_stack = inner_contiguous(x), inner_contiguous(a_stack)
    block_r = min(max(16, triton.next_power_of_2(rank)), 64)
    grid = (triton.cdiv(segments.longest, _BLOCK_M), triton.cdiv(rank, block_r), len(segments.adapters))
    _shrink_kernel[grid](x, a_stack, out, segments.rows, out_rows, segments.starts, segments.adapters,
                         x.stride(0), a_stack.stride(0), a_stack.stride(1), out.stride(0), in_features, rank,
                         BLOCK_M=_BLOCK_M, BLOCK_R=block_r, BLOCK_K=_BLOCK_K, PRECISION=dot_precision(x.dtype))
    return out


def lora_expand(xa: torch.Tensor, b_stack: torch.Tensor, scales: torch.Tensor, segments: LoraSegments,
                out: torch.Tensor) -> torch.Tensor:
    """Add ``scale * xa B^T`` of each segment row's adapter to that row of ``out``, in place."""
    require_gpu_tensor(out, INTERPRETED)
    out_features, rank = b_stack.shape[1], b_stack.shape[2]
    if out.stride(-1) != 1:
        raise ValueError("out must have contiguous columns")
    b_stack = inner_contiguous(b_stack)
    block_r = min(max(16, triton.next_power_of_2(rank)), 64)
    grid = (triton.cdiv(segments.longest, _BLOCK_M), triton.cdiv(out_features, _BLOCK_N), len(segments.adapters))
    _expand_kernel[grid](xa, b_stack, out, segments.rows, segments.starts, segments.adapters, scales,
                         xa.stride(0), b_stack.stride(0), b_stack.stride(1), out.stride(0), out_features, rank,
                         BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N, BLOCK_R=block_r, PRECISION=dot_precision(b_stack.dtype))
    return out


def gathered_lora(x: torch.Tensor, base_out: torch.Tensor, groups: list[tuple[int, torch.Tensor]],
                  weights: list[tuple[torch.Tensor, torch.Tensor, float] | None],
                  inplace: bool = False) -> torch.Tensor:
    """Add each row's adapter delta to ``base_out`` (rows, out); returns a new tensor, or
    (``inplace``, where ``base_out`` is contiguous) ``base_out`` itself, updated.

    Same contract as :func:`kvshare.kernels.lora.gathered_lora_ref`.
    """
    segments = lora_segments(groups, weights)
    if segments is None:
        return base_out
    stacked = stack_lora_weights(weights)
    xa = lora_shrink(x, stacked.a, segments)
    out = base_out if inplace and base_out.is_contiguous() else base_out.clone(memory_format=torch.contiguous_format)
    return lora_expand(xa, stacked.b, stacked.scales, segments, out)

