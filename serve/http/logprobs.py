"""OpenAI's logprobs blocks, from the engine's logprob entries (``{"token", "logprob", "top"}``).

Every token an entry names is decoded once per distinct id, in one batch, on the tokenizer
thread (these functions are called there): an lm-eval request of 64 long prompts with echo
names hundreds of thousands of ids. Completions key alternatives by text; chat lists them
with their UTF-8 bytes.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

from ..engine.llm_engine import RequestOutput


def entry_ids(entries: Iterable[dict | None]) -> set[int]:
    """The token ids logprob entries name: each chosen token and its alternatives."""
    return {t for e in entries if e for t in (e["token"], *e["top"])}


def decode_each(tokenizer, ids: set[int]) -> dict[int, str]:
    """Each id's text (``decode([id])``), decoded once per distinct id in one batch."""
    ids = list(ids)
    return dict(zip(ids, tokenizer.batch_decode([[t] for t in ids])))


def entry_texts(tokenizer, entries: list[dict]) -> dict[int, str]:
    """:func:`token_texts` of a stream chunk's few logprob entries."""
    return decode_each(tokenizer, entry_ids(entries))


def token_texts(tokenizer, outs: list[RequestOutput], prompts: bool) -> dict[int, str]:
    """Each token's text for every id the outputs' logprobs name (and their prompts'): an
    lm-eval request of 64 long prompts with echo names hundreds of thousands."""
    ids = entry_ids(e for out in outs for e in out.logprobs)
    if prompts:
        ids.update(t for out in outs for t in out.prompt_token_ids)
        ids |= entry_ids(e for out in outs for e in (out.prompt_logprobs or []))
    return decode_each(tokenizer, ids)


def logprob_block(texts: dict[int, str], out: RequestOutput, echo: bool, generated: bool = True) -> dict:
    """OpenAI's completion logprobs; with echo the prompt's tokens come first (the first has
    no logprob, as in OpenAI and vLLM). Each position's alternatives hold the chosen token
    too ("up to logprobs + 1", as OpenAI and vLLM); ``text_offset`` is where each token's
    text starts in the choice's text."""
    pairs = list(zip(out.prompt_token_ids, out.prompt_logprobs, strict=True)) if echo else []
    pairs += [(e["token"], e) for e in out.logprobs] if generated else []
    return completion_logprobs(texts, pairs)


def completion_logprobs(texts: dict[int, str], pairs: list[tuple[int, dict | None]], offset: int = 0) -> dict:
    """:func:`logprob_block` of (token, entry) pairs whose text starts at ``offset``."""
    tokens = [texts[t] for t, _ in pairs]
    offsets = list(itertools.accumulate((len(text) for text in tokens[:-1]), initial=offset)) if tokens else []
    return {"tokens": tokens, "token_logprobs": [e and e["logprob"] for _, e in pairs],
            "top_logprobs": [e and top_by_text(texts, {t: e["logprob"], **e["top"]}) for t, e in pairs],
            "text_offset": offsets}


def top_by_text(texts: dict[int, str], top: dict[int, float]) -> dict[str, float]:
    """OpenAI keys alternatives by text; tokens that decode alike (partial UTF-8 bytes) keep
    the best logprob."""
    by_text: dict[str, float] = {}
    for token, logprob in sorted(top.items(), key=lambda item: -item[1]):
        by_text.setdefault(texts[token], logprob)
    return by_text


def utf8(text: str) -> list[int]:
    """OpenAI's ``bytes`` of a token's text (vLLM's: its UTF-8, U+FFFD where it was cut)."""
    return list(text.encode("utf-8", errors="replace"))


def chat_logprobs(texts: dict[int, str], entries: list[dict]) -> dict:
    """OpenAI's chat logprobs of ``entries``: each token's text, logprob, bytes and alternatives."""
    return {"content": [
        {"token": texts[e["token"]], "logprob": e["logprob"], "bytes": utf8(texts[e["token"]]),
         "top_logprobs": [{"token": texts[t], "logprob": v, "bytes": utf8(texts[t])} for t, v in e["top"].items()]}
        for e in entries]}
