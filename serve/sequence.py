"""A request as the engine tracks it: tokens, adapter, cache blocks, timings."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum

import torch

from ..sharing import AdapterKind
from .sampling import SamplingParams


class Status(str, Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    adapter: str | None = None  # adapter name, None = base
    kind: AdapterKind | None = None
    adapter_slot: int = -1
    invocation_start: int | None = None  # aLoRA: start of the last invocation in the prompt
    arrival: float = field(default_factory=time.perf_counter)
    output: list[int] = field(default_factory=list)
    logprobs: list[dict] = field(default_factory=list)
    prompt_logprobs: list[dict | None] | None = None  # filled when params.prompt_logprobs is set
    scored: int = 0  # prompt positions whose next-token logits were collected
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose KV is in the cache
    num_cached_prompt: int = 0  # prompt tokens served from the prefix cache
    hashed_blocks: int = 0  # leading full blocks already registered in the prefix cache
    chain_key: bytes | None = None  # prefix-cache key of the last of those blocks
    status: Status = Status.WAITING
    finish_reason: str | None = None
    first_scheduled: float | None = None
    first_token: float | None = None
    token_times: list[float] = field(default_factory=list)
    preemptions: int = 0
    generator: torch.Generator | None = None
    hints: dict = field(default_factory=dict)  # workflow hints, e.g. {"next_agents": [...]}

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    def __len__(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def is_icarus(self) -> bool:
        return self.kind is AdapterKind.ICARUS

    def score_rows(self, n_compute: int) -> tuple[list[int], list[int]]:
        """Prompt positions whose logits this step collects, for ``prompt_logprobs``.

        Returns (positions whose KV-writing row gives the logits, positions that need an
        extra read-only row). Read-only rows serve positions taken from the prefix cache (no
        row computes them) and every ICaRus position (the adapter's logits come from its
        own query over the base's KV, not from the base row that writes it).
        """
        if self.params.prompt_logprobs is None:
            return [], []
        last = len(self.prompt) - 1  # logits at positions < last score prompt tokens 1..last
        start, end = self.num_computed, min(self.num_computed + n_compute, last)
        cached = list(range(self.scored, min(start, last)))
        fresh = list(range(max(start, self.scored), end))
        return ([], cached + fresh) if self.is_icarus else (fresh, cached)

    def adapter_active_from(self) -> int | None:
        """First position whose projections use the adapter (None: never)."""
        if self.kind is None:
            return None
        if self.kind is AdapterKind.ALORA:
            return self.invocation_start
        return 0  # lora everywhere; icarus rows are the adapter's own stream
