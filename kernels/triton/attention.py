"""Paged attention and the KV write as Triton kernels (drop-in for the torch references).

Attention: one program per (sequence, block of that sequence's query rows, KV head). Its
query tile holds every query head that shares the KV head for each of its rows (GQA, as in
SGLang's grouped decode kernel), flattened to ``rows x group`` lines, so each K/V tile is
read once per KV head for all of them: an ICaRus pair (base and adapter row of one token)
costs one pass over the keys, not one per row or per head, and a prefill chunk one pass per
tile of 64 / group rows (each tile stops at its own last row's keys). Each line
stops at its own row's position (``positions``), so decode rows, read-only rows, ICaRus
pairs and prefill chunks that continue cached context mix in one launch. Keys are found
through the block tables; softmax is computed online (flash attention), in float32.

When that grid is too small to fill the GPU (a few sequences decoding long contexts: one
program per sequence and KV head), the key axis is split too (flash decoding): each split
writes its unnormalised partial output with its running max and sum, and a second kernel
merges the splits of each row and head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from ..metadata import AttentionMetadata
from ._common import dot_precision, inner_contiguous, require_gpu_tensor

_TILE_LINES = 64  # query lines (rows x heads of a group) per program; >= 16 for tl.dot
_BLOCK_N = 32  # keys per step of the loop over a sequence's context
# load a step's block-table entries one step ahead (session 28, untimed): Triton's pipeliner
# already overlaps the table -> K/V chain with async copies over 3 stages (seen in the sm_90
# build, offline_compile), so this stays off until a GPU sweep (attention_sweep.py) says it helps
_PREFETCH_TABLE = False


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, part_acc_ptr, part_best_ptr, part_total_ptr,
    positions_ptr, loc_ptr, tables_ptr,
    stride_qr, stride_qh, stride_or, stride_oh,
    stride_kb, stride_ko, stride_kh, stride_vb, stride_vo, stride_vh,
    stride_table, block_size, scale, num_splits, min_split_keys,
    GROUP: tl.constexpr, HEADS_PAD: tl.constexpr, ROWS: tl.constexpr, SPLIT: tl.constexpr,
    HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    seq = tl.program_id(0)
    row_block = tl.program_id(1)
    kv_head = tl.program_id(2) // num_splits
    split = tl.program_id(2) % num_splits
    first = tl.load(loc_ptr + seq)
    last = tl.load(loc_ptr + seq + 1)
    row_start = first + row_block * ROWS
    if row_start < last:
        lines = tl.arange(0, ROWS * HEADS_PAD)
        rows = row_start + lines // HEADS_PAD
        heads = kv_head * GROUP + lines % HEADS_PAD
        line_ok = (rows < last) & (lines % HEADS_PAD < GROUP)
        dims = tl.arange(0, DIM_PAD)
        dim_ok = dims < HEAD_DIM
        q = tl.load(q_ptr + rows[:, None] * stride_qr + heads[:, None] * stride_qh + dims[None, :],
                    mask=line_ok[:, None] & dim_ok[None, :], other=0.0)
        # a line outside the tile's rows sees no key (-1); the loop ends after the last
        # key any row of the tile may see
        limit = tl.load(positions_ptr + rows, mask=line_ok, other=-1)
        end = tl.max(limit, axis=0) + 1
        lo = 0
        if SPLIT:  # this program's share of the tile's keys: [lo, lo + split_keys), maybe none
            split_keys = tl.maximum(tl.cdiv(tl.cdiv(end, num_splits), BLOCK_N) * BLOCK_N, min_split_keys)
            lo = split * split_keys
            end = tl.minimum(end, lo + split_keys)
        best = tl.full([ROWS * HEADS_PAD], -1.0e30, tl.float32)  # finite: no inf - inf
        total = tl.zeros([ROWS * HEADS_PAD], tl.float32)
        acc = tl.zeros([ROWS * HEADS_PAD, DIM_PAD], tl.float32)
        keys = tl.arange(0, BLOCK_N)
        table = tables_ptr + seq * stride_table
        # PREFETCH: each step's blocks are loaded one step ahead, so that a step waits for one
        # load (its K and V) instead of two in a row (the table, then K/V through it)
        if PREFETCH:
            block = tl.load(table + (lo + keys) // block_size, mask=lo + keys < end, other=0).to(tl.int64)
        for start in range(lo, end, BLOCK_N):
            key = start + keys
            key_ok = key < end
            if PREFETCH:  # int64: block * stride may pass 2**31 in a large cache
                ahead = key + BLOCK_N
                block_ahead = tl.load(table + ahead // block_size, mask=ahead < end, other=0).to(tl.int64)
            else:  # the step's own blocks, loaded now (the default)
                block = tl.load(table + key // block_size, mask=key_ok, other=0).to(tl.int64)
            offset = key % block_size
            kv_ok = key_ok[:, None] & dim_ok[None, :]
            k = tl.load(k_ptr + block[:, None] * stride_kb + offset[:, None] * stride_ko
                        + kv_head * stride_kh + dims[None, :], mask=kv_ok, other=0.0)
            scores = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION) * scale
            scores = tl.where(key[None, :] <= limit[:, None], scores, float("-inf"))
            new_best = tl.maximum(best, tl.max(scores, axis=1))
            probs = tl.exp(scores - new_best[:, None])
            keep = tl.exp(best - new_best)
            v = tl.load(v_ptr + block[:, None] * stride_vb + offset[:, None] * stride_vo
                        + kv_head * stride_vh + dims[None, :], mask=kv_ok, other=0.0)
            acc = acc * keep[:, None] + tl.dot(probs.to(q.dtype), v.to(q.dtype), input_precision=PRECISION)
            total = total * keep + tl.sum(probs, axis=1)
            best = new_best
            if PREFETCH:
                block = block_ahead
        if SPLIT:  # partials of (row, head, split), merged by _merge_splits_kernel
            n_q = GROUP * (tl.num_programs(2) // num_splits)  # query heads: GROUP per KV head
            part = (rows * n_q + heads) * num_splits + split
            tl.store(part_best_ptr + part, best, mask=line_ok)
            tl.store(part_total_ptr + part, total, mask=line_ok)
            tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc,
                     mask=line_ok[:, None] & dim_ok[None, :])
        else:
            out = acc / tl.where(total > 0, total, 1.0)[:, None]
            tl.store(out_ptr + rows[:, None] * stride_or + heads[:, None] * stride_oh + dims[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=line_ok[:, None] & dim_ok[None, :])


@triton.jit
def _merge_splits_kernel(part_acc_ptr, part_best_ptr, part_total_ptr, out_ptr, loc_ptr, stride_or, stride_oh,
                         num_splits, num_seqs, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
                         SPLITS_PAD: tl.constexpr):
    """One program per (row, query head): rescale each split to the largest max and sum. A row
    past the last sequence's (a CUDA graph's pad row) had no partials written: it reads none
    of the scratch's leftovers and gets zeros."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    split_ok = splits < tl.where(row < tl.load(loc_ptr + num_seqs), num_splits, 0)
    part = (row * tl.num_programs(1) + head) * num_splits + splits
    best = tl.load(part_best_ptr + part, mask=split_ok, other=-1.0e30)
    total = tl.load(part_total_ptr + part, mask=split_ok, other=0.0)
    weight = tl.exp(best - tl.max(best, axis=0))  # a split that saw no key: best -1e30, weight 0
    dims = tl.arange(0, DIM_PAD)
    dim_ok = dims < HEAD_DIM
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + dims[None, :],
                  mask=split_ok[:, None] & dim_ok[None, :], other=0.0)
    total = tl.sum(total * weight, axis=0)  # 0 only on a graph's pad row (no keys): stays finite
    out = tl.sum(acc * weight[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + row * stride_or + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty), mask=dim_ok)


INTERPRETED = isinstance(_paged_attention_kernel, InterpretedFunction)  # set by TRITON_INTERPRET at import


_MIN_SPLIT_KEYS = 256  # fewer keys per split: the merge costs more than the parallelism gains


_SMS: dict[int, int] = {}  # multiprocessors per GPU index, asked once


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    if device.index not in _SMS:
        _SMS[device.index] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SMS[device.index]


def key_splits(programs: int, longest: int, device: torch.device) -> int:
    """How many parts to split each sequence's keys into: enough programs for two per SM, none
    shorter than ``_MIN_SPLIT_KEYS`` keys; 1 (no split) when the grid fills the GPU already."""
    target = 2 * _num_sms(device)
    if programs >= target or longest < 2 * _MIN_SPLIT_KEYS:
        return 1
    return max(1, min(triton.cdiv(target, programs), longest // _MIN_SPLIT_KEYS))


@dataclass(frozen=True)
class AttentionLaunch:
    """The grid of one paged-attention launch: worked out per call from the step's host-side
    layout, or fixed once for a CUDA graph that replays it (:mod:`kvshare.serve.exec.cuda_graphs`),
    where programs past a step's sequences or rows find no rows and return."""

    seqs: int  # programs along the sequences
    tile_rows: int  # query rows per program (a power of two; times the group's heads >= 16 lines)
    row_blocks: int  # programs along one sequence's rows
    splits: int  # parts of each tile's keys (flash decoding), merged by a second kernel
    min_split_keys: int  # no split is shorter, except the last of a tile


def launch_shape(n_q: int, n_kv: int, seqs: int, most_rows: int, longest: int, device: torch.device,
                 splits: int | None = None) -> AttentionLaunch:
    """The grid for ``seqs`` sequences of at most ``most_rows`` rows and ``longest`` keys.
    ``splits`` given: that many even parts (at least one key tile each); else chosen from the
    grid's size and the GPU's (:func:`key_splits`; 1 in Triton's interpreter)."""
    heads_pad = triton.next_power_of_2(n_q // n_kv)
    tile_rows = max(1, min(triton.next_power_of_2(most_rows), _TILE_LINES // heads_pad))
    tile_rows = max(tile_rows, 16 // heads_pad)  # tl.dot wants at least 16 lines
    row_blocks = triton.cdiv(most_rows, tile_rows)
    if splits is not None:
        return AttentionLaunch(seqs, tile_rows, row_blocks, max(1, splits), _BLOCK_N)
    splits = 1 if INTERPRETED else key_splits(seqs * row_blocks * n_kv, longest, device)
    return AttentionLaunch(seqs, tile_rows, row_blocks, splits, _MIN_SPLIT_KEYS)


def split_partials(rows: int, n_q: int, d: int, launch: AttentionLaunch,
                   device: torch.device) -> tuple[torch.Tensor, ...] | None:
    """Scratch for the splits' partial outputs, running maxima and sums (None: no split)."""
    if launch.splits == 1:
        return None
    best = torch.empty(rows, n_q, launch.splits, dtype=torch.float32, device=device)
    return torch.empty(rows, n_q, launch.splits, d, dtype=torch.float32, device=device), best, torch.empty_like(best)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, splits: int | None = None) -> torch.Tensor:
    """Causal GQA attention of query rows (rows, q_heads, d) over their sequences' paged K/V.

    ``splits`` parts of the key axis per program (flash decoding); default: chosen from the
    grid's size and the GPU's (:func:`key_splits`; 1 in Triton's interpreter).
    """
    rows, n_q, d = q.shape
    n_kv = k_cache.shape[2]
    if n_q % n_kv:
        raise ValueError(f"{n_q} query heads do not share {n_kv} KV heads evenly")
    require_gpu_tensor(q, INTERPRETED)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # dense: the stores assume it, q may not be
    if rows == 0 or not meta.seq_bounds:
        return out
    most_rows = max(end - start for start, end in meta.seq_bounds)  # host-side: no device read
    launch = launch_shape(n_q, n_kv, len(meta.seq_bounds), most_rows, max(meta.seq_context), q.device, splits)
    launch_paged_attention(out, split_partials(rows, n_q, d, launch, q.device), q, k_cache, v_cache,
                           meta.positions, meta.query_start_loc, meta.block_tables, meta.block_size, scale, launch)
    return out


def launch_paged_attention(out: torch.Tensor, partials: tuple[torch.Tensor, ...] | None, q: torch.Tensor,
                           k_cache: torch.Tensor, v_cache: torch.Tensor, positions: torch.Tensor,
                           query_start_loc: torch.Tensor, block_tables: torch.Tensor, block_size: int,
                           scale: float, launch: AttentionLaunch) -> None:
    """Attention of ``q`` into ``out`` (same shape) with the grid ``launch``; ``partials`` from
    :func:`split_partials`. Reads nothing from the device on the host, so a CUDA graph can
    capture it."""
    rows, n_q, d = q.shape
    n_kv = k_cache.shape[2]
    q = inner_contiguous(q)
    k_cache, v_cache = inner_contiguous(k_cache), inner_contiguous(v_cache)
    group = n_q // n_kv
    dim_pad = max(16, triton.next_power_of_2(d))
    splits = launch.splits
    part_acc, part_best, part_total = partials if splits > 1 else (out, out, out)  # unused without splits
    grid = (launch.seqs, launch.row_blocks, n_kv * splits)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, part_acc, part_best, part_total,
        positions, query_start_loc, block_tables,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), block_size, scale, splits, launch.min_split_keys,
        GROUP=group, HEADS_PAD=triton.next_power_of_2(group), ROWS=launch.tile_rows, SPLIT=splits > 1,
        HEAD_DIM=d, DIM_PAD=dim_pad, BLOCK_N=_BLOCK_N, PRECISION=dot_precision(q.dtype),
        PREFETCH=_PREFETCH_TABLE,
    )
    if splits > 1:
        _merge_splits_kernel[(rows, n_q)](part_acc, part_best, part_total, out, query_start_loc, out.stride(0),
                                          out.stride(1), splits, launch.seqs, HEAD_DIM=d, DIM_PAD=dim_pad,
                                          SPLITS_PAD=max(2, triton.next_power_of_2(splits)))


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slots_ptr, stride_kr, stride_vr,
                     stride_kb, stride_ko, stride_vb, stride_vo, block_size, width,
                     BLOCK: tl.constexpr):
    row = tl.program_id(0)
    part = tl.program_id(1)
    slot = tl.load(slots_ptr + row).to(tl.int64)  # int64 offsets whatever the slots' dtype (large caches)
    if slot >= 0:  # -1: a read-only row, nothing to store
        block = slot // block_size
        offset = slot % block_size
        cols = part * BLOCK + tl.arange(0, BLOCK)
        ok = cols < width
        k = tl.load(k_ptr + row * stride_kr + cols, mask=ok)
        v = tl.load(v_ptr + row * stride_vr + cols, mask=ok)
        tl.store(k_cache_ptr + block * stride_kb + offset * stride_ko + cols,
                 k.to(k_cache_ptr.dtype.element_ty), mask=ok)
        tl.store(v_cache_ptr + block * stride_vb + offset * stride_vo + cols,
                 v.to(v_cache_ptr.dtype.element_ty), mask=ok)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slots: torch.Tensor, write_rows: torch.Tensor | None = None) -> None:
    """Store rows' K/V at flat slot indices (block * block_size + offset); -1 = do not store.

    Every row gets a program that reads its own slot, so ``write_rows`` (which the torch
    reference uses to avoid a boolean filter) is not needed here; it is accepted for the
    same signature.
    """
    require_gpu_tensor(k, INTERPRETED)
    rows = k.shape[0]
    if rows == 0:
        return
    width = k.shape[1] * k.shape[2]  # a slot's kv_heads x head_dim values are contiguous
    k, v = k.reshape(rows, width), v.reshape(rows, width)
    k, v = inner_contiguous(k), inner_contiguous(v)
    for cache in (k_cache, v_cache):
        if cache.stride(2) != cache.shape[3] or cache.stride(3) != 1:
            raise ValueError("a KV cache slot must be contiguous (kv_heads, head_dim)")
    block = min(triton.next_power_of_2(width), 1024)
    _write_kv_kernel[(rows, triton.cdiv(width, block))](
        k, v, k_cache, v_cache, slots, k.stride(0), v.stride(0),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        k_cache.shape[1], width, BLOCK=block,
    )

