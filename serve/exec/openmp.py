"""End the calling thread's OpenMP workers before another thread takes over the compute.

libgomp (torch's OpenMP on Linux) lets an idle worker spin briefly before it sleeps only
while the process manages no more OpenMP threads than it has CPUs; past that, workers sleep
at once and every parallel region pays a futex wake-up. The thread that loads and compiles
the model keeps its team of workers (torch's intra-op threads). When the engine then steps
on its own thread (:class:`~..driver.engine_thread.AsyncEngine`, what the server runs), that thread
gets a second team, and torch's many small parallel regions run 2-4x slower. Measured on a
2-vCPU VM (torch 2.13): a compiled decode step of 8 ICaRus pairs took 81-90 ms on the engine
thread against 49 ms on the main thread; with the creating thread's workers ended first,
51 ms (``results/engine-thread/``).

OpenMP 5's ``omp_pause_resource_all`` ends them (they start again if that thread computes
in parallel later). Neither Python nor torch binds it, hence ctypes.
"""

from __future__ import annotations

import ctypes
import functools
import re
from pathlib import Path

OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: release threads, keep the runtime's settings


@functools.cache
def _openmp_runtime() -> ctypes.CDLL | None:
    """The OpenMP library this process loaded (libgomp, libomp or libiomp5), or None."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:  # not Linux: nothing to release
        return None
    # a line's sixth field is the file, which may hold spaces (a venv in "/tmp/kv ci")
    files = (line.split(maxsplit=5)[5] for line in maps.splitlines() if len(line.split(maxsplit=5)) == 6)
    for path in dict.fromkeys(f for f in files if re.search(r"/lib(?:gomp|omp|iomp5)[^/]*\.so[^/]*$", f)):
        try:
            lib = ctypes.CDLL(path)  # already loaded: this only opens a handle
        except OSError:
            continue
        if hasattr(lib, "omp_pause_resource_all"):
            lib.omp_pause_resource_all.argtypes = [ctypes.c_int]
            return lib
    return None


def release_openmp_workers() -> bool:
    """End the OpenMP workers of the calling thread's team. True if the runtime did."""
    lib = _openmp_runtime()
    return lib is not None and lib.omp_pause_resource_all(OMP_PAUSE_SOFT) == 0
