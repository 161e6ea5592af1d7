"""``/v1/chat/completions``: the conversation rendered by the model's chat template for the
adapter it names (an adapter's training system prompt, an aLoRA's invocation after the
conversation, as the adapter was trained), with vLLM's template fields.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import Depends, Request
from fastapi.responses import Response
from jinja2 import TemplateError

from ...errors import KvshareError
from ..engine.llm_engine import LLMEngine, RequestOutput
from .errors import ApiError
from .jobs import collect_all, start_all, unless_gone
from .limits import check_limits, check_prompt
from .logprobs import chat_logprobs, token_texts
from .params import choice_params, hints_of, sampling_params, truncated
from .protocol import ChatMessage, ChatRequest
from .replies import json_reply, reply_id, usage
from .state import ServerState, get_state
from .streaming import Body, chunker, stream_events

async def chat(req: ChatRequest, request: Request, state: ServerState = Depends(get_state)) -> Response:
    """``n`` choices of one conversation, as JSON or server-sent events."""
    base, engine, adapter = state.resolve(req.model)
    model = req.model or base
    check_limits(req, state.limits, engine.vocab_size)
    req.check_neutral()  # before the template runs with the request's options
    prompt = truncated(req, engine, await chat_tokens(state, engine, req.messages, adapter, req))
    # without a limit, the rest of the context (as OpenAI and vLLM)
    max_tokens = req.max_completion_tokens or req.max_tokens or max(1, engine.max_request_tokens() - len(prompt))
    check_prompt(engine, prompt, max_tokens)
    params = sampling_params(req, engine, state.generation_config, max_tokens,
                             (req.top_logprobs or 0) if req.logprobs else None)
    started = await unless_gone(request, start_all(state, [(prompt, p) for p in choice_params(params, req.n)],
                                                   base, adapter, hints_of(req, request), req.n))
    rid, created = reply_id("chatcmpl", req), int(time.time())
    if req.stream:
        return stream_events(state, started, base, params.stop, *chunker(rid, created, req, model, _stream_body(req)),
                             tokenizer=engine.tokenizer if req.logprobs else None)
    outs = await unless_gone(request, collect_all(state, started, base))
    return await json_reply(state, lambda: {
        "id": rid, "object": "chat.completion", "created": created, "model": model,
        "choices": chat_choices(engine.tokenizer, outs, bool(req.logprobs)), "usage": usage(outs, req.n)})


def _stream_body(req: ChatRequest) -> Body:
    """A streamed choice's content: the assistant's role first, then the text as it comes."""
    def body(index, delta, finish, opening, entries, offset, texts):
        content = {"role": "assistant", "content": ""} if opening else ({"content": delta} if delta else {})
        logprobs = chat_logprobs(texts, entries) if req.logprobs and not opening else None
        return {"delta": content, "logprobs": logprobs, "finish_reason": None if opening else finish}

    return body


def chat_choices(tokenizer, outs: list[RequestOutput], logprobs: bool) -> list[dict]:
    """A finished chat's choices (on the tokenizer thread: logprobs decode every token)."""
    texts = token_texts(tokenizer, outs, False) if logprobs else {}
    choices = []
    for index, out in enumerate(outs):
        choice: dict[str, Any] = {"index": index, "message": {"role": "assistant", "content": out.text},
                                  "finish_reason": out.finish_reason, "stop_reason": out.stop_reason}
        if logprobs:
            choice["logprobs"] = chat_logprobs(texts, out.logprobs)
        choices.append(choice)
    return choices


async def chat_tokens(state: ServerState, engine: LLMEngine, messages: list[ChatMessage], adapter: str | None,
                      req: ChatRequest | None = None) -> list[int]:
    """The prompt a chat runs as for ``adapter`` (:meth:`LLMEngine.chat_prompt`), with the
    request's template fields; a 400 when the chat template refuses the messages."""
    plain = [{**m.model_dump(exclude_none=True), "content": m.text(f"messages.{i}")}
             for i, m in enumerate(messages)]
    options = {} if req is None else dict(add_generation_prompt=req.add_generation_prompt,
                                          continue_final_message=req.continue_final_message,
                                          template_kwargs=req.chat_template_kwargs)
    try:
        return await state.off_loop(lambda: engine.chat_prompt(plain, adapter, **options))
    except (TemplateError, ValueError) as err:  # the template refused these messages
        raise ApiError(400, f"the chat template failed: {err}", param="messages") from None
    except (TypeError, KeyError, IndexError) as err:  # the template read a field these messages lack
        if not _raised_in_template(err):
            raise  # ours: a 500, with its traceback in the log
        raise ApiError(400, f"the chat template failed: {type(err).__name__}: {err}", param="messages") from None
    except KvshareError as err:  # e.g. the adapter was unloaded since the request named it
        raise ApiError(400, str(err), param="model") from None


def _raised_in_template(err: BaseException) -> bool:
    """Whether ``err`` came out of a chat template's own code (jinja2 compiles templates to
    code named ``<template>``), not out of ours."""
    tb = err.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<template>":
            return True
        tb = tb.tb_next
    return False
