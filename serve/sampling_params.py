"""Sampling parameters as vLLM users know them (the sampler itself is :mod:`.exec.sampler`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..errors import KvshareError


GREEDY_BELOW = 1e-5
# a penalty outside this rounds to 0 or inf in the logits' dtype, and the softmax to NaN
PENALTY_RANGE = (1e-6, 1e6)


@dataclass
class SamplingParams:
    """What vLLM users expect; ``temperature=0`` means greedy."""

    max_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0  # drop tokens below min_p x the likeliest one's probability (0 = off)
    repetition_penalty: float = 1.0  # > 1 discourages tokens of the prompt and output so far (1 = off)
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False  # keep the matched stop string (or stop token's text), as vLLM
    ignore_eos: bool = False
    min_tokens: int = 0  # vLLM's: no end-of-sequence token, stop token or stop string ends the output before this many
    allowed_token_ids: list[int] | None = None  # vLLM's: sample only among these ids (None = all)
    logprobs: int | None = None  # number of top alternatives to report per token
    prompt_logprobs: int | None = None  # same for every prompt token (scoring, as in vLLM)
    cache_salt: str | None = None  # vLLM's per-tenant salt: only requests with the same salt share KV blocks

    def __post_init__(self):
        if self.max_tokens < 1:
            raise KvshareError("max_tokens must be at least 1")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise KvshareError("temperature must be a finite number >= 0")
        if not 0 < self.top_p <= 1:  # NaN fails this too
            raise KvshareError("top_p must be in (0, 1]")
        if not 0 <= self.min_p <= 1:
            raise KvshareError("min_p must be in [0, 1]")
        if not PENALTY_RANGE[0] <= self.repetition_penalty <= PENALTY_RANGE[1]:  # NaN fails this too
            raise KvshareError(f"repetition_penalty must be in [{PENALTY_RANGE[0]:g}, {PENALTY_RANGE[1]:g}] (1 = off)")
        if self.seed is not None and not -(2 ** 63) <= self.seed < 2 ** 63:
            raise KvshareError("seed must be a 64-bit signed integer")
        if self.top_k < 0:
            raise KvshareError("top_k must be >= 0")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise KvshareError(f"{name} must be >= 0")
        if self.cache_salt is not None and not (isinstance(self.cache_salt, str) and self.cache_salt):
            raise KvshareError("cache_salt must be a non-empty string")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise KvshareError(f"min_tokens must be between 0 and max_tokens ({self.max_tokens})")
        if self.allowed_token_ids is not None and (
                not self.allowed_token_ids
                or any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in self.allowed_token_ids)):
            raise KvshareError("allowed_token_ids must be a non-empty list of token ids (integers >= 0)")
        if self.allowed_token_ids is not None:  # each id once: a repeated id allows nothing more
            self.allowed_token_ids = list(dict.fromkeys(self.allowed_token_ids))
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise KvshareError("stop strings must be non-empty strings")  # "" would match at once

    @property
    def greedy(self) -> bool:
        """Temperatures below 1e-5 sample greedily (vLLM's rule): dividing logits by them
        overflows to inf and the softmax to NaN."""
        return self.temperature < GREEDY_BELOW
