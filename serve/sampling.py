"""Sampling parameters as vLLM users know them (the sampler itself is :mod:`.sampler`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import KvshareError


@dataclass
class SamplingParams:
    """What vLLM users expect; ``temperature=0`` means greedy."""

    max_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top alternatives to report per token
    prompt_logprobs: int | None = None  # same for every prompt token (scoring, as in vLLM)

    def __post_init__(self):
        if self.max_tokens < 1:
            raise KvshareError("max_tokens must be at least 1")
        if self.temperature < 0:
            raise KvshareError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise KvshareError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise KvshareError("top_k must be >= 0")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise KvshareError(f"{name} must be >= 0")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
