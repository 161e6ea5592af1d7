"""A request's choices on the engine thread: queued together or not at all, collected, and
cancelled (their requests aborted, their KV blocks freed) when the client goes away.

``started`` below is a list of ``(first output, output stream)``, one per choice, as
:func:`start_all` returns it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

from fastapi import Request

from ...errors import KvshareError
from ..driver.engine_thread import Overloaded
from ..engine.llm_engine import RequestOutput
from ..hints import AgentHints
from ..sampling_params import SamplingParams
from .errors import ApiError
from .state import ServerState

T = TypeVar("T")
Started = list[tuple[RequestOutput, AsyncIterator[RequestOutput]]]


async def _run(state: ServerState, prompt: list[int], params: SamplingParams, base: str, adapter: str | None,
               hints: AgentHints) -> tuple[RequestOutput, AsyncIterator[RequestOutput]]:
    """Queue one choice and wait for its first output, so that a refusal is the request's
    status code rather than an error inside a stream that already said 200."""
    stream = state.engine_thread.generate(prompt, params, adapter, hints, model=base)
    try:
        first = await stream.__anext__()
    except Overloaded as err:
        raise ApiError(503, f"server overloaded: {err}", kind="server_error") from None
    except KvshareError as err:
        raise ApiError(400, str(err)) from None
    except RuntimeError as err:  # an engine thread gone: 503, which clients and routers retry elsewhere
        raise ApiError(500 if state.engine_thread.alive() else 503, str(err), kind="server_error") from None
    return first, stream


def _check_room(state: ServerState, jobs: int, base: str, hints: AgentHints, n: int) -> None:
    """Refuse a request whose choices one request may not queue (400) or that do not fit now (503)."""
    what = f"{jobs // n} prompts x n={n}" if n > 1 else f"{jobs} prompts"
    limit = state.limits.max_request_sequences
    if jobs > limit:  # else one request could fill the queue alone
        raise ApiError(400, f"{what} = {jobs} sequences; one request may queue at most "
                       f"max_request_sequences={limit}", param="n" if n > 1 else "prompt")
    if jobs > max(1, state.engine_thread.max_waiting):
        raise ApiError(400, f"{what} exceed the queue's capacity of {state.engine_thread.max_waiting}",
                       param="n" if n > 1 else "prompt")
    if not state.engine_thread.has_room(jobs, hints.workflow_id, base):
        raise ApiError(503, f"server overloaded: no room for {jobs} more requests", kind="server_error")


async def start_all(state: ServerState, jobs: list[tuple[list[int], SamplingParams]], base: str,
                    adapter: str | None, hints: AgentHints, n: int = 1) -> Started:
    """Queue every (prompt, params) job of a request, in order, or none: if one is refused,
    the others are aborted. A prompt's ``n`` choices are queued one after another, so the
    later ones wait for the first's prompt blocks and reuse them from the prefix cache."""
    _check_room(state, len(jobs), base, hints, n)
    tasks = [asyncio.ensure_future(_run(state, p, params, base, adapter, hints)) for p, params in jobs]
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


async def _collect(state: ServerState, first: RequestOutput, stream: AsyncIterator[RequestOutput],
                   base: str) -> RequestOutput:
    """One choice's final output, observed for ``/metrics``."""
    last = first
    if not last.finished:
        try:
            async for out in stream:
                last = out
        except RuntimeError as err:  # the engine failed this request mid-generation
            raise ApiError(500, str(err), kind="server_error") from None
    state.observe(last, base)
    return last


async def collect_all(state: ServerState, started: Started, base: str) -> list[RequestOutput]:
    """Every choice's final output; if one fails, the others are cancelled (which aborts
    their requests) rather than generating on for a reply that will not be sent."""
    tasks = [asyncio.ensure_future(_collect(state, first, stream, base)) for first, stream in started]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _disconnect(request: Request) -> None:
    """Returns when the client has gone: its body was read, so the next ASGI message is the
    disconnect."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_gone(request: Request, work: Awaitable[T]) -> T:
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
