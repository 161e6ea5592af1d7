"""The background compile worker at process exit: a build still inside a torch op must not
abort the process (a daemon thread killed in C++ code at finalisation calls std::terminate)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

from kvshare.serve.exec.background_compile import CompileWorker

SPIN_UNTIL_EXIT = """
import time, torch
from kvshare.serve.exec.background_compile import compile_worker
a = torch.randn(512, 512)
started = time.time()
def build():  # stands in for Inductor: mostly inside torch ops, and it swallows Exception
    while time.time() - started < 60:
        try:
            torch.mm(a, a)
        except Exception:
            pass
compile_worker().submit("spin", build)
time.sleep(1.0)
print("done", flush=True)
"""


def test_a_job_exiting_while_its_build_runs_inside_torch_exits_cleanly(tmp_path):
    script = tmp_path / "exit_while_building.py"
    script.write_text(SPIN_UNTIL_EXIT)
    start = time.monotonic()
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]  # -6 (SIGABRT) without the exit handler
    assert done.stdout.strip() == "done"
    assert "terminate called" not in done.stderr and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert time.monotonic() - start < 50  # the build was ended, not waited for


def test_abandon_ends_the_build_in_progress_and_refuses_new_ones():
    worker, running = CompileWorker(), threading.Event()

    def build():
        running.set()
        while True:  # only an exception out of the worker's own handler ends it
            try:
                time.sleep(0.01)
            except Exception:
                pass

    assert worker.submit("spin", build)
    assert running.wait(10)
    assert worker.abandon(timeout=10)
    assert not worker._thread.is_alive() and worker.pending() == 0
    assert not worker.submit("late", lambda: None)


def test_abandon_leaves_an_idle_worker_at_once():
    worker = CompileWorker()
    assert worker.submit("quick", lambda: None)
    assert worker.wait_idle(10)
    start = time.monotonic()
    assert worker.abandon(timeout=10)
    assert time.monotonic() - start < 1


def test_an_abandon_landing_in_a_weakref_callback_is_not_printed(monkeypatch):
    """The exception can land inside a finaliser or weakref callback, where Python prints it as
    "Exception ignored in ..." and carries on: abandon() keeps that quiet and raises it again."""
    import weakref

    worker, running = CompileWorker(), threading.Event()

    class Thing:
        pass

    def spin(seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            pass

    def build():
        thing = Thing()
        keep = weakref.ref(thing, lambda _: spin(2.0))  # noqa: F841
        running.set()
        del thing  # the callback runs here, on this thread, and the first exceptions land in it
        spin(60.0)

    reported = []
    monkeypatch.setattr(sys, "unraisablehook", lambda unraisable: reported.append(unraisable.exc_type))
    assert worker.submit("callbacks", build)
    assert running.wait(10)
    assert worker.abandon(timeout=20)
    assert reported == []
    assert worker.pending() == 0
