"""The row planner: what one step of one sequence costs in rows, and the rows themselves.

A row is one token of one sequence run through the model with one set of weights. A step
of a sequence computes ``n_compute`` tokens' K/V (one *write row* each, with the weights
that compute that position's K/V), and may need *read-only rows* that attend to the cache
without writing it: when the weights of a position's logits differ from those of its K/V
(an ICaRus adapter row beside the base row that writes the shared KV: the paired step),
when a logit is wanted for a token whose KV came from the prefix cache, and for prompt
scoring (``prompt_logprobs``). The scheduler's token budget and the engine's batch are both
built from :func:`plan_step`, so the cost of a step is worked out once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ...kernels import AttentionMetadata, build_attention_metadata
from ...kernels.lora import lora_groups
from ...kernels.residual_attention import ResidualMetadata, build_residual_metadata
from ..sequence import Sequence


@dataclass
class StepPlan:
    """One sequence's part of a step."""

    seq: Sequence
    n_compute: int  # tokens whose KV this step computes (write rows)
    wants_logits: bool  # the step ends the sequence's pending tokens: sample the next one
    scored_by_write: list[int] = field(default_factory=list)  # prompt positions scored by write rows
    read_only: list[int] = field(default_factory=list)  # positions of extra read-only rows
    sample_from_read_only: bool = False  # the sampled logits come from the last read-only row

    @property
    def num_rows(self) -> int:
        return self.n_compute + len(self.read_only)


def plan_step(seq: Sequence, n_compute: int) -> StepPlan:
    """Rows of one step of ``seq`` that computes ``n_compute`` more tokens' K/V."""
    start = seq.num_computed
    plan = StepPlan(seq, n_compute, start + n_compute == len(seq))
    if seq.params.prompt_logprobs is not None:
        last = len(seq.prompt) - 1  # logits at positions < last score prompt tokens 1..last
        end = min(start + n_compute, last)
        plan.read_only.extend(range(seq.scored, min(start, last)))  # KV from the prefix cache
        for pos in range(max(start, seq.scored), end):
            same = seq.kv_adapted(pos) == seq.query_adapted(pos)
            (plan.scored_by_write if same else plan.read_only).append(pos)
    if plan.wants_logits:
        last = len(seq) - 1
        if n_compute == 0 or seq.kv_adapted(last) != seq.query_adapted(last):
            plan.read_only.append(last)
            plan.sample_from_read_only = True
    return plan


@dataclass
class ForkKVRows:
    """The ForkKV sequences of a step: their rows come last, from row ``first`` on.

    ``exact`` is the attention metadata of the rows before (None when there are none),
    ``meta`` / ``residual`` those of the ForkKV rows (numbered from ``first``), read by
    residual attention; ``res_slots`` / ``res_write_rows`` say where each ForkKV row's
    ``x A_k``, ``x A_v`` go in the residual pool (-1: already cached, or a read-only row);
    ``groups`` are (index into the adapters' residual stack, its rows from ``first``).
    """

    first: int
    exact: AttentionMetadata | None
    meta: AttentionMetadata
    residual: ResidualMetadata
    res_slots: torch.Tensor
    res_write_rows: torch.Tensor
    groups: list[tuple[int, torch.Tensor]]
    max_context: int


@dataclass
class Batch:
    """A step's rows in tensors, and what each logit row is for."""

    tokens: torch.Tensor  # (R,) token ids
    lora_groups: list[tuple[int, torch.Tensor]]  # (adapter slot, its rows) for the LoRA kernel
    attention: AttentionMetadata
    logit_rows: torch.Tensor  # rows whose next-token logits are wanted
    targets: list[tuple[int, int | None]]  # per logit row: (plan index, None = sample | p = score p + 1)
    forkkv: ForkKVRows | None = None


def build_batch(plans: list[StepPlan], block_size: int, device: torch.device | str = "cpu",
                residual_index: dict[int, int] | None = None) -> Batch:
    """Flatten the plans into rows: per sequence its write rows, then its read-only rows;
    ForkKV sequences (``residual_index``: their adapter slot -> residual stack index) last."""
    tokens, positions, slots, writes, row_seq, logit_rows = [], [], [], [], [], []
    res_writes: list[int] = []
    targets: list[tuple[int, int | None]] = []
    # stable: the rows of sequences holding residual blocks (ForkKV) after the others
    order = sorted(range(len(plans)), key=lambda i: plans[i].seq.residual is not None)
    first_forkkv = None
    for ordinal, index in enumerate(order):
        plan = plans[index]
        seq = plan.seq
        seq_tokens, table, slot, residual = seq.tokens, seq.block_table, seq.adapter_slot, seq.residual
        first = len(tokens)
        if residual is not None and first_forkkv is None:
            first_forkkv = (first, ordinal)
        start, end = seq.num_computed, seq.num_computed + plan.n_compute
        tokens.extend(seq_tokens[start:end])
        positions.extend(range(start, end))
        slots.extend(slot if seq.kv_adapted(p) else -1 for p in range(start, end))
        # a ForkKV sequence resuming between its two cached prefixes rewrites neither part
        base_from = residual.base_cached if residual is not None else 0
        writes.extend(table[p // block_size] * block_size + p % block_size if p >= base_from else -1
                      for p in range(start, end))
        if residual is not None:
            res_writes.extend(residual.write_slots(start, end, block_size))
        for pos in plan.scored_by_write:
            logit_rows.append(first + pos - start)
            targets.append((index, pos))
        for pos in plan.read_only:
            tokens.append(seq_tokens[pos])
            positions.append(pos)
            slots.append(slot if seq.query_adapted(pos) else -1)
            writes.append(-1)
            if residual is not None:
                res_writes.append(-1)
        scored = plan.read_only[:-1] if plan.sample_from_read_only else plan.read_only
        for offset, pos in enumerate(scored):
            logit_rows.append(first + plan.n_compute + offset)
            targets.append((index, pos))
        if plan.wants_logits:
            logit_rows.append(len(tokens) - 1 if plan.sample_from_read_only else first + plan.n_compute - 1)
            targets.append((index, None))
        row_seq.extend([ordinal] * (len(tokens) - first))
    tables = [plans[i].seq.block_table for i in order]
    meta = build_attention_metadata(row_seq, positions, writes, tables, block_size, device)
    forkkv = None
    if first_forkkv is not None:
        forkkv = _forkkv_rows([plans[i].seq for i in order], first_forkkv, row_seq, positions, writes,
                              res_writes, tables, block_size, residual_index, device)
    return Batch(torch.tensor(tokens, dtype=torch.long).to(device, non_blocking=True),
                 lora_groups(slots, device), meta,
                 torch.tensor(logit_rows, dtype=torch.long).to(device, non_blocking=True), targets, forkkv)


def _forkkv_rows(seqs: list[Sequence], first: tuple[int, int], row_seq: list[int], positions: list[int],
                 writes: list[int], res_writes: list[int], tables: list[list[int]], block_size: int,
                 residual_index: dict[int, int], device) -> ForkKVRows:
    """Split the step's attention metadata at the first ForkKV row and add the residual pool's."""
    row, ordinal = first
    exact = build_attention_metadata(row_seq[:row], positions[:row], writes[:row], tables[:ordinal],
                                     block_size, device) if row else None
    meta = build_attention_metadata([s - ordinal for s in row_seq[row:]], positions[row:], writes[row:],
                                    tables[ordinal:], block_size, device)
    stack = [residual_index[s.adapter_slot] for s in seqs[ordinal:]]
    residual = build_residual_metadata(meta, [s.residual.table for s in seqs[ordinal:]], block_size, stack, device)
    group_rows: dict[int, list[int]] = {}
    for r, s in enumerate(row_seq[row:]):
        group_rows.setdefault(stack[s - ordinal], []).append(r)
    groups = [(i, torch.tensor(rows, dtype=torch.long).to(device, non_blocking=True))
              for i, rows in sorted(group_rows.items())]
    as_tensor = lambda values: torch.tensor(values, dtype=torch.long).to(device, non_blocking=True)  # noqa: E731
    return ForkKVRows(row, exact, meta, residual, as_tensor(res_writes),
                      as_tensor([r for r, slot in enumerate(res_writes) if slot >= 0]), groups,
                      max(meta.seq_context))
