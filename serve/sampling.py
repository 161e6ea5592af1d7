"""Sampling parameters and the sampler (greedy, temperature, top-k, top-p, seeded)."""

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


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Pick the next token from one row of float32 logits."""
    if params.temperature == 0:
        return int(torch.argmax(logits))
    scores = logits / params.temperature
    if params.top_k:
        kth = torch.topk(scores, min(params.top_k, scores.numel())).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True)
        probs = torch.softmax(sorted_scores, dim=-1)
        drop = probs.cumsum(-1) - probs > params.top_p  # keep the smallest set reaching top_p
        scores = scores.clone()
        scores[order[drop]] = float("-inf")
    probs = torch.softmax(scores, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def top_logprobs(logits: torch.Tensor, token: int, k: int) -> dict:
    logp = torch.log_softmax(logits, dim=-1)
    top = torch.topk(logp, k) if k else None
    return {
        "token": token,
        "logprob": float(logp[token]),
        "top": {int(i): float(v) for i, v in zip(top.indices, top.values)} if top is not None else {},
    }
