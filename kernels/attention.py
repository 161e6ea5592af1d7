"""Attention over a paged KV cache: the plain-torch reference.

The cache of one layer is ``(num_blocks, block_size, kv_heads, head_dim)`` for K and for V;
a sequence's tokens live in the blocks its block table lists. A batch is a flat list of
query rows; each row belongs to one sequence and sits at one position, and attends to that
sequence's keys ``0..position``.

All rows of a sequence go into one attention call that reads the sequence's K/V once. For
an ICaRus request this is the paired decode of the brief: the base row and the adapter row
of the same token are two query rows over the same keys, i.e. their query heads are
concatenated for a single GQA attention call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def write_kv_ref(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 slots: torch.Tensor) -> None:
    """Store rows' K/V at flat slot indices (block * block_size + offset); -1 = do not store."""
    keep = slots >= 0
    if not bool(keep.any()):
        return
    flat_k = k_cache.view(-1, *k_cache.shape[2:])
    flat_v = v_cache.view(-1, *v_cache.shape[2:])
    index = slots[keep]
    flat_k[index] = k[keep].to(flat_k.dtype)
    flat_v[index] = v[keep].to(flat_v.dtype)


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        row_seq: list[int], row_pos: torch.Tensor, block_tables: list[list[int]],
                        scale: float) -> torch.Tensor:
    """Causal GQA attention of query rows over their sequences' paged K/V.

    q: (rows, q_heads, head_dim); row_seq: sequence index of each row (rows of a sequence are
    contiguous); row_pos: position of each row; block_tables[s]: block ids of sequence s.
    Returns (rows, q_heads, head_dim).
    """
    rows, n_q, d = q.shape
    n_kv = k_cache.shape[2]
    block_size = k_cache.shape[1]
    out = torch.empty_like(q)
    start = 0
    while start < rows:
        seq = row_seq[start]
        end = start
        while end < rows and row_seq[end] == seq:
            end += 1
        pos = row_pos[start:end]
        length = int(pos.max()) + 1
        blocks = torch.tensor(block_tables[seq][: (length + block_size - 1) // block_size])
        keys = k_cache[blocks].reshape(-1, n_kv, d)[:length]
        values = v_cache[blocks].reshape(-1, n_kv, d)[:length]
        # (1, heads, rows, d) x (1, kv_heads, length, d) with grouped heads
        query = q[start:end].transpose(0, 1).unsqueeze(0)
        keys = keys.transpose(0, 1).unsqueeze(0).to(query.dtype)
        values = values.transpose(0, 1).unsqueeze(0).to(query.dtype)
        allowed = torch.arange(length)[None, :] <= pos[:, None]
        attn = F.scaled_dot_product_attention(query, keys, values, attn_mask=allowed[None, None],
                                              scale=scale, enable_gqa=n_q != n_kv)
        out[start:end] = attn[0].transpose(0, 1)
        start = end
    return out
