"""A step's paged attention with the work every layer shares done once (the CPU fast path).

The torch reference (:mod:`.attention`) works out in every layer where each row writes and
which slots each sequence reads, and runs one SDPA call per sequence. In a decode step of a
small model that Python is most of the attention's time: 200 us a layer against 30 us of
SDPA, profiled on 2 cores (results/engine-cpu-bf16). :class:`StepAttention` does it once per
step: the rows of the writes and of the reads in the cache's flat slot view (:func:`slot_rows`)
and, when every sequence's rows sit at its last position and every sequence has as many rows
(decode rows, ICaRus pairs), one padded key index so that the whole batch is a single SDPA
call, the shorter sequences' padding masked out. Anything else (a few prompt rows) keeps the
reference's per-sequence calls over the once-computed gather. With ``kernel`` (the "cpu"
backend, :mod:`.cpu`) no gather at all: the C++ kernel reads each sequence's K/V in place.
Its oracle is the reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import cpu
from .attention import slot_index, slot_rows
from .metadata import AttentionMetadata


def layer_rows(kv_cache: torch.Tensor) -> tuple[list[tuple[torch.Tensor, ...]], int]:
    """Every layer's (K, V) flat slot views of a block-major cache (blocks, layers, 2, ...)
    and its (K, V) block views, and the row distance of consecutive blocks (the same for
    every layer)."""
    views, ratio = [], 0
    for layer in range(kv_cache.shape[1]):
        k_blocks, v_blocks = kv_cache[:, layer, 0], kv_cache[:, layer, 1]
        (k, ratio), (v, _) = slot_rows(k_blocks), slot_rows(v_blocks)
        views.append((k, v, k_blocks, v_blocks))
    return views, ratio


def _as_slice(rows: torch.Tensor) -> torch.Tensor | slice:
    """``rows`` as a slice where they step evenly (the base rows of ICaRus pairs are every other
    row), so that each layer views them instead of copying them (60 copies a step); else as they are."""
    if len(rows) == 0 or rows.device.type != "cpu":
        return rows
    values = rows.tolist()
    step = values[1] - values[0] if len(values) > 1 else 1
    if step <= 0 or any(b - a != step for a, b in zip(values, values[1:])):
        return rows
    return slice(values[0], values[-1] + 1, step)


class StepAttention:
    """One step's KV writes and paged attention over :func:`layer_rows` views, for the step's
    first ``rows`` query rows (the rest are pad rows: they neither write nor read); with
    ``kernel``, the C++ CPU kernel attends (the caller checks :func:`cpu.available`)."""

    def __init__(self, meta: AttentionMetadata, rows: int, ratio: int, kernel: bool = False):
        self.rows = rows
        block_size = meta.block_size
        self.write_all = len(meta.write_rows) == rows
        # ICaRus pairs write every other row: a strided view
        self.write_rows = meta.write_rows if self.write_all else _as_slice(meta.write_rows)
        slots = meta.slot_mapping[:rows] if self.write_all else meta.slot_mapping.index_select(0, meta.write_rows)
        self.write_index = slot_index(slots, block_size, ratio)
        self.meta, self.layout = meta, cpu.Layout(meta, rows) if kernel else None
        if kernel:
            return
        counts = {end - start for start, end in meta.seq_bounds}
        self.uniform = bool(meta.seq_bounds) and all(meta.seq_all_last) and len(counts) == 1
        lengths = meta.seq_context
        if self.uniform:  # one SDPA call: (sequences, heads, rows each, d) over padded keys
            self.per_seq, longest = counts.pop(), max(lengths)
            index = meta.key_slots
            self.mask = None
            if min(lengths) != longest:
                padded = meta.key_slots.new_empty(len(lengths), longest)
                offset = 0
                for s, length in enumerate(lengths):
                    padded[s, :length] = meta.key_slots[offset:offset + length]
                    padded[s, length:] = meta.key_slots[offset]  # a real slot, masked out
                    offset += length
                index = padded.flatten()
                device = index.device
                keep = torch.arange(longest, device=device)[None, :] < torch.tensor(lengths, device=device)[:, None]
                self.mask = keep[:, None, None, :]  # (sequences, 1, 1, keys)
            self.longest = longest
        else:  # the reference's per-sequence calls, each with its mask worked out once
            self.calls = []
            offset = 0
            for (start, end), length, causal, all_last in zip(meta.seq_bounds, lengths, meta.seq_causal,
                                                             meta.seq_all_last):
                mask = None
                if not causal and not all_last:
                    positions = meta.positions[start:end]
                    mask = (torch.arange(length, device=positions.device)[None, :] <= positions[:, None])[None, None]
                self.calls.append((start, end, offset, length, causal, mask))
                offset += length
            index = meta.key_slots
        self.read_index = slot_index(index, block_size, ratio)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_rows: torch.Tensor,
                 v_rows: torch.Tensor, scale: float, k_blocks: torch.Tensor | None = None,
                 v_blocks: torch.Tensor | None = None) -> torch.Tensor:
        """Write the real rows' K/V into ``k_rows``/``v_rows`` and return every row's attention
        output (pad rows: zeros), shaped like ``q``; the kernel reads the same layer's
        ``k_blocks``/``v_blocks`` (blocks, block_size, kv_heads, d) views."""
        n = self.rows
        k, v = k[:n], v[:n]
        if not self.write_all:
            if isinstance(self.write_rows, slice):
                k, v = k[self.write_rows], v[self.write_rows]
            else:
                k, v = k.index_select(0, self.write_rows), v.index_select(0, self.write_rows)
        if len(self.write_index):
            k_rows.index_copy_(0, self.write_index, k.to(k_rows.dtype))
            v_rows.index_copy_(0, self.write_index, v.to(v_rows.dtype))
        if self.layout is not None:
            out = q.new_zeros(q.shape) if n < q.shape[0] else torch.empty_like(q)
            return cpu.attend(q, k_blocks, v_blocks, self.layout, self.meta, scale, out)
        keys = k_rows.index_select(0, self.read_index).to(q.dtype)
        values = v_rows.index_select(0, self.read_index).to(q.dtype)
        gqa = q.shape[1] != k_rows.shape[1]
        out = q.new_zeros(q.shape) if n < q.shape[0] else torch.empty_like(q)
        if self.uniform:
            m, heads, d = self.per_seq, q.shape[1], q.shape[2]
            seqs = n // m
            query = q[:n].view(seqs, m, heads, d).transpose(1, 2)
            keys = keys.view(seqs, self.longest, *keys.shape[1:]).transpose(1, 2)
            values = values.view(seqs, self.longest, *values.shape[1:]).transpose(1, 2)
            attn = F.scaled_dot_product_attention(query, keys, values, attn_mask=self.mask, scale=scale,
                                                  enable_gqa=gqa)
            out[:n] = attn.transpose(1, 2).reshape(n, heads, d)
            return out
        for start, end, offset, length, causal, mask in self.calls:
            query = q[start:end].transpose(0, 1).unsqueeze(0)
            key = keys[offset:offset + length].transpose(0, 1).unsqueeze(0)
            value = values[offset:offset + length].transpose(0, 1).unsqueeze(0)
            attn = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale,
                                                  is_causal=causal, enable_gqa=gqa)
            out[start:end] = attn[0].transpose(0, 1)
        return out
