"""The compiled CPU step's graphs, lowered on a worker thread so that no step waits for one.

Lowering one bucket's graph takes about a minute on 2 cores, and a server used to compile every
bucket before its first request (minutes), an evaluation of three prompts each bucket it met.
With ``--compile auto`` a step whose bucket has no graph yet runs the eager forward, which
gives the same tokens, while this worker lowers the graphs the workload has used, one at a
time, in the order first asked for; a graph is used from the first step after it is ready.
A short job ends without waiting: the worker is a daemon, and a graph it had not finished is
simply not used (Inductor writes its on-disk cache atomically). At exit the build in progress is
abandoned first (:func:`_abandon_at_exit`): a daemon thread still inside a torch op when the
interpreter finalises is killed in C++ code, and the process aborts ("terminate called without
an active exception", exit status 134) after its work is done.

One worker for the whole process: compiles serialise anyway (Dynamo's compile lock, and the
process-wide guard stance a compile must hold, :mod:`.compiled`), and two C++ compilers at once
would take the cores from the steps. The worker runs at a lower CPU priority, so the eager
steps beside it keep most of the cores. Dynamo lowers a frame on the thread that calls it,
with that thread's configuration, so the worker sets its own (:data:`.compiled.RECOMPILE_LIMITS`).
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import os
import queue
import sys
import threading
import time
from typing import Callable

log = logging.getLogger(__name__)

NICENESS = 10  # the worker's (and its compiler's) CPU priority below the steps'
EXIT_WAIT_S = 120.0  # at most this long at exit for the build in progress to unwind


class Abandoned(BaseException):
    """Raised inside the worker at exit: a BaseException, so that no ``except Exception`` in
    Inductor's code takes it for a failed candidate and goes on compiling."""


class CompileWorker:
    """A queue of graph builds, each a callable, run one at a time on a daemon thread."""

    def __init__(self) -> None:
        self._jobs: queue.Queue[tuple[str, Callable[[], None]]] = queue.Queue()
        self._pending: set[str] = set()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self._building = False
        self._closing = False
        self.done: list[tuple[str, float]] = []  # (job, seconds) lowered so far, for reports and tests
        self.failed: list[tuple[str, str]] = []

    def submit(self, name: str, build: Callable[[], None]) -> bool:
        """Queue ``build`` under ``name`` unless a job of that name is pending or the worker is
        closing; True if queued."""
        with self._lock:
            if name in self._pending or self._closing:
                return False
            self._pending.add(name)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="kvshare-compile", daemon=True)
                self._thread.start()
        self._jobs.put((name, build))
        return True

    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until every queued build has run (True), or ``timeout`` seconds passed (False)."""
        with self._idle:
            return self._idle.wait_for(lambda: not self._pending, timeout)

    def _loop(self) -> None:
        try:  # Linux takes a thread's id here: the compiler processes it starts inherit the priority
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICENESS)
        except (AttributeError, OSError):
            pass
        try:
            while self._run_next():
                pass
        except Abandoned:  # the process is exiting
            return

    def _run_next(self) -> bool:
        """Run the next queued build; False once the worker is closing."""
        name, build = self._jobs.get()
        start = time.perf_counter()
        try:
            with self._lock:
                if self._closing:
                    return False
                self._building = True
            build()
            self.done.append((name, time.perf_counter() - start))
        except Exception as err:  # the build logs and gives up its graphs; the steps stay eager
            self.failed.append((name, f"{type(err).__name__}: {err}"))
        finally:
            with self._idle:
                self._building = False
                self._pending.discard(name)
                self._idle.notify_all()
        return True

    def abandon(self, timeout: float = EXIT_WAIT_S) -> bool:
        """Stop taking jobs and end the build in progress at its next line of Python (an
        :class:`Abandoned` raised in the worker, again until it ends); True once no build runs.
        An idle worker, blocked on its queue, holds no C++ frame and is left as it is."""
        with self._lock:
            self._closing = True
            thread = self._thread if self._building else None
        if thread is None or thread.ident is None:
            return True
        deadline, hook = time.monotonic() + timeout, sys.unraisablehook
        sys.unraisablehook = _quiet_about_abandoned(hook)  # one landing in a weakref callback is only ignored
        try:
            while self._building and thread.is_alive() and time.monotonic() < deadline:
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(Abandoned))
                thread.join(0.5)
        finally:
            sys.unraisablehook = hook
        return not (self._building and thread.is_alive())


def _quiet_about_abandoned(hook: Callable) -> Callable:
    """``hook`` for every unraisable exception but :class:`Abandoned` (printed as "Exception
    ignored in ..." with a traceback where it interrupts a finaliser or callback)."""
    def quiet(unraisable) -> None:
        if not isinstance(unraisable.exc_value, Abandoned):
            hook(unraisable)
    return quiet


_worker: CompileWorker | None = None
_worker_lock = threading.Lock()


def compile_worker() -> CompileWorker:
    """The process's one worker (made on first use)."""
    global _worker
    with _worker_lock:
        if _worker is None:
            _worker = CompileWorker()
            atexit.register(_abandon_at_exit)
        return _worker


def _abandon_at_exit() -> None:
    """Before the interpreter finalises: end the worker's build in progress, so that its thread
    is not killed inside a torch op (which aborts the process)."""
    if _worker is not None and not _worker.abandon():
        log.warning("kvshare: the background compile did not stop within %.0f s of exit", EXIT_WAIT_S)
