"""ForkKV's residual attention over two paged pools: the plain-torch reference.

For a LoRA'd K/V projection ``y = x W + scale (x A) B`` ForkKV caches, per layer and token,
the base part in a *base pool* (``K_base = RoPE(x W_k)``, ``V_base = x W_v``; full KV heads,
the layout of :mod:`kvshare.kernels.attention`'s pool) that agents share, and only the rank-r
``R_k = x A_k``, ``R_v = x A_v`` (no RoPE: it cannot be applied at rank r) in a per-agent
*residual pool* ``(num_blocks, block_size, r)``. Attention rebuilds the keys of each block of
the loop, ``K = K_base + RoPE(scale R_k B_k)`` (RoPE at the key's own position), but never the
values: the softmax-weighted sums of ``V_base`` and of ``R_v`` are kept apart under the same
online-softmax rescaling, and ``scale B_v`` is applied once to the residual sum at the end
(``P (R_v B_v) = (P R_v) B_v``), so values stay at width r for the whole loop.

A sequence's base and residual parts live in different blocks (the base prefix may be shared
with other agents while the residual blocks are private), so the residual pool has its own
block tables (:class:`ResidualMetadata`). Rows are grouped by sequence as in
:class:`~kvshare.kernels.metadata.AttentionMetadata`, which still gives positions, the base
block tables and context lengths; each sequence names its adapter (an index into stacked
``B_k``/``B_v``/scales), so agents with different adapters share one call.

This reference runs the same block loop as the Triton kernel; :func:`reconstruct_kv_ref`
rebuilds dense K/V for one sequence, which the tests use as the oracle. The engine's CPU
path is :func:`residual_attention_sdpa`: the same math in one SDPA call per sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .attention import gather_slots, write_kv_ref
from .metadata import AttentionMetadata


@dataclass
class ResidualMetadata:
    """Where each sequence's residual rows live, beside the base pool's AttentionMetadata."""

    block_tables: torch.Tensor  # (S, max blocks) int32 of the residual pool, padded with 0
    key_slots: torch.Tensor  # flat residual slots of every sequence's keys, concatenated (reference)
    seq_adapter: torch.Tensor  # (S,) int32: index into the stacked B_k / B_v / scales
    block_size: int  # the residual pool's (may differ from the base pool's)
    host_adapter: list[int]  # seq_adapter on the host (no device reads in the reference)
    key_positions: torch.Tensor | None = None  # (keys,) position of each key of key_slots in its sequence
    key_groups: list[tuple[int, torch.Tensor | None]] | None = None  # (adapter, its keys; None = all keys)


def build_residual_metadata(meta: AttentionMetadata, block_tables: list[list[int]], block_size: int,
                            seq_adapter: list[int], device: torch.device | str = "cpu") -> ResidualMetadata:
    """Residual-pool metadata for the sequences of ``meta`` (in its order): sequence s's
    residual rows are in blocks ``block_tables[s]``, its adapter is ``seq_adapter[s]``."""
    if len(block_tables) != len(meta.seq_context) or len(seq_adapter) != len(meta.seq_context):
        raise ValueError("one residual block table and one adapter per sequence")
    key_slots = []
    for table, length in zip(block_tables, meta.seq_context):
        if len(table) * block_size < length:
            raise ValueError(f"a residual block table of {len(table)} blocks cannot hold {length} keys")
        key_slots.extend(table[p // block_size] * block_size + p % block_size for p in range(length))
    width = max(map(len, block_tables), default=0)
    tables = [table + [0] * (width - len(table)) for table in block_tables]
    host = [torch.tensor(tables, dtype=torch.int32).reshape(len(tables), width),
            torch.tensor(key_slots, dtype=torch.long), torch.tensor(seq_adapter, dtype=torch.int32)]
    dev = [t.to(device, non_blocking=True) for t in host]
    positions = torch.cat([torch.arange(length) for length in meta.seq_context]) if meta.seq_context \
        else torch.zeros(0, dtype=torch.long)
    keys_of: dict[int, list[int]] = {}
    offset = 0
    for adapter, length in zip(seq_adapter, meta.seq_context):
        keys_of.setdefault(adapter, []).extend(range(offset, offset + length))
        offset += length
    groups = [(adapter, None if len(keys_of) == 1 else torch.tensor(keys, dtype=torch.long).to(device, non_blocking=True))
              for adapter, keys in sorted(keys_of.items())]
    return ResidualMetadata(*dev, block_size=block_size, host_adapter=list(seq_adapter),
                            key_positions=positions.to(device, non_blocking=True), key_groups=groups)


def write_residual_ref(k_res_cache: torch.Tensor, v_res_cache: torch.Tensor, r_k: torch.Tensor,
                       r_v: torch.Tensor, slots: torch.Tensor, write_rows: torch.Tensor | None = None) -> None:
    """Store rows' ``x A_k``, ``x A_v`` (rows, r) at flat residual slots; -1 = do not store.

    A residual pool is a KV pool whose slot holds r values instead of (kv_heads, head_dim),
    so this is :func:`~kvshare.kernels.attention.write_kv_ref` on that layout.
    """
    if k_res_cache.dim() != 3 or r_k.dim() != 2 or r_k.shape[1] != k_res_cache.shape[2]:
        raise ValueError("a residual pool is (blocks, block_size, r) and its rows are (rows, r)")
    write_kv_ref(k_res_cache, v_res_cache, r_k, r_v, slots, write_rows)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """Llama's RoPE convention (the engine's model and transformers use the same)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE of x (keys, heads, d) with cos/sin (keys, d) of each key's position."""
    return x * cos[:, None, :] + rotate_half(x) * sin[:, None, :]


def stack_residual_weights(b: torch.Tensor,
                           scales: torch.Tensor | float | list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """(adapters, kv_heads * head_dim, r) B and (adapters,) float32 scales; a single
    adapter's 2-D B and float scale become a stack of one."""
    if b.dim() == 2:
        b = b.unsqueeze(0)
    scales = torch.as_tensor(scales, dtype=torch.float32, device=b.device).reshape(-1)
    if b.dim() != 3 or scales.shape[0] != b.shape[0]:
        raise ValueError("B must be (adapters, kv_heads * head_dim, r) with one scale per adapter")
    return b, scales


def reconstruct_kv_ref(k_base_cache: torch.Tensor, v_base_cache: torch.Tensor, k_res_cache: torch.Tensor,
                       v_res_cache: torch.Tensor, b_k: torch.Tensor, b_v: torch.Tensor, lora_scale: float,
                       rope_cos: torch.Tensor, rope_sin: torch.Tensor, base_slots: torch.Tensor,
                       res_slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense (keys, kv_heads, head_dim) K and V of one sequence, float32: key p is read from
    base slot ``base_slots[p]`` and residual slot ``res_slots[p]`` and sits at position p.

    ``b_k``/``b_v`` are one adapter's (kv_heads * head_dim, r) B; ``rope_cos``/``rope_sin``
    are (positions, head_dim) tables. Materialises everything: an oracle, not a kernel.
    """
    n_kv, d = k_base_cache.shape[2:]
    length = len(base_slots)
    k_base = gather_slots(k_base_cache, base_slots).float()
    v_base = gather_slots(v_base_cache, base_slots).float()
    r_k = gather_slots(k_res_cache, res_slots).float()
    r_v = gather_slots(v_res_cache, res_slots).float()
    k_delta = (lora_scale * r_k @ b_k.float().T).reshape(length, n_kv, d)
    v_delta = (lora_scale * r_v @ b_v.float().T).reshape(length, n_kv, d)
    cos, sin = rope_cos[:length].float(), rope_sin[:length].float()
    return k_base + apply_rope(k_delta, cos, sin), v_base + v_delta


def residual_attention_ref(q: torch.Tensor, k_base_cache: torch.Tensor, v_base_cache: torch.Tensor,
                           k_res_cache: torch.Tensor, v_res_cache: torch.Tensor, b_k: torch.Tensor,
                           b_v: torch.Tensor, lora_scales: torch.Tensor, rope_cos: torch.Tensor,
                           rope_sin: torch.Tensor, meta: AttentionMetadata, residual: ResidualMetadata,
                           scale: float) -> torch.Tensor:
    """Causal GQA attention of query rows (rows, q_heads, d) over ForkKV's two pools.

    ``k/v_base_cache``: (blocks, block_size, kv_heads, d), read through ``meta``'s block
    tables; ``k/v_res_cache``: (blocks', block_size', r), read through ``residual``'s.
    ``b_k``, ``b_v``: (adapters, kv_heads * d, r) stacked B (zero-padded to the pool's r);
    ``lora_scales``: (adapters,); sequence s uses adapter ``residual.seq_adapter[s]``.
    ``rope_cos``/``rope_sin``: (positions, d) tables of the model's rotary embedding for
    positions 0..P-1 (P >= every context length). ``scale``: the softmax scale.

    Runs the kernel's loop over base-pool blocks of keys, in float32; returns q's dtype.
    """
    n_q, d = q.shape[1], q.shape[2]
    n_kv = k_base_cache.shape[2]
    if n_q % n_kv:
        raise ValueError(f"{n_q} query heads do not share {n_kv} KV heads evenly")
    group, rank = n_q // n_kv, k_res_cache.shape[-1]
    out = torch.empty_like(q)
    offset, step = 0, meta.block_size
    for s, ((start, end), length) in enumerate(zip(meta.seq_bounds, meta.seq_context)):
        adapter = residual.host_adapter[s]
        lora_scale = lora_scales[adapter].float()
        bk = b_k[adapter].float().reshape(n_kv, d, rank)
        bv = b_v[adapter].float().reshape(n_kv, d, rank)
        rows = end - start
        # (kv_heads, rows * group, d): the query heads sharing a KV head, row after row
        query = q[start:end].float().reshape(rows, n_kv, group, d).permute(1, 0, 2, 3).reshape(n_kv, -1, d)
        limit = meta.positions[start:end].repeat_interleave(group)  # each line's last visible key
        best = torch.full((n_kv, rows * group), float("-inf"), device=q.device)
        total = torch.zeros(n_kv, rows * group, device=q.device)
        acc_base = torch.zeros(n_kv, rows * group, d, device=q.device)
        acc_res = torch.zeros(n_kv, rows * group, rank, device=q.device)
        for first in range(0, length, step):
            keys = torch.arange(first, min(first + step, length), device=q.device)
            base_slots = meta.key_slots[offset + first:offset + first + len(keys)]
            res_slots = residual.key_slots[offset + first:offset + first + len(keys)]
            r_k = gather_slots(k_res_cache, res_slots).float()
            k_delta = torch.einsum("kr,hdr->khd", r_k, bk) * lora_scale
            k = gather_slots(k_base_cache, base_slots).float() + apply_rope(
                k_delta, rope_cos[first:first + len(keys)].float(), rope_sin[first:first + len(keys)].float())
            scores = torch.einsum("hld,khd->hlk", query, k) * scale
            scores = scores.masked_fill(keys[None, None, :] > limit[None, :, None], float("-inf"))
            new_best = torch.maximum(best, scores.amax(-1))
            safe = torch.where(torch.isinf(new_best), 0.0, new_best)  # a line that sees no key yet
            probs = torch.exp(scores - safe[..., None])
            keep = torch.exp(best - safe)
            v_base = gather_slots(v_base_cache, base_slots).float()
            r_v = gather_slots(v_res_cache, res_slots).float()
            acc_base = acc_base * keep[..., None] + torch.einsum("hlk,khd->hld", probs, v_base)
            acc_res = acc_res * keep[..., None] + probs @ r_v  # one rescaling for both sums
            total = total * keep + probs.sum(-1)
            best = new_best
        offset += length
        # B_v once per line, after the sum: (P R_v) B_v instead of P (R_v B_v)
        values = acc_base + lora_scale * torch.einsum("hlr,hdr->hld", acc_res, bv)
        result = values / total[..., None]
        out[start:end] = result.reshape(n_kv, rows, group, d).permute(1, 0, 2, 3).reshape(rows, n_q, d).to(q.dtype)
    return out


def residual_attention_sdpa(q: torch.Tensor, k_base_cache: torch.Tensor, v_base_cache: torch.Tensor,
                            k_res_cache: torch.Tensor, v_res_cache: torch.Tensor, b_k: torch.Tensor,
                            b_v: torch.Tensor, lora_scales: torch.Tensor, rope_cos: torch.Tensor,
                            rope_sin: torch.Tensor, meta: AttentionMetadata, residual: ResidualMetadata,
                            scale: float, seqs: list[int] | None = None,
                            out: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`residual_attention_ref`'s result through SDPA, one call per sequence (the
    engine's torch path; the block loop is the oracle and the Triton kernel's shape).

    K and V are rebuilt for every key of the step at once, ``K_base + RoPE(scale R_k B_k)`` and
    ``V_base + scale R_v B_v``: two (keys, r) x (r, kv_heads * d) matmuls per adapter, cheaper than the
    attention itself, after which SDPA runs on plain shapes (its fused causal path). The
    kernel's ``(P R_v) B_v`` order saves memory traffic on a GPU; on CPU rebuilding V is
    the faster of the two (``P (R_v B_v)`` is the same sum). The rebuilt K and V are computed
    in float32 and rounded once to q's dtype, in which SDPA runs (as
    :func:`~kvshare.kernels.attention.paged_attention_ref` does): in bfloat16, rounding the
    delta, its scale and each RoPE term apart would add errors the Triton kernel (float32
    inside) does not make.

    ``seqs``: compute only these sequences (their keys rebuilt one sequence at a time) and
    write their rows of ``out``; the C++ kernel takes the others (:mod:`kvshare.kernels.cpu`).
    """
    n_q, n_kv = q.shape[1], k_base_cache.shape[2]
    if n_q % n_kv:
        raise ValueError(f"{n_q} query heads do not share {n_kv} KV heads evenly")
    out = torch.empty_like(q) if out is None else out
    pools = (k_base_cache, v_base_cache, k_res_cache, v_res_cache)
    offsets = [0]
    for length in meta.seq_context:
        offsets.append(offsets[-1] + length)
    if seqs is None:  # every sequence's keys and values rebuilt at once: one matmul per adapter, one RoPE
        keys, values = _rebuild(pools, b_k, b_v, lora_scales, rope_cos, rope_sin, meta.key_slots,
                                residual.key_slots, residual.key_positions, residual.key_groups, q.dtype)
        for s in range(len(meta.seq_context)):
            window = slice(offsets[s], offsets[s + 1])
            _attend_sequence(q, keys[window], values[window], meta, s, scale, out)
        return out
    for s in seqs:
        window = slice(offsets[s], offsets[s + 1])
        positions = torch.arange(offsets[s + 1] - offsets[s], device=q.device)
        one = _rebuild(pools, b_k, b_v, lora_scales, rope_cos, rope_sin, meta.key_slots[window],
                       residual.key_slots[window], positions, [(residual.host_adapter[s], None)], q.dtype)
        _attend_sequence(q, *one, meta, s, scale, out)
    return out


def _rebuild(pools: tuple[torch.Tensor, ...], b_k: torch.Tensor, b_v: torch.Tensor, lora_scales: torch.Tensor,
             rope_cos: torch.Tensor, rope_sin: torch.Tensor, base_slots: torch.Tensor, res_slots: torch.Tensor,
             positions: torch.Tensor, groups: list[tuple[int, torch.Tensor | None]],
             dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense (keys, kv_heads, d) K and V of the keys at ``base_slots``/``res_slots`` (at
    ``positions``), in ``dtype``; ``groups``: (adapter, its keys; None = all keys)."""
    k_base_cache, v_base_cache, k_res_cache, v_res_cache = pools
    n_kv, d = k_base_cache.shape[2:]
    wide = torch.promote_types(dtype, torch.float32)
    r_k_all = gather_slots(k_res_cache, res_slots).to(wide)
    r_v_all = gather_slots(v_res_cache, res_slots).to(wide)
    k_delta = torch.empty(len(r_k_all), n_kv * d, dtype=wide, device=r_k_all.device)
    v_delta = torch.empty_like(k_delta)
    scales = lora_scales.tolist()
    for adapter, keys in groups:
        b_k_a, b_v_a = b_k[adapter].to(wide).T * scales[adapter], b_v[adapter].to(wide).T * scales[adapter]
        if keys is None:
            torch.matmul(r_k_all, b_k_a, out=k_delta)
            torch.matmul(r_v_all, b_v_a, out=v_delta)
        else:
            k_delta.index_copy_(0, keys, r_k_all.index_select(0, keys) @ b_k_a)
            v_delta.index_copy_(0, keys, r_v_all.index_select(0, keys) @ b_v_a)
    k_delta = apply_rope(k_delta.view(-1, n_kv, d), rope_cos.to(wide).index_select(0, positions),
                         rope_sin.to(wide).index_select(0, positions))
    keys_all = (gather_slots(k_base_cache, base_slots).to(wide) + k_delta).to(dtype)
    values_all = (gather_slots(v_base_cache, base_slots).to(wide) + v_delta.view(-1, n_kv, d)).to(dtype)
    return keys_all, values_all


def _attend_sequence(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, meta: AttentionMetadata, s: int,
                     scale: float, out: torch.Tensor) -> None:
    """SDPA of sequence s's rows over its dense (keys, kv_heads, d) K and V, into ``out``."""
    start, end = meta.seq_bounds[s]
    mask = None
    if not meta.seq_causal[s] and not meta.seq_all_last[s]:
        positions = meta.positions[start:end]
        mask = (torch.arange(len(keys), device=q.device)[None, :] <= positions[:, None])[None, None]
    attn = F.scaled_dot_product_attention(q[start:end].transpose(0, 1)[None], keys.transpose(0, 1)[None],
                                          values.transpose(0, 1)[None], attn_mask=mask, scale=scale,
                                          is_causal=meta.seq_causal[s], enable_gqa=q.shape[1] != keys.shape[1])
    out[start:end] = attn[0].transpose(0, 1)
