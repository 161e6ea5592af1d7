"""What a request gives back: its output record, incremental text, stop rules, metrics.

Text is detokenised incrementally (vLLM's prefix/read-offset scheme): each new token decodes
only a short window, not the whole output, and a window ending in an incomplete UTF-8
character waits for the next token (or the end of the output). Stop strings are searched
only in the new tail (plus the longest stop string's overlap), so a step costs the same at
token 10 and token 10,000.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..sequence import Sequence

# tokens decoded before the new ones, so that merges and leading spaces come out right
_CONTEXT_TOKENS = 5


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    adapter: str | None
    logprobs: list[dict] = field(default_factory=list)
    metrics: dict = field(default_factory=dict)
    prompt_logprobs: list[dict | None] | None = None  # [None, {token, logprob, top}, ...]
    stop_reason: int | str | None = None  # vLLM's: the stop token id or stop string that ended it (None: EOS, length)


class IncrementalDetokenizer:
    """Text of a growing list of token ids, decoding only what is new. Primed with the
    prompt's last tokens, as vLLM's: a SentencePiece tokenizer then keeps the first output
    token's leading space (" Hello", where decoding the output alone gives "Hello")."""

    def __init__(self, tokenizer, prompt: list[int] = ()):
        self.tokenizer = tokenizer
        self.text = ""
        self.context = list(prompt[-_CONTEXT_TOKENS:])  # decoded before the output, never part of it
        self.prefix_offset = 0  # first token of the decode window (in context + output)
        self.read_offset = len(self.context)  # tokens before this are reflected in ``text``

    def _decode(self, ids: list[int], start: int, end: int | None = None) -> str:
        """The text of (context + ``ids``)[start:end], without joining the two lists."""
        n = len(self.context)
        end = n + len(ids) if end is None else end
        window = self.context[start:end] + ids[max(0, start - n):max(0, end - n)]
        return self.tokenizer.decode(window, skip_special_tokens=True)

    def update(self, ids: list[int]) -> str:
        """Account for ``ids`` (the whole output so far); return the text it added."""
        prefix = self._decode(ids, self.prefix_offset, self.read_offset)
        full = self._decode(ids, self.prefix_offset)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""  # nothing printable yet (a special token, or half a UTF-8 character)
        delta = full[len(prefix):]
        self.text += delta
        total = len(self.context) + len(ids)
        self.prefix_offset = max(self.read_offset, total - _CONTEXT_TOKENS)
        self.read_offset = total
        return delta

    def flush(self, ids: list[int]) -> None:
        """The output is final: add what was held back (a character that never completed
        decodes to U+FFFD, as in a whole decode)."""
        total = len(self.context) + len(ids)
        if self.read_offset < total:
            prefix = self._decode(ids, self.prefix_offset, self.read_offset)
            self.text += self._decode(ids, self.prefix_offset)[len(prefix):]
            self.read_offset = total


def stop_reason(seq: Sequence, eos_token_ids: frozenset[int], max_model_len: int,
                new_text: str) -> tuple[str | None, int | None]:
    """Why ``seq`` stops after its newest token, if it does, and where its text is cut.

    ``eos_token_ids``: every end-of-sequence id of the model
    (:func:`kvshare.models.end_of_sequence_ids`). Returns (reason, cut): reason is "stop"
    or "length" (None: go on); cut is the text length to keep when a stop string matched or a
    stop token's own text is left out (vLLM's rule; ``include_stop_str_in_output`` keeps both).
    A stop token id or stop string that ends it is noted in ``seq.stop_reason`` (vLLM's field).
    """
    params, token = seq.params, seq.output[-1]
    if len(seq.output) < params.min_tokens:  # vLLM's rule: before min_tokens only the context's end stops it
        return ("length", None) if len(seq) >= max_model_len else (None, None)
    if not params.ignore_eos and token in eos_token_ids:
        return "stop", None
    if token in params.stop_token_ids:
        seq.stop_reason = token
        return "stop", None if params.include_stop_str_in_output else len(seq.detokenizer.text) - len(new_text)
    if params.stop and new_text:
        text = seq.detokenizer.text
        longest = max(len(s) for s in params.stop)
        since = max(0, len(text) - len(new_text) - longest + 1)  # a match may straddle the tail
        hits = [(i, -len(s)) for i, s in ((text.find(s, since), s) for s in params.stop) if i >= 0]
        if hits:
            start, minus_length = min(hits)  # the earliest match (the longest of those that start there)
            seq.stop_reason = text[start:start - minus_length]
            return "stop", start - minus_length if params.include_stop_str_in_output else start
    if len(seq.output) >= params.max_tokens or len(seq) >= max_model_len:
        return "length", None
    return None, None


def request_metrics(seq: Sequence) -> dict:
    times = seq.token_times
    gaps = [b - a for a, b in zip(times, times[1:])]
    return {
        "queue_time": (seq.first_scheduled or seq.arrival) - seq.arrival,
        "time_to_first_token": (seq.first_token - seq.arrival) if seq.first_token else None,
        "inter_token_latency": sum(gaps) / len(gaps) if gaps else None,
        "e2e_time": (times[-1] - seq.arrival) if times else None,
        "prompt_tokens": len(seq.prompt),
        "prompt_tokens_cached": seq.num_cached_prompt,
        "prompt_tokens_computed": len(seq.prompt) - seq.num_cached_prompt,
        "preemptions": seq.preemptions,
        "load_wait_time": seq.load_wait_s,  # waiting for its prefix to come back from the host tier
    }


def error_output(seq: Sequence) -> RequestOutput:
    """A bare ``"error"`` output for ``seq``: no text, nothing that could fail to build."""
    return RequestOutput(seq.request_id, list(seq.prompt), list(seq.output), "", True, "error", seq.adapter)


def make_output(seq: Sequence, text: str) -> RequestOutput:
    return RequestOutput(seq.request_id, seq.prompt, list(seq.output), text,
                         seq.finish_reason is not None, seq.finish_reason, seq.adapter,
                         list(seq.logprobs), request_metrics(seq),
                         list(seq.prompt_logprobs) if seq.prompt_logprobs is not None else None, seq.stop_reason)
