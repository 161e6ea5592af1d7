"""The engine on its own thread, driven from asyncio: what the HTTP server talks to.

The engine is single-threaded by design (one forward at a time over one KV pool), so every
call into it - add, abort, step - happens on one background thread; coroutines send it
commands and receive each request's outputs on their own asyncio queue. Co-located models
(:class:`~.colocation.Colocation`) share that one thread: a command names its model, and each
cycle steps every model with work, one after another.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import queue
import threading
import time
from typing import AsyncIterator

from ...errors import KvshareError
from .colocation import Colocation
from ..engine.llm_engine import LLMEngine, RequestOutput
from ..hints import AgentHints
from ..exec.openmp import release_openmp_workers
from ..sampling_params import SamplingParams


logger = logging.getLogger(__name__)
UNHEALTHY_AFTER = 3  # whole steps failing in a row: the engine, not one request, is broken
PROBE_EVERY_S = 5.0  # an idle engine marked unhealthy checks itself this long after its last failure, then as often
PROBE_MAX_STEPS = 8  # a one-token probe finishes in one step (two with a host-tier load)


class Overloaded(Exception):
    """Too many requests are waiting; the caller should retry later (HTTP 503)."""


class _Mailbox:
    """One request's outputs on the asyncio side, holding only the newest undelivered one.

    A ``RequestOutput`` is cumulative (all tokens and text so far), so a reader that falls
    behind needs only the latest: a slow or stalled streaming client costs O(output) memory,
    not a copy of the output per token (an unbounded queue grew quadratically). An error is
    final and comes after the output still undelivered when it arrived, so a reader that fell
    behind still gets the tokens made before the failure (and a stream that had made some
    fails mid-stream, not as if it had never started).
    """

    def __init__(self):
        self._item = None
        self._error: Exception | None = None
        self._ready = asyncio.Event()

    def put(self, item) -> None:  # runs on the event loop (call_soon_threadsafe)
        if self._error is not None:
            return  # an error is final
        if isinstance(item, Exception):
            self._error = item
        else:
            self._item = item
        self._ready.set()

    async def get(self):
        await self._ready.wait()
        item, self._item = self._item, None
        if item is None:
            return self._error  # stays set: every later get() gets it too
        if self._error is None:
            self._ready.clear()
        return item


def _workflow_id(hints: AgentHints | dict | None) -> str | None:
    """The workflow a request names, from parsed hints or the raw ``kvshare_hints`` dict."""
    name = hints.get("workflow_id") if isinstance(hints, dict) else getattr(hints, "workflow_id", None)
    return None if name is None else str(name)


class AsyncEngine:
    def __init__(self, engine: LLMEngine | Colocation, max_waiting: int = 256):
        """Drive one engine or several co-located ones; ``max_waiting`` bounds the requests
        queued for each of them (a burst to one model does not refuse another's requests, as
        with a server per model). ``self.engine`` is the engine when there is one (what
        :meth:`call` hands its work), else the Colocation."""
        self.colocation = Colocation.of(engine)
        engines = list(self.colocation.engines.values())
        self.engine = engines[0] if len(engines) == 1 else self.colocation
        self.max_waiting = max_waiting
        self._commands: queue.Queue = queue.Queue()
        self._queued: collections.Counter = collections.Counter()  # add commands not yet applied, by base
        self._queued_lock = threading.Lock()  # the engine thread takes them off
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, _Mailbox]] = {}
        self._ids = itertools.count()
        self._stop = threading.Event()
        self._failed_steps = 0  # steps in a row that failed as a whole
        self._next_probe = 0.0  # monotonic time before which no health probe runs
        self._stalled = False  # the last step ran nothing though requests wait
        # the thread that built the engine keeps torch's OpenMP workers; beside the engine
        # thread's own they would slow every step (see .openmp)
        release_openmp_workers()
        self._thread = threading.Thread(target=self._run, name="kvshare-engine", daemon=True)
        self._thread.start()

    # engine thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    self._cycle()
                except Exception:  # the thread must outlive any bug: log it and keep serving
                    logger.exception("engine thread: unexpected failure; continuing")
        finally:  # shutdown, or a thread killed by what it could not catch: nobody waits forever
            gone = RuntimeError("the server is shutting down")
            for request_id in list(self._streams):
                self._deliver(request_id, gone)
            self._streams.clear()
            self._refuse_queued(gone)

    def _refuse_queued(self, error: Exception) -> None:
        """Answer the commands nobody will apply: each queued request's stream and each call
        gets ``error``."""
        while True:
            try:
                kind, request_id, *rest = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                if kind == "add":
                    self._dequeued(rest[0])
                    loop, stream = rest[-2:]
                    loop.call_soon_threadsafe(stream.put, error)
                elif kind == "call":
                    _, loop, future = rest
                    loop.call_soon_threadsafe(lambda f=future: f.done() or f.set_exception(error))
            except RuntimeError:  # the caller's event loop is gone: nobody to tell
                pass

    def alive(self) -> bool:
        """Whether the engine thread is running."""
        return self._thread.is_alive()

    def health(self) -> str | None:
        """Why this engine should get no more requests (``/health`` answers 503, Ray replaces the
        replica), or None: its thread died, or its last ``UNHEALTHY_AFTER`` steps all failed."""
        if not self.alive():
            return "the engine thread is not running"
        if self._failed_steps >= UNHEALTHY_AFTER:
            return f"the last {self._failed_steps} engine steps failed (see the server log)"
        return None

    def _cycle(self) -> None:
        """Take the queued commands, then run one engine step if there is work. When the last
        step ran nothing while requests wait (workflow admission holds every one of them; or
        they wait on blocks nobody frees), wait for a command as when idle, not spin."""
        idle = not self.colocation.has_unfinished() or self._stalled
        try:
            command = self._commands.get(timeout=0.05) if idle else self._commands.get_nowait()
        except queue.Empty:
            command = None
        while command is not None:
            try:
                self._apply(command)
            except Exception as err:  # a failed add fails that request only
                logger.exception("engine thread: command failed")
                self._deliver(command[1], RuntimeError(f"engine failure: {err}"))
                self._streams.pop(command[1], None)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                command = None
        if self._failed_steps >= UNHEALTHY_AFTER and not self.colocation.has_unfinished():
            self._probe()
        if self.colocation.has_unfinished():
            try:
                outputs = self.colocation.step()
            except Exception as err:  # not one request's fault (the engine isolates those): fail all
                self._failed_steps += 1
                self._next_probe = time.monotonic() + PROBE_EVERY_S
                logger.exception("engine step failed; aborting the requests in flight")
                for request_id in list(self._streams):
                    self.colocation.abort(request_id)
                    self._deliver(request_id, RuntimeError(f"engine failure: {err}"))
                self._streams.clear()
                return
            # the engine fails requests one by one (a failing batch is split until each fails
            # alone), so a step is not raising when every step fails: a step whose outputs are all
            # failures counts as failed, one that served anything as healthy
            self._stalled = not outputs and not self.colocation.num_running()
            if outputs:
                failed = all(out.finish_reason == "error" for out in outputs)
                self._failed_steps = self._failed_steps + 1 if failed else 0
                if failed:
                    self._next_probe = time.monotonic() + PROBE_EVERY_S
            for out in outputs:
                failed = out.finish_reason == "error"  # the engine failed this request alone
                self._deliver(out.request_id, RuntimeError("engine failure while running this request "
                                                           "(see the server log)") if failed else out)
                if out.finished:
                    self._streams.pop(out.request_id, None)

    def _probe(self) -> None:
        """An idle engine whose last steps all failed checks itself, ``PROBE_EVERY_S`` after the
        last failure: a one-token request on each model, through the same steps requests take.
        If every probe finishes, the failures were the requests' own (one bad request retried
        by its client, on a replica serving nothing else, fails every step it is in) and the
        engine is healthy again; else it stays unhealthy (Ray replaces it) and probes again
        after ``PROBE_EVERY_S``. Probes count in the engine's request counters like any request."""
        now = time.monotonic()
        if now < self._next_probe:
            return
        self._next_probe = now + PROBE_EVERY_S
        params = SamplingParams(max_tokens=1, ignore_eos=True)
        ids: set[str] = set()
        finished: set[str] = set()
        try:
            for base in self.colocation.engines:
                ids.add(self.colocation.add_request(base, [0], params,
                                                    request_id=f"kvshare-health-probe-{next(self._ids)}"))
            for _ in range(PROBE_MAX_STEPS):
                for out in self.colocation.step():
                    if out.request_id in ids and out.finished:
                        if out.finish_reason == "error":
                            raise RuntimeError(f"health probe {out.request_id} failed")
                        finished.add(out.request_id)
                if finished == ids:
                    break
        except Exception:
            logger.exception("engine health probe failed; the engine stays unhealthy")
        for request_id in ids - finished:  # failed, or too slow to tell: no verdict either way
            self.colocation.abort(request_id)
        if ids and finished == ids:
            logger.warning("engine health probe passed after %d failed steps; healthy again", self._failed_steps)
            self._failed_steps = 0

    def _apply(self, command: tuple) -> None:
        kind, request_id, *rest = command
        if kind == "call":
            self._answer(*rest)
            return
        if kind == "abort":
            self.colocation.abort(request_id)
            self._streams.pop(request_id, None)
            return
        model, prompt, params, adapter, hints, loop, stream = rest
        self._dequeued(model)
        self._streams[request_id] = (loop, stream)
        try:
            self.colocation.add_request(model, prompt, params, adapter=adapter, request_id=request_id, hints=hints)
        except KvshareError as err:
            self._deliver(request_id, err)
            self._streams.pop(request_id, None)

    def _answer(self, work, loop: asyncio.AbstractEventLoop, future: asyncio.Future) -> None:
        """Run ``work(engine)`` here, between steps, and hand its result or error to ``future``."""
        try:
            result, error = work(self.engine), None
        except Exception as err:  # the caller's to report (e.g. a refused adapter)
            result, error = None, err

        def settle():
            if not future.done():  # the caller may have given up
                future.set_result(result) if error is None else future.set_exception(error)

        try:
            loop.call_soon_threadsafe(settle)
        except RuntimeError:  # the caller's event loop is gone
            pass

    def _deliver(self, request_id: str, item) -> None:
        target = self._streams.get(request_id)
        if target is not None:
            loop, stream = target
            try:
                loop.call_soon_threadsafe(stream.put, item)
            except RuntimeError:  # the client's event loop is gone: nobody to tell, nobody to generate for
                self._streams.pop(request_id, None)
                self.colocation.abort(request_id)

    # asyncio side ----------------------------------------------------------------------------
    def _base(self, model: str | None) -> str:
        """The served base name a request's ``model`` (None: the first) queues on."""
        return next(iter(self.colocation.engines)) if model is None else model

    def _dequeued(self, model: str | None) -> None:
        with self._queued_lock:
            self._queued[self._base(model)] -= 1

    def has_room(self, n: int = 1, workflow_id: str | None = None, model: str | None = None) -> bool:
        """Whether ``n`` more requests fit in base ``model``'s waiting queue now (its waiting
        requests and those queued for it, not other models'). A call of a workflow that
        workflow admission has let in does not count the new workflows' calls held back: they
        must not crowd out the running workflows they wait behind (so the queue may hold up to
        twice ``max_waiting``, half of it held)."""
        base = self._base(model)
        engine = self.colocation.engines.get(base)
        if engine is None:  # an unknown name: the engine thread refuses it with a clear error
            return True
        waiting = engine.num_waiting()
        if workflow_id is not None and engine.workflow_running(workflow_id):
            waiting -= engine.num_held()
        with self._queued_lock:
            queued = self._queued[base]
        return waiting + queued + n <= self.max_waiting

    async def generate(self, prompt: list[int], params: SamplingParams, adapter: str | None = None,
                       hints: dict | None = None, model: str | None = None) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs as tokens arrive; abort it if the consumer goes away.
        ``model`` is the served base name (None: the only engine)."""
        if not self.alive() or self._stop.is_set():
            raise RuntimeError("the engine thread is not running")
        if not self.has_room(workflow_id=_workflow_id(hints), model=model):
            raise Overloaded(f"{self.max_waiting} requests are already waiting")
        request_id = f"cmpl-{next(self._ids)}"
        stream = _Mailbox()
        with self._queued_lock:
            self._queued[self._base(model)] += 1
        self._commands.put(("add", request_id, model, prompt, params, adapter, hints, asyncio.get_running_loop(),
                            stream))
        finished = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, Exception):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:  # client disconnected or stopped reading: free its blocks
                self._commands.put(("abort", request_id))

    async def call(self, work):
        """Run ``work(engine)`` on the engine thread between steps (e.g. loading an adapter,
        which must not race a step) and return its result or raise its error."""
        if not self.alive() or self._stop.is_set():
            raise RuntimeError("the engine thread is not running")
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._commands.put(("call", None, work, loop, future))
        return await future

    def shutdown(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
