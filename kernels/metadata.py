"""Attention metadata: built once per step on the host, moved to the device in one go.

Everything a kernel needs to find a row's keys lives in tensors (nano-vllm's and vLLM's
shape): slot mapping, block tables, context lengths, query start offsets, read-only rows.
The torch reference also gets a few host-side lists (where each sequence's rows start,
whether they are a plain causal prefill) computed from the scheduler's Python integers, so
no kernel has to ask the device for a value mid-step (no host synchronisation).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    positions: torch.Tensor  # (R,) position of each row in its sequence
    slot_mapping: torch.Tensor  # (R,) flat cache slot the row writes, -1 = read-only row
    query_start_loc: torch.Tensor  # (S + 1,) int32: rows of sequence s are [loc[s], loc[s+1])
    context_lens: torch.Tensor  # (S,) int32: keys each sequence's rows may read (max position + 1)
    block_tables: torch.Tensor  # (S, max blocks) int32, padded with 0
    key_slots: torch.Tensor  # flat slots of every sequence's keys, concatenated (torch reference)
    write_rows: torch.Tensor  # rows that write KV (slot_mapping >= 0), found on the host
    block_size: int
    # host-side copies of the per-sequence layout (no device reads during the step)
    seq_bounds: list[tuple[int, int]]  # (first row, one past last row) per sequence
    seq_context: list[int]  # context length per sequence
    seq_causal: list[bool]  # rows are positions 0..n-1 in order: SDPA's causal path, no mask
    seq_all_last: list[bool]  # every row sits at the last position: no mask needed


def build_attention_metadata(row_seq: list[int], positions: list[int], write_slots: list[int],
                             block_tables: list[list[int]], block_size: int,
                             device: torch.device | str = "cpu") -> AttentionMetadata:
    """Metadata for rows grouped by sequence (a sequence's rows are contiguous, in order of
    ``row_seq`` values 0..S-1); ``block_tables[s]`` lists sequence s's blocks."""
    bounds, context, causal, all_last, tables = [], [], [], [], []
    start, rows = 0, len(row_seq)
    while start < rows:
        seq = row_seq[start]
        end = start
        while end < rows and row_seq[end] == seq:
            end += 1
        pos = positions[start:end]
        length = max(pos) + 1
        bounds.append((start, end))
        context.append(length)
        causal.append(end - start == length and length > 1 and pos == list(range(length)))
        all_last.append(all(p == length - 1 for p in pos))
        if len(block_tables[seq]) * block_size < length:
            raise ValueError(f"sequence {seq}'s block table holds {len(block_tables[seq])} blocks; its rows "
                             f"read {length} keys")
        tables.append(block_tables[seq])
        start = end
    width = max(map(len, tables), default=0)
    tables = [table + [0] * (width - len(table)) for table in tables]
    loc = [0] + [e for _, e in bounds]
    table_tensor = torch.tensor(tables, dtype=torch.int32).reshape(len(bounds), width)
    lengths = torch.tensor(context, dtype=torch.int32)
    # every sequence's key slots, concatenated: on the host in tensor ops (a decode step over
    # long contexts has tens of thousands)
    offsets = torch.arange(width * block_size)
    key_slots = (table_tensor.long().repeat_interleave(block_size, dim=1) * block_size
                 + offsets % block_size)[offsets[None, :] < lengths[:, None]]
    host = [torch.tensor(positions, dtype=torch.long), torch.tensor(write_slots, dtype=torch.long),
            torch.tensor(loc, dtype=torch.int32), lengths, table_tensor, key_slots,
            torch.tensor([r for r, slot in enumerate(write_slots) if slot >= 0], dtype=torch.long)]
    dev = [t.to(device, non_blocking=True) for t in host]
    return AttentionMetadata(*dev, block_size=block_size, seq_bounds=bounds, seq_context=context,
                             seq_causal=causal, seq_all_last=all_last)
