"""Attention over a paged KV cache: the plain-torch reference.

The cache of one layer is ``(num_blocks, block_size, kv_heads, head_dim)`` for K and for V;
a sequence's tokens live in the blocks its block table lists. A batch is a flat list of
query rows; each row belongs to one sequence and sits at one position, and attends to that
sequence's keys ``0..position``.

All rows of a sequence go into one attention call that reads the sequence's K/V once. For
an ICaRus request this is the paired decode of the brief: the base row and the adapter row
of the same token are two query rows over the same keys, i.e. their query heads are
concatenated for a single GQA attention call.

What does not change between layers (which slots each sequence reads, which keys each row
may see) is worked out once per forward in :func:`attention_plan`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class SeqGroup:
    start: int  # first row of the sequence in the batch
    end: int  # one past its last row
    slots: torch.Tensor  # flat cache slots of keys 0..length-1
    mask: torch.Tensor | None  # (rows, length) allowed keys; None when every row sees all
    causal: bool = False  # rows are positions 0..length-1 in order: plain causal attention


def attention_plan(row_seq: list[int], row_pos: torch.Tensor, block_tables: list[list[int]],
                   block_size: int) -> list[SeqGroup]:
    groups = []
    rows = len(row_seq)
    start = 0
    while start < rows:
        seq = row_seq[start]
        end = start
        while end < rows and row_seq[end] == seq:
            end += 1
        pos = row_pos[start:end]
        length = int(pos.max()) + 1
        table = torch.tensor(block_tables[seq][: (length + block_size - 1) // block_size])
        slots = (table[:, None] * block_size + torch.arange(block_size)).reshape(-1)[:length]
        mask, causal = None, False
        if end - start == length and bool((pos == torch.arange(length)).all()):
            causal = length > 1  # a prefill from position 0: SDPA's causal kernel, no mask
        elif bool((pos != length - 1).any()):
            mask = torch.arange(length)[None, :] <= pos[:, None]
        groups.append(SeqGroup(start, end, slots, mask, causal))
        start = end
    return groups


def write_kv_ref(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 slots: torch.Tensor) -> None:
    """Store rows' K/V at flat slot indices (block * block_size + offset); -1 = do not store."""
    keep = slots >= 0
    if bool(keep.all()):
        index, k, v = slots, k, v
    elif bool(keep.any()):
        index, k, v = slots[keep], k[keep], v[keep]
    else:
        return
    k_cache.view(-1, *k_cache.shape[2:])[index] = k.to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[index] = v.to(v_cache.dtype)


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        plan: list[SeqGroup], scale: float) -> torch.Tensor:
    """Causal GQA attention of query rows (rows, q_heads, d) over their sequences' paged K/V."""
    n_q, n_kv, d = q.shape[1], k_cache.shape[2], q.shape[2]
    flat_k = k_cache.view(-1, n_kv, d)
    flat_v = v_cache.view(-1, n_kv, d)
    out = torch.empty_like(q)
    for g in plan:
        query = q[g.start:g.end].transpose(0, 1).unsqueeze(0)  # (1, heads, rows, d)
        keys = flat_k.index_select(0, g.slots).transpose(0, 1).unsqueeze(0).to(q.dtype)
        values = flat_v.index_select(0, g.slots).transpose(0, 1).unsqueeze(0).to(q.dtype)
        mask = g.mask[None, None] if g.mask is not None else None
        attn = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale,
                                              is_causal=g.causal, enable_gqa=n_q != n_kv)
        out[g.start:g.end] = attn[0].transpose(0, 1)
    return out
