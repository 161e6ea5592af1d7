"""A request as the engine tracks it: tokens, adapter, cache blocks, timings."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum

import torch

from ..kinds import BASE, KindSpec
from .hints import AgentHints
from .kv_layout import KVLayout, ResidualState, layout_of
from .sampling_params import SamplingParams


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
    spec: KindSpec = BASE  # the adapter kind's serving behaviour
    adapter_slot: int = -1
    adapter_digest: str | None = None  # content digest: the owner of the adapter's KV blocks
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
    # the key that block is stored under: chain_key, except where ForkKV resumed on an exact
    # base block (stored under the base's key); the eviction tree links the next block to it
    parent_key: bytes | None = None
    residual: ResidualState | None = None  # ForkKV: its private rank-r residual's blocks, while it holds them
    status: Status = Status.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop token id or stop string that ended it
    first_scheduled: float | None = None
    first_token: float | None = None
    token_times: list[float] = field(default_factory=list)
    preemptions: int = 0
    generator: torch.Generator | None = None
    allowed_mask: torch.Tensor | None = None  # (vocab,) bool of params.allowed_token_ids, built once when added
    hints: AgentHints = field(default_factory=AgentHints)  # what its workflow said about the calls ahead
    agent: tuple[str, str] | None = None  # (workflow, agent) when the hints name the agent
    fixed_blocks: int | None = None  # leading full blocks of the agent's fixed prompt
    pinned: list[int] = field(default_factory=list)  # its chain's blocks held while it waits for loads
    load_wait_s: float = 0.0  # time it waited for them
    waiting_on_loads_since: float | None = None
    detokenizer: object | None = None  # output.IncrementalDetokenizer, set by the engine

    @property
    def layout(self) -> KVLayout:
        """The KV layout its kind's spec serves it with (exact, forkkv, full_reuse)."""
        return layout_of(self.spec)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    def __len__(self) -> int:
        return len(self.prompt) + len(self.output)

    def kv_adapted(self, position: int) -> bool:
        """Whether the adapter's weights compute this position's K/V (its KV-writing row)."""
        return self.spec.kv_from_adapter(position, self.invocation_start)

    def query_adapted(self, position: int) -> bool:
        """Whether the adapter's weights compute this position's logits."""
        return self.spec.query_from_adapter(position, self.invocation_start)
