"""OpenAI-compatible HTTP server over the engine: ``kvshare serve``.

``/v1/models``, ``/v1/completions``, ``/v1/chat/completions`` (JSON or server-sent events),
``/health`` and ``/metrics`` (Prometheus text). The request's ``model`` names the base or a
loaded adapter. Errors use OpenAI's JSON shape: 400 invalid or oversize input, 401 bad key,
404 unknown model, 413 body too large, 503 overloaded; every request is bounded by
:class:`~.config.ServerLimits`, and tokenisation runs off the event loop, so one hostile
request cannot stall or fail the others. With an aLoRA adapter, chat requests end with the
adapter's invocation after the conversation, as the adapter was trained; completion prompts
are taken as given (include the invocation to activate the adapter).

``/v1/completions`` takes OpenAI's four prompt shapes (text, token ids, or a batch of either:
one choice per prompt) and ``echo``: with ``logprobs`` the prompt tokens are scored under the
adapter's own sharing semantics (the engine's ``prompt_logprobs``), which is how lm-eval's
``local-completions`` model computes loglikelihoods through a server.

vLLM's surface, so that clients and scripts written for it work unchanged: its sampling
extensions (``top_k``, ``min_p``, ``repetition_penalty``), ``n`` choices per prompt (queued
together, so the later ones reuse the first's prompt blocks), ``stream_options.include_usage``,
chat content-part arrays, ``cache_salt`` (only requests with the same salt share prefix
blocks), model cards with ``root`` and ``parent``, and, behind a flag,
``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``. Fields we do not implement are a
400 that names them; vLLM's own request fields are implemented (``include_stop_str_in_output``,
``truncate_prompt_tokens``, ``request_id``, chat's ``add_generation_prompt``,
``continue_final_message`` and ``chat_template_kwargs``) or accepted at vLLM's defaults, so a
client that sends them as vLLM's does gets the same reply. A request that leaves out ``model``
runs on the first served base, as in vLLM 0.8 and later.

One app can serve several co-located base models (:class:`~.colocate.Colocation`): the
``model`` field routes each request to its base's engine (its tokenizer, chat template and
context length), and ``/v1/models`` lists every base with its adapters.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import PlainTextResponse, Response, StreamingResponse
from jinja2 import TemplateError
from starlette.exceptions import HTTPException

from .. import __version__
from ..errors import KvshareError
from .async_engine import AsyncEngine, Overloaded
from .colocate import Colocation, ModelSpec, UnknownModel, build_colocation
from .config import EngineConfig, ServerLimits
from .engine import LLMEngine, RequestOutput
from .hints import AgentHints
from .http.errors import ApiError, error_response
from .http.limits import check_context, check_in_vocabulary, check_limits, check_prompt, check_scored
from .http.middleware import ApiKeyGuard, BodyLimit, UnicodeCheckedRoute
from .http.protocol import (ChatMessage, ChatRequest, CompletionRequest, DetokenizeRequest, LoadLoraRequest,
                            TokenizeRequest, UnloadLoraRequest)
from .http.lora_scope import RuntimeLoraScope, StartupAdapterLocked
from .http.metrics import ServerMetrics
from .sampling import SamplingParams


def _raised_in_template(err: BaseException) -> bool:
    """Whether ``err`` came out of a chat template's own code (jinja2 compiles templates to
    code named ``<template>``), not out of ours."""
    tb = err.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<template>":
            return True
        tb = tb.tb_next
    return False


async def _disconnect(request: Request) -> None:
    """Returns when the client has gone: its body was read, so the next ASGI message is the
    disconnect."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _stop_prefix(text: str, stops: list[str]) -> int:
    """Length of the longest end of ``text`` that begins a stop string: a stream holds it back
    until the next tokens show whether the stop string follows (and would be cut), as vLLM does.
    Only lengths whose last character is the text's last are compared (``rfind`` finds them),
    so long stop strings cost a scan per streamed chunk, not a copy per length."""
    if not text:
        return 0
    last, longest = text[-1], 0
    for stop in stops:
        k = min(len(stop) - 1, len(text))
        while k > longest:
            k = stop.rfind(last, 0, k) + 1  # the longest k' <= k with stop[k' - 1] == last; 0: none
            if k <= longest:
                break
            if text.endswith(stop[:k]):
                longest = k
                break
            k -= 1
    return longest


_PIECE = 4096  # leaves (numbers, strings) per json.dumps call: about a millisecond of holding the GIL
_dumps = functools.partial(json.dumps, ensure_ascii=False, allow_nan=False, separators=(",", ":"))  # Starlette's


def _json_bytes(value) -> bytes:
    """``value`` as JSONResponse writes it, encoded in pieces (:func:`_json_pieces`): one
    ``json.dumps`` holds the GIL until it returns, so over a reply of a million logprobs it
    stalled the event loop for seconds even from another thread."""
    return "".join(_json_pieces(value)).encode("utf-8")


def _json_pieces(value):
    """JSON text of ``value`` in pieces of about ``_PIECE`` leaves, between which the thread
    lets the event loop run: containers of containers are taken apart, long lists sliced."""
    if isinstance(value, dict) and not _flat(value):
        yield "{"
        for i, (key, item) in enumerate(value.items()):
            yield ("," if i else "") + _dumps(str(key)) + ":"
            yield from _json_pieces(item)
        yield "}"
    elif isinstance(value, list) and not _flat(value):
        yield "["
        for i, run in enumerate(_runs(value)):
            yield "," if i else ""
            yield from _json_pieces(run[0]) if len(run) == 1 else (_dumps(run)[1:-1],)
        yield "]"
    elif isinstance(value, list) and len(value) > _PIECE:
        yield "[" + ",".join(_dumps(value[i:i + _PIECE])[1:-1] for i in range(0, len(value), _PIECE)) + "]"
    else:
        yield _dumps(value)


def _runs(items: list):
    """Consecutive ``items`` in runs of about ``_PIECE`` leaves; an item with containers inside
    (its size unknown) is a run of its own, for :func:`_json_pieces` to take apart."""
    run, leaves = [], 0
    for item in items:
        if not _flat(item):
            if run:
                yield run
            yield [item]
            run, leaves = [], 0
            continue
        run.append(item)
        leaves += len(item) if isinstance(item, (dict, list)) else 1
        if leaves >= _PIECE:
            yield run
            run, leaves = [], 0
    if run:
        yield run


def _flat(value) -> bool:
    """Whether ``value`` holds no dict or list: a leaf, or a container of leaves."""
    items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
    return not any(isinstance(item, (dict, list)) for item in items)


def create_app(engine: LLMEngine | Colocation, *, api_key: str | None = None,
               served_model_name: str | list[str] | None = None, max_waiting: int | None = None,
               limits: ServerLimits | None = None, enable_lora_loading: bool = False,
               generation_config: str = "auto", lora_root: str | Path | None = None,
               allow_runtime_replace_startup_adapters: bool = False) -> FastAPI:
    """The app over ``engine``, or over co-located engines (a :class:`Colocation`, served under
    its names; a request's ``model`` picks the engine); ``max_waiting`` overrides
    ``limits.max_waiting`` (a bound per model). One engine answers to every name in
    ``served_model_name`` (vLLM's flag; default: the engine's model name), each of which
    the model list shows (as vLLM's). ``enable_lora_loading`` adds vLLM's ``/v1/load_lora_adapter`` and
    ``/v1/unload_lora_adapter``: ``lora_root`` is the folder the adapters they load must lie in
    (symlinks followed), and the adapters loaded before the app is made stay unless
    ``allow_runtime_replace_startup_adapters`` (:mod:`.lora_scope`). Engines whose config asks
    for ``warm_up`` compile their steps here, with their adapters loaded, before the app answers. ``generation_config``: "auto"
    (vLLM's default) takes the sampling a request leaves out from each model's
    ``generation_config.json``; "vllm" leaves it off (temperature 1, no top-p/k/min-p, no penalty)."""
    if generation_config not in ("auto", "vllm"):
        raise KvshareError(f"generation_config must be 'auto' or 'vllm', not {generation_config!r}")
    limits = limits or ServerLimits()
    max_waiting = limits.max_waiting if max_waiting is None else max_waiting
    base_names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name or [])
    if isinstance(engine, Colocation):
        if base_names:
            raise KvshareError("co-located models are served under their Colocation names, not served_model_name")
        colocation = engine
    else:
        colocation = Colocation({(base_names or [engine.model_name])[0]: engine})
    aliases = {alias: base_names[0] for alias in base_names[1:]}  # further names of the one base
    hidden = sorted(set(aliases) & {a.name for each in colocation.engines.values() for a in each.adapters()})
    if hidden:  # the alias would win: requests for the adapter would run on the base
        raise KvshareError(f"served model name {hidden[0]!r} is also an adapter's name")
    lora_scope = RuntimeLoraScope(lora_root, {a.name for each in colocation.engines.values() for a in each.adapters()},
                                  allow_runtime_replace_startup_adapters)  # what is loaded now: the start-up adapters
    for each in colocation.engines.values():  # before the engine thread starts: it owns the engine then
        if each.config.warm_up:
            each.warm_up_all()
    runner = AsyncEngine(colocation, max_waiting=max_waiting)
    # tokenisation and chat templates run here, off the event loop; one worker (as in vLLM)
    # so a huge prompt costs one core, not every core
    tokenize_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvshare-tokenize")
    # runtime LoRA loads read and check their files here, one at a time, while the engine steps
    lora_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvshare-lora-load")
    server_metrics = ServerMetrics(colocation)  # /metrics: ours and vLLM's names

    @asynccontextmanager
    async def lifespan(_app):
        yield
        runner.shutdown()
        tokenize_pool.shutdown(wait=False, cancel_futures=True)
        lora_pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="kvshare", version="1", lifespan=lifespan)
    app.router.route_class = UnicodeCheckedRoute  # every route below: bodies that are not Unicode are 400
    app.state.runner = runner  # the engine thread, for health checks and tests

    @app.exception_handler(ApiError)
    async def _apierror_response(request: Request, err: ApiError):
        return error_response(err.status, err.message, err.kind, err.param)

    @app.exception_handler(HTTPException)
    async def _httperror_response(request: Request, err: HTTPException):  # routing, unparsable bodies
        return error_response(err.status_code, str(err.detail), "invalid_request_error" if err.status_code < 500
                      else "server_error")

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, err: Exception):  # a bug of ours: OpenAI's shape; logged by Starlette
        return error_response(500, f"internal server error ({type(err).__name__}); see the server's log", "server_error")

    @app.exception_handler(RequestValidationError)
    async def _validationerror_response(request: Request, err: RequestValidationError):
        first = err.errors()[0]
        where = ".".join(str(p) for p in first["loc"] if p != "body")
        if first["type"] == "extra_forbidden":  # e.g. vLLM's use_beam_search, guided_json
            return error_response(400, f"{where}: this field is not supported by kvshare", param=where or None)
        return error_response(400, f"{where}: {first['msg']}", param=where or None)

    app.add_middleware(BodyLimit, limit=limits.max_request_bytes)
    if api_key:  # added last, so it runs first: no key, no body read
        app.add_middleware(ApiKeyGuard, api_key=api_key)

    async def off_loop(work, *args):
        """Run CPU-bound ``work`` (tokenising, chat templates) on the tokenizer thread."""
        return await asyncio.get_running_loop().run_in_executor(tokenize_pool, work, *args)

    async def json_reply(build) -> Response:
        """The reply ``build()`` makes, built and encoded on the tokenizer thread in pieces
        (:func:`_json_bytes`): returned as a dict, FastAPI encoded it on the event loop, and a
        reply of a million logprobs held every other request (``/health`` too) for seconds."""
        return Response(await off_loop(lambda: _json_bytes(build())), media_type="application/json")

    def resolve(model: str | None) -> tuple[str, LLMEngine, str | None]:
        """The request's ``model`` -> (served base name, its engine, adapter or None); 404 if
        unknown. None: the first served base, as vLLM (0.8+) serves a request without one."""
        if model is None:
            model = next(iter(colocation.engines))
        try:
            return colocation.resolve(aliases.get(model, model))
        except UnknownModel as err:
            raise ApiError(404, str(err), kind="not_found_error", param="model") from None

    def params_of(req, engine: LLMEngine, max_tokens: int, logprobs: int | None,
                  prompt_logprobs: int | None = None) -> SamplingParams:
        """The request's sampling; what it leaves out comes from the model's generation config
        (unless ``--generation-config vllm``), else is off, as in vLLM."""
        req.check_neutral()
        shipped = engine.sampling_defaults if generation_config == "auto" else {}
        chosen = {name: getattr(req, name) if getattr(req, name) is not None else shipped.get(name, neutral)
                  for name, neutral in (("temperature", 1.0), ("top_p", 1.0), ("top_k", 0), ("min_p", 0.0),
                                        ("repetition_penalty", 1.0))}
        try:
            return SamplingParams(max_tokens=max_tokens, temperature=chosen["temperature"], top_p=chosen["top_p"],
                                  top_k=max(0, min(chosen["top_k"], engine.runner.vocab_size)), min_p=chosen["min_p"],
                                  repetition_penalty=chosen["repetition_penalty"], cache_salt=req.cache_salt,
                                  ignore_eos=req.ignore_eos, stop_token_ids=list(req.stop_token_ids or []),
                                  seed=req.seed, stop=[req.stop] if isinstance(req.stop, str) else (req.stop or []),
                                  include_stop_str_in_output=req.include_stop_str_in_output,
                                  min_tokens=req.min_tokens, allowed_token_ids=req.allowed_token_ids,
                                  logprobs=logprobs, prompt_logprobs=prompt_logprobs)
        except KvshareError as err:
            raise ApiError(400, str(err)) from None

    def truncated(req, engine: LLMEngine, tokens: list[int]) -> list[int]:
        """vLLM's ``truncate_prompt_tokens``: the prompt's last k tokens (-1: the context length)."""
        keep = req.truncate_prompt_tokens
        if keep is None:
            return tokens
        keep = engine.max_model_len if keep == -1 else keep
        if keep > engine.max_model_len:
            raise ApiError(400, f"truncate_prompt_tokens ({keep}) exceeds the maximum context length "
                           f"{engine.max_model_len}", param="truncate_prompt_tokens")
        return tokens[len(tokens) - keep:] if 0 < keep < len(tokens) else tokens

    def reply_id(prefix: str, req) -> str:
        """vLLM's reply ids: the client's ``request_id`` when it gives one."""
        return f"{prefix}-{req.request_id or uuid.uuid4().hex}"

    def observe(out: RequestOutput, base: str) -> None:
        server_metrics.observe(out, base)

    def hints_of(req, request: Request) -> AgentHints:
        """The request's agent hints: the ``kvshare_hints`` body field, ids also from router headers."""
        try:
            return AgentHints.parse(req.kvshare_hints, dict(request.headers))
        except KvshareError as err:
            raise ApiError(400, str(err), param="kvshare_hints") from None

    async def run(prompt, params, base: str, adapter, hints: AgentHints):
        stream = runner.generate(prompt, params, adapter, hints, model=base)
        try:
            first = await stream.__anext__()
        except Overloaded as err:
            raise ApiError(503, f"server overloaded: {err}", kind="server_error") from None
        except KvshareError as err:
            raise ApiError(400, str(err)) from None
        except RuntimeError as err:  # an engine thread gone: 503, which clients and routers retry elsewhere
            raise ApiError(500 if runner.alive() else 503, str(err), kind="server_error") from None
        return first, stream

    async def start_all(jobs: list[tuple[list[int], SamplingParams]], base: str, adapter, hints: AgentHints,
                        n: int = 1) -> list:
        """Queue every (prompt, params) job of a request, in order, or none: if one is refused,
        the others are aborted. A prompt's ``n`` choices are queued one after another, so the
        later ones wait for the first's prompt blocks and reuse them from the prefix cache."""
        what = f"{len(jobs) // n} prompts x n={n}" if n > 1 else f"{len(jobs)} prompts"
        if len(jobs) > limits.max_request_sequences:  # else one request could fill the queue alone
            raise ApiError(400, f"{what} = {len(jobs)} sequences; one request may queue at most "
                           f"max_request_sequences={limits.max_request_sequences}", param="n" if n > 1 else "prompt")
        if len(jobs) > max(1, runner.max_waiting):
            raise ApiError(400, f"{what} exceed the queue's capacity of {runner.max_waiting}",
                           param="n" if n > 1 else "prompt")
        if not runner.has_room(len(jobs), hints.workflow_id, base):
            raise ApiError(503, f"server overloaded: no room for {len(jobs)} more requests", kind="server_error")
        tasks = [asyncio.ensure_future(run(p, params, base, adapter, hints)) for p, params in jobs]
        try:
            started = await asyncio.gather(*tasks, return_exceptions=True)
        except asyncio.CancelledError:  # the client left while its requests were queued
            await asyncio.gather(*tasks, return_exceptions=True)
            await asyncio.gather(*(t.result()[1].aclose() for t in tasks if not t.cancelled() and not t.exception()))
            raise
        failed = [r for r in started if isinstance(r, BaseException)]
        if failed:
            await asyncio.gather(*(r[1].aclose() for r in started if not isinstance(r, BaseException)))
            raise failed[0]
        return started

    async def collect_all(started: list, base: str) -> list[RequestOutput]:
        """Every choice's final output; if one fails, the others are cancelled (which aborts
        their requests) rather than generating on for a reply that will not be sent."""
        tasks = [asyncio.ensure_future(collect(first, stream, base)) for first, stream in started]
        try:
            return await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def unless_gone(request: Request, work):
        """Await ``work``; if the client disconnects first, cancel it (which aborts its
        requests and frees their blocks) instead of generating for nobody. The disconnect is
        awaited, not polled (as vLLM's ``with_cancellation``): hundreds of waiting requests
        polling ten times a second each took the event loop from the rest."""
        task = asyncio.ensure_future(work)
        gone = asyncio.ensure_future(_disconnect(request))
        try:
            await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not task.done():
                task.cancel()
        if task.done() and not task.cancelled():
            return task.result()
        raise ApiError(499, "the client closed the request")

    async def collect(first: RequestOutput, stream, base: str) -> RequestOutput:
        last = first
        if not last.finished:
            try:
                async for out in stream:
                    last = out
            except RuntimeError as err:  # the engine failed this request mid-generation
                raise ApiError(500, str(err), kind="server_error") from None
        observe(last, base)
        return last

    def stream_events(started: list, base: str, stops: list[str], chunk, final=None, tokenizer=None):
        """Server-sent events over every choice's stream, merged as their tokens arrive:
        ``chunk(index, delta, finish_reason, opening, stop_reason, entries, offset, texts)`` makes an
        event; ``final(outputs)``, if given, the last one (the usage chunk). With ``tokenizer``
        (logprobs asked for) a chunk carries the logprob entries of the tokens generated since the
        last one (``entries``), their texts (``texts``, decoded off the event loop) and the first
        one's text offset (``offset``: the texts of the tokens before it, as the reply not streamed
        counts them); text held back (a stop string's possible start) holds nothing else back, as
        in vLLM. A choice that fails mid-stream ends the whole stream with an OpenAI-style error
        event, as in vLLM; a disconnect aborts every choice."""
        async def events():
            streams = [stream for _, stream in started]
            outs, sent = [first for first, _ in started], [""] * len(started)
            scored, offsets = [0] * len(started), [0] * len(started)  # logprob entries sent and their texts' length
            pending: dict[asyncio.Future, int] = {}
            try:
                for index in range(len(started)):
                    yield f"data: {json.dumps(chunk(index, None, None, True))}\n\n"
                ready, error = list(range(len(started))), None
                while True:
                    for index in ready:
                        out = outs[index]
                        text = out.text
                        if not out.finished:  # hold back half a character and what may begin a stop string
                            text = sent[index] if text.endswith("\ufffd") else text[:len(text) - _stop_prefix(text, stops)]
                        delta = text[len(sent[index]):] if text.startswith(sent[index]) else ""
                        sent[index] += delta
                        if delta or out.finished:
                            entries, scored[index] = out.logprobs[scored[index]:], len(out.logprobs)
                            texts = await off_loop(entry_texts, tokenizer, entries) if tokenizer and entries else {}
                            offset = offsets[index]
                            offsets[index] += sum(len(texts[e["token"]]) for e in entries) if texts else 0
                            event = chunk(index, delta, out.finish_reason, False, out.stop_reason, entries, offset,
                                          texts)
                            yield f"data: {json.dumps(event)}\n\n"
                        if out.finished:
                            observe(out, base)
                        else:
                            pending[asyncio.ensure_future(streams[index].__anext__())] = index
                    if not pending:
                        break
                    done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                    arrived = {pending.pop(task): task for task in done}
                    for task in arrived.values():
                        if isinstance(task.exception(), RuntimeError):
                            error = str(task.exception())
                        elif task.exception() is not None:
                            raise task.exception()
                    if error is not None:  # failed mid-stream: say so, as vLLM does, and end
                        body = {"message": error, "type": "server_error", "param": None, "code": 500}
                        yield f"data: {json.dumps({'error': body})}\n\n"
                        break
                    ready = sorted(arrived)
                    for index in ready:
                        outs[index] = arrived[index].result()
                if error is None and final is not None:
                    yield f"data: {json.dumps(final(outs))}\n\n"
                yield "data: [DONE]\n\n"
            finally:  # a disconnect lands here: every choice still running is aborted
                for task in pending:
                    task.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
                for stream in streams:
                    await stream.aclose()
        return StreamingResponse(events(), media_type="text/event-stream")

    def usage(outs: list[RequestOutput], n: int = 1, generated: bool = True) -> dict:
        """OpenAI's usage: each prompt's tokens once (its first choice's, which computed what
        the cache did not hold), every choice's completion tokens (none for the prompt alone)."""
        firsts = outs[::n]
        prompt = sum(len(o.prompt_token_ids) for o in firsts)
        completion = sum(len(o.token_ids) for o in outs) if generated else 0
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": sum(o.metrics["prompt_tokens_cached"] for o in firsts)}}

    def entry_ids(entries) -> set[int]:
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

    def utf8(text: str) -> list[int]:
        """OpenAI's ``bytes`` of a token's text (vLLM's: its UTF-8, U+FFFD where it was cut)."""
        return list(text.encode("utf-8", errors="replace"))

    def chat_choices(tokenizer, outs: list[RequestOutput], logprobs: bool) -> list[dict]:
        """A finished chat's choices (on the tokenizer thread, as :func:`completion_choices`)."""
        texts = token_texts(tokenizer, outs, False) if logprobs else {}
        choices = []
        for index, out in enumerate(outs):
            choice: dict[str, Any] = {"index": index, "message": {"role": "assistant", "content": out.text},
                                      "finish_reason": out.finish_reason, "stop_reason": out.stop_reason}
            if logprobs:
                choice["logprobs"] = chat_logprobs(texts, out.logprobs)
            choices.append(choice)
        return choices

    def chat_logprobs(texts: dict[int, str], entries: list[dict]) -> dict:
        """OpenAI's chat logprobs of ``entries``: each token's text, logprob, bytes and alternatives."""
        return {"content": [
            {"token": texts[e["token"]], "logprob": e["logprob"], "bytes": utf8(texts[e["token"]]),
             "top_logprobs": [{"token": texts[t], "logprob": v, "bytes": utf8(texts[t])} for t, v in e["top"].items()]}
            for e in entries]}

    async def prompts_of(req: CompletionRequest, engine: LLMEngine) -> tuple[list[list[int]], list[str | None]]:
        """Each prompt's token ids (truncated as asked) and its text as the client sent it
        (None for token ids, or where truncation dropped part of it)."""
        batch = req.prompt if isinstance(req.prompt, list) and req.prompt and not isinstance(req.prompt[0], int) \
            else [req.prompt]  # an empty list is one empty prompt, refused by check_prompt
        if len(batch) > limits.max_prompts:
            raise ApiError(400, f"{len(batch)} prompts in one request; at most {limits.max_prompts} are allowed",
                           param="prompt")
        texts = [p for p in batch if isinstance(p, str)]
        special = req.add_special_tokens
        encoded = iter(await off_loop(lambda: [engine.tokenizer.encode(t, add_special_tokens=special)
                                               for t in texts]) if texts else [])
        prompts, prompt_texts = [], []
        for p in batch:
            ids = p if isinstance(p, list) else next(encoded)
            kept = truncated(req, engine, ids)
            prompts.append(kept)
            prompt_texts.append(p if isinstance(p, str) and len(kept) == len(ids) else None)
        return prompts, prompt_texts

    @app.get("/health")
    async def health():
        problem = runner.health()
        if problem is not None:  # a load balancer must stop sending here
            return error_response(503, problem, kind="server_error")
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(server_metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        """vLLM's model cards: ``root`` is where the weights came from, ``parent`` the base an
        adapter runs on (None for the base)."""
        return {"object": "list", "data": model_cards()}

    def model_cards() -> list[dict]:
        now, data = int(time.time()), []
        for base_name, engine in colocation.engines.items():  # each base under each of its names, then its adapters
            for name in [base_name, *(alias for alias, target in aliases.items() if target == base_name)]:
                data.append({"id": name, "object": "model", "created": now, "owned_by": "kvshare",
                             "root": str(engine.model_dir), "parent": None, "max_model_len": engine.max_model_len,
                             "kind": "base"})
            for adapter in engine.adapters():
                data.append({"id": adapter.name, "object": "model", "created": now, "owned_by": "kvshare",
                             "root": str(adapter.path), "parent": base_name, "kind": adapter.kind.value,
                             "kv_sharing": adapter.spec.scope.value})  # as served (ForkKV: "forkkv")
        return data

    @app.get("/v1/models/{model:path}")
    async def model_card(model: str):
        """OpenAI's retrieve-model: one card of :func:`models`, or a 404 naming the model."""
        card = next((c for c in model_cards() if c["id"] == model), None)
        if card is None:
            raise ApiError(404, f"The model '{model}' does not exist", kind="not_found_error", param="model")
        return card

    @app.get("/version")
    async def version():
        return {"version": __version__}

    async def chat_tokens(engine: LLMEngine, messages: list[ChatMessage], adapter: str | None,
                          req: ChatRequest | None = None) -> list[int]:
        """The prompt a chat runs as for ``adapter`` (:meth:`LLMEngine.chat_prompt`), with the
        request's template fields; a 400 when the chat template refuses the messages."""
        plain = [{**m.model_dump(exclude_none=True), "content": m.text(f"messages.{i}")}
                 for i, m in enumerate(messages)]
        options = {} if req is None else dict(add_generation_prompt=req.add_generation_prompt,
                                              continue_final_message=req.continue_final_message,
                                              template_kwargs=req.chat_template_kwargs)
        try:
            return await off_loop(lambda: engine.chat_prompt(plain, adapter, **options))
        except (TemplateError, ValueError) as err:  # the template refused these messages
            raise ApiError(400, f"the chat template failed: {err}", param="messages") from None
        except (TypeError, KeyError, IndexError) as err:  # the template read a field these messages lack
            if not _raised_in_template(err):
                raise  # ours: a 500, with its traceback in the log
            raise ApiError(400, f"the chat template failed: {type(err).__name__}: {err}", param="messages") from None
        except KvshareError as err:  # e.g. the adapter was unloaded since the request named it
            raise ApiError(400, str(err), param="model") from None

    def tokenizing_engine(model: str | None) -> tuple[LLMEngine, str | None]:
        """The engine (and adapter) a tokenize request names; the first base when it names none."""
        if model is None:
            return next(iter(colocation.engines.values())), None
        _, engine, adapter = resolve(model)
        return engine, adapter

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        engine, adapter = tokenizing_engine(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise ApiError(400, "give either prompt or messages", param="prompt")
        if req.messages is None:
            special = req.add_special_tokens
            tokens = await off_loop(lambda: engine.tokenizer.encode(req.prompt, add_special_tokens=special))
        else:
            tokens = await chat_tokens(engine, req.messages, adapter)
        check_context(engine, len(tokens), "prompt" if req.messages is None else "messages")
        return {"count": len(tokens), "max_model_len": engine.max_model_len, "tokens": list(tokens)}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        engine, _ = tokenizing_engine(req.model)
        check_context(engine, len(req.tokens), "tokens")  # before any id is read or decoded
        check_in_vocabulary(req.tokens, engine.runner.vocab_size, "tokens")
        return {"prompt": await off_loop(engine.tokenizer.decode, req.tokens)}

    def choice_params(params: SamplingParams, n: int) -> list[SamplingParams]:
        """Each of ``n`` choices' params: with a seed, choice i draws with seed + i (as vLLM),
        so the choices differ and the whole reply repeats; choice 0 is the n=1 reply."""
        if params.seed is None:
            return [params] * n
        return [replace(params, seed=(params.seed + i + 2 ** 63) % 2 ** 64 - 2 ** 63) for i in range(n)]

    def chunker(rid: str, created: int, req, model: str, body):
        """``chunk`` for :func:`stream_events`: ``body(index, delta, finish, opening)`` is one
        choice's content; with ``include_usage`` every chunk has ``usage: null``, as in OpenAI."""
        obj = "text_completion" if isinstance(req, CompletionRequest) else "chat.completion.chunk"
        extra = {"usage": None} if req.include_usage else {}

        def chunk(index, delta, finish, opening, stop=None, entries=(), offset=0, texts=None):
            choice = {"index": index, **body(index, delta, finish, opening, list(entries), offset, texts or {}),
                      "stop_reason": stop}
            return {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice], **extra}

        def final(outs):
            return {"id": rid, "object": obj, "created": created, "model": model, "choices": [],
                    "usage": usage(outs, req.n)}

        return chunk, final if req.include_usage else None

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        base, engine, adapter = resolve(req.model)
        model = req.model or base
        check_limits(req, limits, engine.runner.vocab_size)
        prompts, prompt_texts = await prompts_of(req, engine)
        # the prompt alone is scored by a step that samples one token, which the reply leaves out;
        # no limit: each prompt gets the rest of the context (vLLM)
        max_tokens_each = [max(req.max_tokens, 1) if req.max_tokens is not None
                           else max(1, engine.max_request_tokens() - len(prompt)) for prompt in prompts]
        for prompt, max_tokens in zip(prompts, max_tokens_each):
            check_prompt(engine, prompt, max_tokens)
        check_scored(req, prompts, limits)
        scored = req.logprobs if req.echo else None
        params_each = [params_of(req, engine, max_tokens, req.logprobs, prompt_logprobs=scored)
                       for max_tokens in max_tokens_each]
        rid, created = reply_id("cmpl", req), int(time.time())
        # choice index = prompt index * n + sample, as in OpenAI; gathered, so every job is
        # queued before any finishes and they share batches (and the prompt's blocks)
        jobs = [(prompt, p) for prompt, params in zip(prompts, params_each) for p in choice_params(params, req.n)]
        started = await unless_gone(request, start_all(jobs, base, adapter, hints_of(req, request), req.n))
        if not req.stream:
            outs = await unless_gone(request, collect_all(started, base))
            return await json_reply(lambda: {
                "id": rid, "object": "text_completion", "created": created, "model": model,
                "choices": completion_choices(engine.tokenizer, outs, req, prompt_texts),
                "usage": usage(outs, req.n, generated=not req.prompt_only)})
        echoes = await off_loop(lambda: [echoed(engine.tokenizer, p, t) for p, t in zip(prompts, prompt_texts)]) \
            if req.echo else []

        def body(index, delta, finish, opening, entries, offset, texts):  # with echo, a first chunk is the prompt (vLLM)
            text = echoes[index // req.n] if opening and req.echo else delta or ""
            logprobs = None
            if req.logprobs is not None and not opening:
                logprobs = completion_logprobs(texts, [(e["token"], e) for e in entries], offset)
            return {"text": text, "finish_reason": None if opening else finish, "logprobs": logprobs}

        return stream_events(started, base, params_each[0].stop, *chunker(rid, created, req, model, body),
                             tokenizer=engine.tokenizer if req.logprobs is not None else None)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest, request: Request):
        base, engine, adapter = resolve(req.model)
        model = req.model or base
        check_limits(req, limits, engine.runner.vocab_size)
        req.check_neutral()  # before the template runs with the request's options
        prompt = truncated(req, engine, await chat_tokens(engine, req.messages, adapter, req))
        # without a limit, the rest of the context (as OpenAI and vLLM)
        max_tokens = req.max_completion_tokens or req.max_tokens or max(1, engine.max_request_tokens() - len(prompt))
        check_prompt(engine, prompt, max_tokens)
        params = params_of(req, engine, max_tokens, (req.top_logprobs or 0) if req.logprobs else None)
        started = await unless_gone(request, start_all([(prompt, p) for p in choice_params(params, req.n)], base,
                                                        adapter, hints_of(req, request), req.n))
        rid, created = reply_id("chatcmpl", req), int(time.time())

        def body(index, delta, finish, opening, entries, offset, texts):
            content = {"role": "assistant", "content": ""} if opening else ({"content": delta} if delta else {})
            logprobs = chat_logprobs(texts, entries) if req.logprobs and not opening else None
            return {"delta": content, "logprobs": logprobs, "finish_reason": None if opening else finish}

        if req.stream:
            return stream_events(started, base, params.stop, *chunker(rid, created, req, model, body),
                                 tokenizer=engine.tokenizer if req.logprobs else None)
        outs = await unless_gone(request, collect_all(started, base))
        return await json_reply(lambda: {"id": rid, "object": "chat.completion", "created": created, "model": model,
                                         "choices": chat_choices(engine.tokenizer, outs, bool(req.logprobs)),
                                         "usage": usage(outs, req.n)})

    if enable_lora_loading:  # vLLM's runtime LoRA updating; without the flag these are 404, as in vLLM
        def refuse_if_startup(name: str) -> None:
            """403, naming the flag that allows it, for unloading or replacing a start-up adapter."""
            try:
                lora_scope.check_replaceable(name)
            except StartupAdapterLocked as err:
                raise ApiError(403, str(err), kind="permission_error", param="lora_name") from None

        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(req: LoadLoraRequest):
            """Load an exported adapter under ``lora_name``, with the checks of ``--adapter``
            (manifest, files, base fingerprint, finite weights), onto the base
            ``base_model_name`` names (default: the first served base). The files are read and
            checked on the load worker while the engine steps; only the install runs on the
            engine thread, between steps. Paths are scoped and refused as :mod:`.lora_scope` says."""
            if req.lora_name in colocation.engines or req.lora_name in aliases:
                raise ApiError(400, f"{req.lora_name!r} is a base model's name", param="lora_name")
            base = aliases.get(req.base_model_name, req.base_model_name) or next(iter(colocation.engines))
            if base not in colocation.engines:
                raise ApiError(400, f"base_model_name {req.base_model_name!r} is not a base model served here "
                               f"({', '.join(map(repr, colocation.engines))})", param="base_model_name")
            if any(a.name == req.lora_name for a in colocation.engines[base].adapters()):
                refuse_if_startup(req.lora_name)  # else: refused below as already loaded (unload it first)
            try:
                adapter = await asyncio.get_running_loop().run_in_executor(
                    lora_pool, lora_scope.prepare, colocation, base, req.lora_path, req.lora_name)
                await runner.call(lambda _: colocation.install_adapter(base, adapter))
            except KvshareError as err:  # AdapterPathRefused among them: one message, whatever the reason
                raise ApiError(400, str(err), param="lora_path") from None
            return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(req: UnloadLoraRequest):
            """Unload an adapter; refused (409) while requests use it, and (403) when it was given
            at start-up, unless the server allows that."""
            try:
                _, engine, adapter = colocation.resolve(req.lora_name)
            except UnknownModel:
                adapter = None
            if adapter is None:
                raise ApiError(404, f"The lora adapter '{req.lora_name}' cannot be found.",
                               kind="not_found_error", param="lora_name")
            refuse_if_startup(req.lora_name)
            try:
                await runner.call(lambda _: engine.unload_adapter(req.lora_name))
            except KvshareError as err:
                raise ApiError(409, f"{err}: unload it when they have finished", kind="conflict_error",
                               param="lora_name") from None
            lora_scope.unloaded(req.lora_name)
            return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")

    return app


def serve(model: str, adapters: list[str], *, host: str = "127.0.0.1", port: int = 8000,
          api_key: str | None = None, config: EngineConfig | None = None,
          limits: ServerLimits | None = None, lora_modules: list[tuple[str, str]] = (),
          served_model_name: list[str] | None = None, enable_lora_loading: bool = False,
          colocate: list[ModelSpec] = (), lending: bool = False, generation_config: str = "auto",
          lora_root: str | None = None, allow_runtime_replace_startup_adapters: bool = False) -> None:
    """Serve ``model`` with ``adapters`` (under their manifest names) and ``lora_modules``
    ((name, path): vLLM's ``--lora-modules``, served under ``name``), and beside it the
    ``colocate`` models in the same process (with ``lending``, they lend each other KV blocks).
    ``lora_root`` and ``allow_runtime_replace_startup_adapters``: as :func:`create_app`'s."""
    import uvicorn

    check_port_free(host, port)  # before minutes of loading models, not after
    if colocate or lending:
        if served_model_name and len(served_model_name) > 1:
            raise KvshareError("co-located models take one served name each (no aliases)")
        name = (served_model_name or [model])[0]
        colocation = build_colocation([(model, list(adapters), config or EngineConfig(), name), *colocate], lending)
        for lora_name, path in lora_modules:
            colocation.load_adapter(name, path, lora_name)
        app = create_app(colocation, api_key=api_key, limits=limits, enable_lora_loading=enable_lora_loading,
                         generation_config=generation_config, lora_root=lora_root,
                         allow_runtime_replace_startup_adapters=allow_runtime_replace_startup_adapters)
    else:
        engine = LLMEngine(model, adapters, config)
        for lora_name, path in lora_modules:
            engine.load_adapter(path, lora_name)
        app = create_app(engine, api_key=api_key, limits=limits, served_model_name=served_model_name,
                         enable_lora_loading=enable_lora_loading, generation_config=generation_config,
                         lora_root=lora_root,
                         allow_runtime_replace_startup_adapters=allow_runtime_replace_startup_adapters)
    try:
        uvicorn.run(app, host=host, port=port, log_level="info")
    except SystemExit as stop:  # uvicorn logs why it could not start, then exits
        if stop.code not in (0, None):
            raise KvshareError(f"the server could not start on {host}:{port} (uvicorn's log above says why)") from None
        raise


def check_port_free(host: str, port: int) -> None:
    """A one-line error when ``host:port`` cannot be listened on (in use, not this machine's
    address, a privileged port), as uvicorn would bind it (``SO_REUSEADDR``)."""
    import socket

    if port == 0:  # any free port
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as err:
        raise KvshareError(f"cannot listen on {host}:{port}: {err.strerror}") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as err:
            raise KvshareError(f"cannot listen on {host}:{port}: {err.strerror}") from None
