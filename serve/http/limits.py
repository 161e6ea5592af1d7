"""What one request may cost, beyond its fields' own validation (:mod:`.protocol`): the
bounds of :class:`~kvshare.serve.config.ServerLimits`, the vocabulary and the context length.

Each refusal is a 400 naming the field, raised before any of the request's work is queued,
so that one request cannot take more than its share of the server.
"""

from __future__ import annotations

import json

from ..config import ServerLimits
from ..engine.llm_engine import LLMEngine
from .errors import ApiError
from .protocol import ChatRequest, CompletionRequest, OpenAIRequest


def _nesting(value, limit: int) -> int:
    """Depth of nested objects and lists in ``value``, counted without recursion and no
    further than ``limit + 1``."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        item, depth = todo.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            if depth > limit:
                return depth
            todo.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def check_in_vocabulary(ids: list[int], vocab_size: int, param: str) -> None:
    """A 400 naming the first token id outside the vocabulary."""
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ApiError(400, f"{param}: token id {bad} is outside the vocabulary (0 to {vocab_size - 1})", param=param)


def check_scored(req: CompletionRequest, prompts: list[list[int]], limits: ServerLimits) -> None:
    """A 400 when echo with logprobs would score more than ``max_scored_entries`` entries: every
    prompt token of every choice, with its ``logprobs`` alternatives and itself. Each is decoded,
    kept and encoded into the reply (tens of bytes of JSON apiece)."""
    if not req.echo or req.logprobs is None:
        return
    tokens = sum(map(len, prompts))
    entries = tokens * req.n * (req.logprobs + 1)
    if entries > limits.max_scored_entries:
        raise ApiError(400, f"echo with logprobs={req.logprobs} scores {entries} entries ({tokens} prompt tokens x "
                       f"n={req.n} x {req.logprobs + 1}); at most max_scored_entries={limits.max_scored_entries}",
                       param="logprobs")


def check_context(engine: LLMEngine, count: int, param: str) -> None:
    """/tokenize and /detokenize: a 400 for more tokens than the context holds, the bound the
    generation routes put on every prompt, so that neither route is the way around it."""
    if count > engine.max_model_len:
        raise ApiError(400, f"{count} tokens exceed the maximum context length {engine.max_model_len}", param=param)


def check_allowed_token_ids(ids: list[int] | None, vocab_size: int) -> None:
    """A 400 for ``allowed_token_ids`` longer than the vocabulary (some id repeats: a list of
    megabytes, each id a loop iteration) or naming an id outside it; counted before any id is read."""
    if ids is None:
        return
    if len(ids) > vocab_size:
        raise ApiError(400, f"allowed_token_ids has {len(ids)} ids; at most the vocabulary size {vocab_size} "
                       "(each id once)", param="allowed_token_ids")
    check_in_vocabulary(ids, vocab_size, "allowed_token_ids")


def check_limits(req: OpenAIRequest, limits: ServerLimits, vocab_size: int) -> None:
    """Refuse (400) what would cost more than one request's share: long or many stop strings,
    large or deep ``kvshare_hints``, more logprobs than ``max_logprobs``, a top_k beyond the
    vocabulary. The hints' fields themselves are the engine's to validate."""
    if req.n > limits.max_n:
        raise ApiError(400, f"n must be at most {limits.max_n}", param="n")
    stops = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    if len(stops) > limits.max_stop_sequences:
        raise ApiError(400, f"stop has {len(stops)} sequences; at most {limits.max_stop_sequences} are allowed",
                       param="stop")
    if any(not 0 < len(s) <= limits.max_stop_length for s in stops):
        raise ApiError(400, f"each stop sequence must have 1 to {limits.max_stop_length} characters", param="stop")
    if req.top_k is not None and req.top_k > vocab_size:
        raise ApiError(400, f"top_k must be -1 (off) or at most the vocabulary size {vocab_size}", param="top_k")
    stop_ids = req.stop_token_ids or []
    if len(stop_ids) > limits.max_stop_sequences:
        raise ApiError(400, f"stop_token_ids has {len(stop_ids)} ids; at most {limits.max_stop_sequences} are "
                       "allowed", param="stop_token_ids")
    check_in_vocabulary(stop_ids, vocab_size, "stop_token_ids")
    check_allowed_token_ids(req.allowed_token_ids, vocab_size)
    for name in ("logprobs", "top_logprobs"):
        value = getattr(req, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > limits.max_logprobs:
            raise ApiError(400, f"{name} must be at most {limits.max_logprobs}", param=name)
    if isinstance(req, ChatRequest) and req.top_logprobs and not req.logprobs:  # 0 alone asks for nothing (vLLM)
        raise ApiError(400, "top_logprobs needs logprobs set to true", param="top_logprobs")
    if req.kvshare_hints is not None:
        _check_hints(req.kvshare_hints, limits)


def _check_hints(hints: dict, limits: ServerLimits) -> None:
    """``kvshare_hints`` no deeper and no larger than the limits; its fields are the engine's to check."""
    if _nesting(hints, limits.max_hints_depth) > limits.max_hints_depth:
        raise ApiError(400, f"kvshare_hints nests deeper than {limits.max_hints_depth} levels",
                       param="kvshare_hints")
    size = len(json.dumps(hints, separators=(",", ":")).encode())
    if size > limits.max_hints_bytes:
        raise ApiError(400, f"kvshare_hints is {size} bytes as JSON; at most {limits.max_hints_bytes} are allowed",
                       param="kvshare_hints")


def check_prompt(engine: LLMEngine, tokens: list[int], max_tokens: int) -> None:
    """A 400 for an empty prompt, or one that leaves no room in the context for ``max_tokens``."""
    if not tokens:
        raise ApiError(400, "the prompt is empty", param="prompt")
    if len(tokens) + max_tokens > engine.max_model_len:
        raise ApiError(400, f"prompt ({len(tokens)} tokens) + max_tokens ({max_tokens}) exceeds the "
                       f"maximum context length {engine.max_model_len}", param="max_tokens")
