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

from ..kernels import AttentionMetadata, build_attention_metadata
from ..kernels.lora import lora_groups
from .sequence import Sequence


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
class Batch:
    """A step's rows in tensors, and what each logit row is for."""

    tokens: torch.Tensor  # (R,) token ids
    lora_groups: list[tuple[int, torch.Tensor]]  # (adapter slot, its rows) for the LoRA kernel
    attention: AttentionMetadata
    logit_rows: torch.Tensor  # rows whose next-token logits are wanted
    targets: list[tuple[int, int | None]]  # per logit row: (plan index, None = sample | p = score p + 1)


def build_batch(plans: list[StepPlan], block_size: int, device: torch.device | str = "cpu") -> Batch:
    """Flatten the plans into rows: per sequence its write rows, then its read-only rows."""
    tokens, positions, slots, writes, row_seq, logit_rows = [], [], [], [], [], []
    targets: list[tuple[int, int | None]] = []
    for index, plan in enumerate(plans):
        seq = plan.seq
        seq_tokens, table, slot = seq.tokens, seq.block_table, seq.adapter_slot
        first = len(tokens)
        start, end = seq.num_computed, seq.num_computed + plan.n_compute
        tokens.extend(seq_tokens[start:end])
        positions.extend(range(start, end))
        slots.extend(slot if seq.kv_adapted(p) else -1 for p in range(start, end))
        writes.extend(table[p // block_size] * block_size + p % block_size for p in range(start, end))
        for pos in plan.scored_by_write:
            logit_rows.append(first + pos - start)
            targets.append((index, pos))
        for pos in plan.read_only:
            tokens.append(seq_tokens[pos])
            positions.append(pos)
            slots.append(slot if seq.query_adapted(pos) else -1)
            writes.append(-1)
        scored = plan.read_only[:-1] if plan.sample_from_read_only else plan.read_only
        for offset, pos in enumerate(scored):
            logit_rows.append(first + plan.n_compute + offset)
            targets.append((index, pos))
        if plan.wants_logits:
            logit_rows.append(len(tokens) - 1 if plan.sample_from_read_only else first + plan.n_compute - 1)
            targets.append((index, None))
        row_seq.extend([index] * (len(tokens) - first))
    meta = build_attention_metadata(row_seq, positions, writes, [p.seq.block_table for p in plans],
                                    block_size, device)
    return Batch(torch.tensor(tokens, dtype=torch.long).to(device, non_blocking=True),
                 lora_groups(slots, device), meta,
                 torch.tensor(logit_rows, dtype=torch.long).to(device, non_blocking=True), targets)
