"""ForkKV's residual attention as a Triton kernel (drop-in for the torch reference).

Same program layout as :mod:`.attention`: one program per (sequence, tile of its query rows,
KV head), the query heads of a GQA group flattened into the tile's lines, so each key tile is
read once for all of them; online softmax in float32. What is new is per key tile: the
residual rows ``R_k`` (rank r) are read through the residual pool's own block tables,
expanded by the sequence's adapter ``scale B_k`` (loaded once per program) and rotated at the
keys' positions before they are added to the base keys. RoPE's ``rotate_half`` is folded
into a second copy of B with its halves swapped and one negated, so the rotation is a second
rank-r product instead of a shuffle of the tile. Values are never rebuilt: ``P V_base`` and
``P R_v`` accumulate side by side under one rescaling, and ``scale B_v`` turns the (lines, r)
residual sum into (lines, head_dim) once, after the loop.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from ..metadata import AttentionMetadata
from ..residual_attention import ResidualMetadata
from ._common import dot_precision, inner_contiguous, require_gpu_tensor

_TILE_LINES = 64  # query lines (rows x heads of a group) per program; >= 16 for tl.dot
_BLOCK_N = 32  # keys per step of the loop over a sequence's context


@triton.jit
def _residual_attention_kernel(
    q_ptr, k_ptr, v_ptr, rk_ptr, rv_ptr, bk_ptr, bv_ptr, scales_ptr, cos_ptr, sin_ptr, out_ptr,
    positions_ptr, loc_ptr, tables_ptr, res_tables_ptr, adapter_ptr,
    stride_qr, stride_qh, stride_or, stride_oh,
    stride_kb, stride_ko, stride_kh, stride_vb, stride_vo, stride_vh,
    stride_rkb, stride_rko, stride_rvb, stride_rvo,
    stride_bka, stride_bkr, stride_bva, stride_bvr, stride_cos, stride_sin,
    stride_table, stride_res_table, block_size, res_block_size, rank, scale,
    GROUP: tl.constexpr, HEADS_PAD: tl.constexpr, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr, RANK_PAD: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    row_block = tl.program_id(1)
    kv_head = tl.program_id(2)
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
        ranks = tl.arange(0, RANK_PAD)
        rank_ok = ranks < rank
        q = tl.load(q_ptr + rows[:, None] * stride_qr + heads[:, None] * stride_qh + dims[None, :],
                    mask=line_ok[:, None] & dim_ok[None, :], other=0.0)
        # this sequence's adapter: scale * B_k and scale * B_v rows of this KV head, (d, r)
        adapter = tl.load(adapter_ptr + seq).to(tl.int64)
        lora_scale = tl.load(scales_ptr + adapter)
        b_ok = dim_ok[:, None] & rank_ok[None, :]
        out_rows = kv_head * HEAD_DIM + dims
        bk = tl.load(bk_ptr + adapter * stride_bka + out_rows[:, None] * stride_bkr + ranks[None, :],
                     mask=b_ok, other=0.0).to(tl.float32) * lora_scale
        # rotate_half(R B^T) = R B_rot^T: B_rot row j is -B[j + d/2] (first half), B[j - d/2]
        half = HEAD_DIM // 2
        swapped = kv_head * HEAD_DIM + (dims + half) % HEAD_DIM
        sign = tl.where(dims < half, -1.0, 1.0)
        bk_rot = tl.load(bk_ptr + adapter * stride_bka + swapped[:, None] * stride_bkr + ranks[None, :],
                         mask=b_ok, other=0.0).to(tl.float32) * (sign * lora_scale)[:, None]
        limit = tl.load(positions_ptr + rows, mask=line_ok, other=-1)
        end = tl.max(limit, axis=0) + 1
        best = tl.full([ROWS * HEADS_PAD], -1.0e30, tl.float32)  # finite: no inf - inf
        total = tl.zeros([ROWS * HEADS_PAD], tl.float32)
        acc = tl.zeros([ROWS * HEADS_PAD, DIM_PAD], tl.float32)
        acc_res = tl.zeros([ROWS * HEADS_PAD, RANK_PAD], tl.float32)
        keys = tl.arange(0, BLOCK_N)
        for start in range(0, end, BLOCK_N):
            key = start + keys
            key_ok = key < end
            block = tl.load(tables_ptr + seq * stride_table + key // block_size, mask=key_ok, other=0)
            block = block.to(tl.int64)  # block * stride may pass 2**31 in a large cache
            offset = key % block_size
            res_block = tl.load(res_tables_ptr + seq * stride_res_table + key // res_block_size,
                                mask=key_ok, other=0).to(tl.int64)
            res_offset = key % res_block_size
            kv_ok = key_ok[:, None] & dim_ok[None, :]
            res_ok = key_ok[:, None] & rank_ok[None, :]
            r_k = tl.load(rk_ptr + res_block[:, None] * stride_rkb + res_offset[:, None] * stride_rko
                          + ranks[None, :], mask=res_ok, other=0.0).to(tl.float32)
            cos = tl.load(cos_ptr + key[:, None] * stride_cos + dims[None, :], mask=kv_ok, other=0.0)
            sin = tl.load(sin_ptr + key[:, None] * stride_sin + dims[None, :], mask=kv_ok, other=0.0)
            delta = tl.dot(r_k, tl.trans(bk), input_precision=PRECISION)
            delta_rot = tl.dot(r_k, tl.trans(bk_rot), input_precision=PRECISION)
            k = tl.load(k_ptr + block[:, None] * stride_kb + offset[:, None] * stride_ko
                        + kv_head * stride_kh + dims[None, :], mask=kv_ok, other=0.0)
            k = k.to(tl.float32) + delta * cos.to(tl.float32) + delta_rot * sin.to(tl.float32)
            scores = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION) * scale
            scores = tl.where(key[None, :] <= limit[:, None], scores, float("-inf"))
            new_best = tl.maximum(best, tl.max(scores, axis=1))
            probs = tl.exp(scores - new_best[:, None])
            keep = tl.exp(best - new_best)
            v = tl.load(v_ptr + block[:, None] * stride_vb + offset[:, None] * stride_vo
                        + kv_head * stride_vh + dims[None, :], mask=kv_ok, other=0.0)
            r_v = tl.load(rv_ptr + res_block[:, None] * stride_rvb + res_offset[:, None] * stride_rvo
                          + ranks[None, :], mask=res_ok, other=0.0)
            acc = acc * keep[:, None] + tl.dot(probs.to(q.dtype), v.to(q.dtype), input_precision=PRECISION)
            acc_res = acc_res * keep[:, None] + tl.dot(probs.to(q.dtype), r_v.to(q.dtype),
                                                       input_precision=PRECISION)
            total = total * keep + tl.sum(probs, axis=1)
            best = new_best
        bv = tl.load(bv_ptr + adapter * stride_bva + out_rows[:, None] * stride_bvr + ranks[None, :],
                     mask=b_ok, other=0.0).to(tl.float32) * lora_scale
        acc += tl.dot(acc_res, tl.trans(bv), input_precision=PRECISION)  # B_v once, after the sum
        out = acc / tl.where(total > 0, total, 1.0)[:, None]
        tl.store(out_ptr + rows[:, None] * stride_or + heads[:, None] * stride_oh + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=line_ok[:, None] & dim_ok[None, :])


INTERPRETED = isinstance(_residual_attention_kernel, InterpretedFunction)  # set by TRITON_INTERPRET at import


def residual_attention(q: torch.Tensor, k_base_cache: torch.Tensor, v_base_cache: torch.Tensor,
                       k_res_cache: torch.Tensor, v_res_cache: torch.Tensor, b_k: torch.Tensor,
                       b_v: torch.Tensor, lora_scales: torch.Tensor, rope_cos: torch.Tensor,
                       rope_sin: torch.Tensor, meta: AttentionMetadata, residual: ResidualMetadata,
                       scale: float) -> torch.Tensor:
    """Causal GQA attention of query rows over ForkKV's base and residual pools; arguments as
    :func:`kvshare.kernels.residual_attention.residual_attention_ref`."""
    rows, n_q, d = q.shape
    n_kv = k_base_cache.shape[2]
    if n_q % n_kv:
        raise ValueError(f"{n_q} query heads do not share {n_kv} KV heads evenly")
    if d % 2:
        raise ValueError("RoPE needs an even head_dim")
    require_gpu_tensor(q, INTERPRETED)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # dense: the stores assume it, q may not be
    if rows == 0 or not meta.seq_bounds:
        return out
    rank = k_res_cache.shape[-1]
    q = inner_contiguous(q)
    k_base_cache, v_base_cache = inner_contiguous(k_base_cache), inner_contiguous(v_base_cache)
    k_res_cache, v_res_cache = inner_contiguous(k_res_cache), inner_contiguous(v_res_cache)
    b_k, b_v = inner_contiguous(b_k), inner_contiguous(b_v)
    rope_cos, rope_sin = inner_contiguous(rope_cos), inner_contiguous(rope_sin)
    lora_scales = lora_scales.to(torch.float32)
    group = n_q // n_kv
    heads_pad = triton.next_power_of_2(group)
    most_rows = max(end - start for start, end in meta.seq_bounds)  # host-side: no device read
    tile_rows = max(1, min(triton.next_power_of_2(most_rows), _TILE_LINES // heads_pad))
    tile_rows = max(tile_rows, 16 // heads_pad)  # tl.dot wants at least 16 lines
    tables, res_tables = meta.block_tables, residual.block_tables
    grid = (len(meta.seq_bounds), triton.cdiv(most_rows, tile_rows), n_kv)
    _residual_attention_kernel[grid](
        q, k_base_cache, v_base_cache, k_res_cache, v_res_cache, b_k, b_v, lora_scales,
        rope_cos, rope_sin, out, meta.positions, meta.query_start_loc, tables, res_tables,
        residual.seq_adapter,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_base_cache.stride(0), k_base_cache.stride(1), k_base_cache.stride(2),
        v_base_cache.stride(0), v_base_cache.stride(1), v_base_cache.stride(2),
        k_res_cache.stride(0), k_res_cache.stride(1), v_res_cache.stride(0), v_res_cache.stride(1),
        b_k.stride(0), b_k.stride(1), b_v.stride(0), b_v.stride(1), rope_cos.stride(0), rope_sin.stride(0),
        tables.stride(0), res_tables.stride(0), meta.block_size, residual.block_size, rank, scale,
        GROUP=group, HEADS_PAD=heads_pad, ROWS=tile_rows, HEAD_DIM=d,
        DIM_PAD=max(16, triton.next_power_of_2(d)), RANK_PAD=max(16, triton.next_power_of_2(rank)),
        BLOCK_N=_BLOCK_N, PRECISION=dot_precision(q.dtype),
    )
    return out
