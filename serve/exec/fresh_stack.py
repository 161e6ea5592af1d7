"""Call a function at the start of a fresh CPython data-stack chunk.

Why our own code: CPython (3.11 and later) keeps Python frames on data-stack chunks of 16 KB. A
frame that does not fit the current chunk gets a new one, mapped for it and unmapped as soon as
that frame returns. Inductor's generated ``call()`` is one frame with a slot per buffer (about
9.5 KB for SmolLM2's graph with adapters), and the step's attention op pushes a dozen small
Python frames on top of it, 30 times a step. Where ``call()`` happens to end near its chunk's
end, every op call maps and unmaps a chunk: page faults, and TLB shootdowns that stall the
OpenMP workers. That was measured on the batch-1 ICaRus pair step: 1.39x a base step, against
1.15x with the graph called from a fresh chunk (``results/engine-cpu-bf16/session17``). Whether
it happens depends on how deep the caller's stack is, so no fixed layout avoids it.

:func:`call_in_fresh_chunk` calls through a frame of :data:`SPACER_SLOTS` slots (25 KB). That
frame never fits a 16 KB chunk, and CPython gives a frame that needs a new chunk at least 1,000
slots of room beyond it, rounded up to a power of two: a 64 KB chunk with about 39 KB free above
the spacer. The callee's frames (Dynamo's and AOTAutograd's wrappers, ``call()`` and the op's
frames: about 15 KB for SmolLM2) then share that one chunk, so a step maps one chunk instead of
one per op call. The spacer's slots are never assigned (the branch that names them never runs).
If the caller's chunk is itself that large and has room (a caller deep in another large
frame), the spacer fits there and the layout is as without it: no harm, no gain.
"""

from __future__ import annotations

from typing import Any, Callable

SPACER_SLOTS = 3200


def frame_with_slots(slots: int) -> Callable[..., Any]:
    """A function ``f(fn, *args) -> fn(*args)`` whose frame has at least ``slots`` local slots.

    The source is generated (names only, nothing from outside), since a frame's size is fixed by
    its code: the locals are declared in a branch that never runs."""
    names = " = ".join(f"_{i}" for i in range(slots)) or "_"
    namespace: dict[str, Any] = {}
    exec(f"def spaced(fn, *args):\n    if fn is None:\n        {names} = None\n    return fn(*args)\n", namespace)
    spaced = namespace["spaced"]
    if spaced.__code__.co_nlocals < slots:  # a compiler that dropped the dead branch's names
        raise RuntimeError(f"kvshare: a frame of {slots} slots has {spaced.__code__.co_nlocals}")
    return spaced


call_in_fresh_chunk: Callable[..., Any] = frame_with_slots(SPACER_SLOTS)
call_in_fresh_chunk.__doc__ = "``fn(*args)``, called from the start of a fresh CPython data-stack chunk."
