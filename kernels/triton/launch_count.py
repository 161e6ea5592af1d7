"""Count the kernels a CUDA graph of some code would record, on any machine.

Why: a graph replays its kernels with no host cost, but each still costs the GPU a few
microseconds, so for a small model a graphed step's time follows its kernel count (on the
H100 a SmolLM2 step was about 4 ms of GPU work over about 1,100 kernels: ``results/engine-gpu``). CI has no GPU, so the count is what a
test can hold the graph step to. Counted: torch ops that launch a kernel on a GPU (views and
allocations left out) and Triton launches; inside a launch nothing more is counted (Triton's
interpreter moves tensors with torch ops of its own).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

from torch.utils._python_dispatch import TorchDispatchMode
from triton.runtime.jit import KernelInterface

NO_KERNEL = frozenset({
    "view", "_unsafe_view", "reshape", "_reshape_alias", "split", "split_with_sizes", "slice", "select", "expand",
    "t", "transpose", "unsqueeze", "squeeze", "permute", "as_strided", "alias", "detach", "lift_fresh", "unbind",
    "narrow", "empty", "empty_like", "new_empty", "empty_strided", "set_",
})


class _Counting(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts: Counter[str] = Counter()
        self.inside_launch = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not self.inside_launch and name not in NO_KERNEL:
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


@contextmanager
def count_launches() -> Iterator[Counter[str]]:
    """``with count_launches() as counts:`` the kernels the block launches, by op name
    (``triton:<kernel>`` for Triton's); ``sum(counts.values())`` is the total."""
    counting = _Counting()
    original = KernelInterface.__getitem__

    def launcher(kernel, grid):
        run = original(kernel, grid)
        name = getattr(getattr(kernel, "fn", None), "__name__", "kernel")

        def counted(*args, **kwargs):
            counting.counts[f"triton:{name}"] += 1
            counting.inside_launch += 1
            try:
                return run(*args, **kwargs)
            finally:
                counting.inside_launch -= 1
        return counted

    KernelInterface.__getitem__ = launcher
    try:
        with counting:
            yield counting.counts
    finally:
        KernelInterface.__getitem__ = original
