"""Attention over a paged KV cache: the plain-torch reference.

The cache of one layer is ``(num_blocks, block_size, kv_heads, head_dim)`` for K and for V;
a sequence's tokens live in the blocks its block table lists. The engine's KV memory is
block-major (``(blocks, layers, 2, block_size, kv_heads, head_dim)``: SwiftCache's layout,
so that a block lent to another engine is one contiguous span), so one layer's K is a view
whose blocks are not back to back; :func:`slot_rows` reads and writes it by slot anyway. A batch is a flat list of
query rows; each row belongs to one sequence and sits at one position, and attends to that
sequence's keys ``0..position``.

All rows of a sequence go into one attention call that reads the sequence's K/V once. For
an ICaRus request this is the paired decode of the brief: the base row and the adapter row
of the same token are two query rows over the same keys, i.e. their query heads are
concatenated for a single GQA attention call.

What does not change between layers (which slots each sequence reads, which keys each row
may see) comes once per step in :class:`~kvshare.kernels.metadata.AttentionMetadata`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .metadata import AttentionMetadata


def _row_strides(row: tuple[int, ...]) -> tuple[int, ...]:
    strides, size = [], 1
    for dim in reversed(row):
        strides.append(size)
        size *= dim
    return tuple(reversed(strides))


def slot_rows(cache: torch.Tensor) -> tuple[torch.Tensor, int]:
    """One row per slot of a (blocks, block_size, ...) cache view, plus the row distance of
    consecutive blocks: slot ``b * block_size + o`` is row ``b * ratio + o``.

    A block-major layer view cannot be flattened (its blocks lie a whole block of every
    layer apart), and indexing it by (block, offset) pairs is 3-4x slower on CPU than one
    flat ``index_select``; a strided view with a row per slot-sized step keeps the flat
    gather (rows between one block's slots and the next block's are other layers' data,
    never indexed)."""
    blocks, block_size, *row = cache.shape
    inner = _row_strides(tuple(row))
    row_elems = inner[0] * row[0] if row else 1
    stride = cache.stride()
    if stride[2:] != inner or stride[1] != row_elems or stride[0] % row_elems:
        raise ValueError("a KV cache view needs contiguous slots (stride(1) = one slot) and blocks "
                         "a whole number of slots apart")
    ratio = stride[0] // row_elems
    if ratio == block_size:
        return cache.view(blocks * block_size, *row), ratio
    rows = (blocks - 1) * ratio + block_size  # up to the last block's last slot: inside the storage
    return cache.as_strided((rows, *row), (row_elems, *inner), cache.storage_offset()), ratio


_last_index: tuple = (None, None, None)  # (slots, (block_size, ratio), rows): every layer reuses a step's


def slot_index(slots: torch.Tensor, block_size: int, ratio: int) -> torch.Tensor:
    """Flat slots as rows of :func:`slot_rows`' view (the last answer is kept: every layer
    of a step asks the same)."""
    global _last_index
    if ratio == block_size:
        return slots
    last = _last_index
    if last[0] is slots and last[1] == (block_size, ratio):
        return last[2]
    rows = torch.div(slots, block_size, rounding_mode="floor") * ratio + slots.remainder(block_size)
    _last_index = (slots, (block_size, ratio), rows)
    return rows


def gather_slots(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Rows of ``cache`` (blocks, block_size, ...) at flat ``slots``."""
    rows, ratio = slot_rows(cache)
    return rows.index_select(0, slot_index(slots, cache.shape[1], ratio))


def write_kv_ref(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 slots: torch.Tensor, write_rows: torch.Tensor | None = None) -> None:
    """Store rows' K/V at flat slot indices (block * block_size + offset); -1 = do not store.

    ``write_rows`` (from the metadata: the rows whose slot is not -1, found on the host)
    avoids a boolean filter, which would make the device report a count mid-step.
    """
    if write_rows is None:
        write_rows = (slots >= 0).nonzero().squeeze(1)
    if len(write_rows) == len(slots):
        index = slots
    else:
        index, k, v = slots.index_select(0, write_rows), k.index_select(0, write_rows), v.index_select(0, write_rows)
    k_rows, ratio = slot_rows(k_cache)
    v_rows, _ = slot_rows(v_cache)
    index = slot_index(index, k_cache.shape[1], ratio)
    k_rows[index] = k.to(k_cache.dtype)
    v_rows[index] = v.to(v_cache.dtype)


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Causal GQA attention of query rows (rows, q_heads, d) over their sequences' paged K/V."""
    n_q, n_kv, d = q.shape[1], k_cache.shape[2], q.shape[2]
    keys_all = gather_slots(k_cache, meta.key_slots)
    values_all = gather_slots(v_cache, meta.key_slots)
    out = torch.empty_like(q)
    offset = 0
    for (start, end), length, causal, all_last in zip(meta.seq_bounds, meta.seq_context,
                                                     meta.seq_causal, meta.seq_all_last):
        query = q[start:end].transpose(0, 1).unsqueeze(0)  # (1, heads, rows, d)
        keys = keys_all[offset:offset + length].transpose(0, 1).unsqueeze(0).to(q.dtype)
        values = values_all[offset:offset + length].transpose(0, 1).unsqueeze(0).to(q.dtype)
        offset += length
        mask = None
        if not causal and not all_last:
            positions = meta.positions[start:end]
            mask = (torch.arange(length, device=q.device)[None, :] <= positions[:, None])[None, None]
        attn = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale,
                                              is_causal=causal, enable_gqa=n_q != n_kv)
        out[start:end] = attn[0].transpose(0, 1)
    return out
