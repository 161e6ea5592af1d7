"""``/v1/completions``: OpenAI's four prompt shapes (text, token ids, or a batch of either:
one choice per prompt and sample), ``echo`` and ``logprobs``.

With ``echo`` and ``logprobs`` the prompt tokens are scored under the adapter's own sharing
semantics (the engine's ``prompt_logprobs``), which is how lm-eval's ``local-completions``
model computes loglikelihoods through a server; ``max_tokens: 0`` with ``echo`` scores the
prompt alone. Prompts are taken as given (an aLoRA's invocation included by the client).
"""

from __future__ import annotations

import time

from fastapi import Depends, Request
from fastapi.responses import Response

from ..engine.llm_engine import LLMEngine, RequestOutput
from .errors import ApiError
from .jobs import collect_all, start_all, unless_gone
from .limits import check_limits, check_prompt, check_scored
from .logprobs import completion_logprobs, logprob_block, token_texts
from .params import choice_params, hints_of, sampling_params, truncated
from .protocol import CompletionRequest
from .replies import json_reply, reply_id, usage
from .state import ServerState, get_state
from .streaming import Body, chunker, stream_events

async def completions(req: CompletionRequest, request: Request,
                      state: ServerState = Depends(get_state)) -> Response:
    """One choice per prompt and sample, as JSON or server-sent events."""
    base, engine, adapter = state.resolve(req.model)
    model = req.model or base
    check_limits(req, state.limits, engine.vocab_size)
    prompts, prompt_texts = await prompts_of(state, req, engine)
    # the prompt alone is scored by a step that samples one token, which the reply leaves out;
    # no limit: each prompt gets the rest of the context (vLLM)
    max_tokens_each = [max(req.max_tokens, 1) if req.max_tokens is not None
                       else max(1, engine.max_request_tokens() - len(prompt)) for prompt in prompts]
    for prompt, max_tokens in zip(prompts, max_tokens_each):
        check_prompt(engine, prompt, max_tokens)
    check_scored(req, prompts, state.limits)
    scored = req.logprobs if req.echo else None
    params_each = [sampling_params(req, engine, state.generation_config, max_tokens, req.logprobs,
                                   prompt_logprobs=scored) for max_tokens in max_tokens_each]
    rid, created = reply_id("cmpl", req), int(time.time())
    # choice index = prompt index * n + sample, as in OpenAI; gathered, so every job is
    # queued before any finishes and they share batches (and the prompt's blocks)
    jobs = [(prompt, p) for prompt, params in zip(prompts, params_each) for p in choice_params(params, req.n)]
    started = await unless_gone(request, start_all(state, jobs, base, adapter, hints_of(req, request), req.n))
    if not req.stream:
        outs = await unless_gone(request, collect_all(state, started, base))
        return await json_reply(state, lambda: {
            "id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": completion_choices(engine.tokenizer, outs, req, prompt_texts),
            "usage": usage(outs, req.n, generated=not req.prompt_only)})
    echoes = await state.off_loop(lambda: [echoed(engine.tokenizer, p, t) for p, t in zip(prompts, prompt_texts)]) \
        if req.echo else []
    return stream_events(state, started, base, params_each[0].stop,
                         *chunker(rid, created, req, model, _stream_body(req, echoes)),
                         tokenizer=engine.tokenizer if req.logprobs is not None else None)


def _stream_body(req: CompletionRequest, echoes: list[str]) -> Body:
    """A streamed choice's content; with echo, its first chunk is the prompt (as vLLM)."""
    def body(index, delta, finish, opening, entries, offset, texts):
        text = echoes[index // req.n] if opening and req.echo else delta or ""
        logprobs = None
        if req.logprobs is not None and not opening:
            logprobs = completion_logprobs(texts, [(e["token"], e) for e in entries], offset)
        return {"text": text, "finish_reason": None if opening else finish, "logprobs": logprobs}

    return body


async def prompts_of(state: ServerState, req: CompletionRequest,
                     engine: LLMEngine) -> tuple[list[list[int]], list[str | None]]:
    """Each prompt's token ids (truncated as asked) and its text as the client sent it
    (None for token ids, or where truncation dropped part of it)."""
    batch = req.prompt if isinstance(req.prompt, list) and req.prompt and not isinstance(req.prompt[0], int) \
        else [req.prompt]  # an empty list is one empty prompt, refused by check_prompt
    if len(batch) > state.limits.max_prompts:
        raise ApiError(400, f"{len(batch)} prompts in one request; at most {state.limits.max_prompts} are allowed",
                       param="prompt")
    texts = [p for p in batch if isinstance(p, str)]
    special = req.add_special_tokens
    encoded = iter(await state.off_loop(lambda: [engine.tokenizer.encode(t, add_special_tokens=special)
                                                 for t in texts]) if texts else [])
    prompts, prompt_texts = [], []
    for p in batch:
        ids = p if isinstance(p, list) else next(encoded)
        kept = truncated(req, engine, ids)
        prompts.append(kept)
        prompt_texts.append(p if isinstance(p, str) and len(kept) == len(ids) else None)
    return prompts, prompt_texts


def echoed(tokenizer, prompt: list[int], text: str | None) -> str:
    """The prompt as echo returns it: the client's own string (vLLM's ``prompt_text``), or
    the token ids decoded where it sent ids (or its text was truncated)."""
    return text if text is not None else tokenizer.decode(prompt)


def completion_choices(tokenizer, outs: list[RequestOutput], req: CompletionRequest,
                       prompt_texts: list[str | None]) -> list[dict]:
    """A finished completion's choices: run on the tokenizer thread, since echo and logprobs
    decode every prompt and output token and each alternative (the event loop serves
    every other request meanwhile)."""
    texts = token_texts(tokenizer, outs, req.echo) if req.logprobs is not None else {}
    generated = not req.prompt_only
    return [{"index": i, "finish_reason": out.finish_reason if generated else "length",
             "stop_reason": out.stop_reason if generated else None,
             "text": (echoed(tokenizer, out.prompt_token_ids, prompt_texts[i // req.n]) if req.echo else "")
             + (out.text if generated else ""),
             "logprobs": None if req.logprobs is None else logprob_block(texts, out, req.echo, generated)}
            for i, out in enumerate(outs)]
