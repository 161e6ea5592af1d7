"""Calling from a fresh CPython data-stack chunk (serve/exec/fresh_stack.py): a hot loop of small
calls under a large frame maps no chunk per call, wherever the caller's stack ends."""

import json
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from kvshare.serve.exec.fresh_stack import call_in_fresh_chunk, frame_with_slots

pytestmark = pytest.mark.skipif(sys.platform != "linux" or sys.implementation.name != "cpython"
                                or sys.version_info < (3, 11), reason="CPython's data-stack chunks, on Linux")

CALLS = 200


def _chain(depth: int = 12) -> int:
    """A dozen small frames, as the step's attention op pushes from inside the graph's ``call()``."""
    return _chain(depth - 1) if depth else 0


def _hot_loop() -> None:
    for _ in range(CALLS):
        _chain()


def _page_faults(spacer: bool) -> list[int]:
    """Minor page faults of the hot loop under a frame of 1,200 slots (as Inductor's ``call()``),
    for callers whose stacks end at every 8 slots of a chunk's length."""
    big = frame_with_slots(1200)
    faults = []
    for padding in range(0, 2048, 8):
        caller = frame_with_slots(padding)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        if spacer:
            caller(call_in_fresh_chunk, big, _hot_loop)
        else:
            caller(big, _hot_loop)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return faults


def test_a_large_frame_called_from_a_fresh_chunk_maps_no_chunk_per_call():
    # in a fresh interpreter: its data stack starts in a 16 KB chunk, which a caller's padding of
    # 0-2048 slots spans (a pytest -n worker's stack may sit in a larger chunk, never reaching its end)
    probe = "import json, test_fresh_stack as t; print(json.dumps([t._page_faults(False), t._page_faults(True)]))"
    out = subprocess.run([sys.executable, "-c", probe], cwd=Path(__file__).parent, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    plain, spaced = json.loads(out.stdout)
    if max(plain) < CALLS:
        pytest.skip("this Python maps no data-stack chunk per call under a chunk's end")
    # the hazard: some stack depths fault on every call (a chunk mapped and unmapped each time)
    assert max(spaced) < CALLS // 4, spaced


def test_the_spacer_passes_arguments_through_and_never_fits_a_16_kb_chunk():
    assert call_in_fresh_chunk(lambda a, b: (a, b), 1, "x") == (1, "x")
    # the spacer must not fit a 16 KB chunk (8-byte slots), or it would not always start a new one
    assert call_in_fresh_chunk.__code__.co_nlocals * 8 > 16 * 1024
