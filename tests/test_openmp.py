"""Ending a thread's OpenMP workers, so that the engine thread's team is the process's only one."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest

from kvshare.serve import LLMEngine
from kvshare.serve.driver import engine_thread as async_engine
from kvshare.serve.driver.engine_thread import AsyncEngine

from test_engine import base  # noqa: F401

# the OS threads of a process that ran a parallel region on 2 threads, then released its workers
PROBE = r"""
import os, time, torch
from kvshare.serve.exec.openmp import release_openmp_workers
torch.set_num_threads(2)
x = torch.ones(1 << 22)
assert x.sum().item() == 1 << 22  # a parallel region: the main thread's team starts
tasks = lambda: len(os.listdir("/proc/self/task"))
before = tasks()
released = release_openmp_workers()
deadline = time.monotonic() + 5
while tasks() >= before and time.monotonic() < deadline:
    time.sleep(0.01)  # a released worker exits just after the barrier the pause waits on
after = tasks()
assert (x * 2).sum().item() == 2 << 22  # the team starts again where the thread computes again
print(before, after, released, tasks())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="torch's libgomp and /proc/self/task are Linux's")
def test_releasing_ends_the_calling_threads_openmp_worker():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    before, after, released, again = out.stdout.split()
    assert released == "True"
    assert int(after) == int(before) - 1  # 2 threads: the main thread and one worker
    assert int(again) == int(before)


def test_the_async_engine_releases_the_workers_before_its_thread_starts(base, monkeypatch):
    calls = []
    monkeypatch.setattr(async_engine, "release_openmp_workers",
                        lambda: calls.append([t.name for t in threading.enumerate()]))
    runner = AsyncEngine(LLMEngine(base, kv_cache_tokens=1024, block_size=8))
    try:
        assert len(calls) == 1 and "kvshare-engine" not in calls[0]
        assert runner.alive()
    finally:
        runner.shutdown()
