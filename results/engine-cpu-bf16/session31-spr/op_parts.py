"""Where the Python attention op's time went, per layer call, before the C++ op replaced it.

``python results/engine-cpu-bf16/session31-spr/op_parts.py`` (repo root, venv active, alone).
An int4 SmolLM2 engine whose graphs call the Python op (``native_rows`` patched to 0), batch-1
greedy decode of 48 tokens after 16 and 256 prompt tokens; wall time per call of
``StepAttention.__call__`` (the op's body), ``cpu.attend`` inside it and the C++ kernel inside
that. Then the dispatch of an empty ``torch.library.custom_op`` from Python, alone.
"""

import collections
import time

import torch

import kvshare.serve.exec.compiled as compiled
from kvshare.kernels import cpu
from kvshare.kernels import step_attention as sa
from kvshare.serve import LLM, SamplingParams

spent, calls = collections.defaultdict(float), collections.Counter()


def timed(owner, name: str, label: str) -> None:
    inner = getattr(owner, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            spent[label] += time.perf_counter() - start
            calls[label] += 1

    setattr(owner, name, wrapper)


class KernelTimer:
    """The extension with its ``paged_attention`` timed (a pybind module's attribute cannot be set)."""

    def __init__(self, ext):
        self._ext = ext
        self.paged_attention = ext.paged_attention

    def __getattr__(self, name):
        return getattr(self._ext, name)


@torch.library.custom_op("probe::empty", mutates_args=())
def empty(q: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(q)


@empty.register_fake
def _(q):
    return torch.empty_like(q)


if __name__ == "__main__":
    compiled.native_rows = lambda model: 0
    llm = LLM("smollm2-135m-instruct", dtype="bfloat16", kernels="int4,cpu", kv_cache_tokens=4096)
    engine = llm.engine

    def decode(context: int, steps: int) -> None:
        engine.add_request(list(range(100, 100 + context)), SamplingParams(max_tokens=steps + 1, ignore_eos=True))
        engine.step()  # the prompt (eager)
        while engine.has_unfinished():
            engine.step()

    decode(16, 8)  # compile / warm
    kernel = KernelTimer(cpu.extension())
    cpu._built[0] = kernel
    timed(sa.StepAttention, "__call__", "StepAttention.__call__ (the op's body)")
    timed(cpu, "attend", "cpu.attend")
    timed(kernel, "paged_attention", "the C++ kernel")
    for context in (16, 256):
        spent.clear(), calls.clear()
        decode(context, 48)
        for label in spent:
            print(f"ctx {context}: {label}: {spent[label] / calls[label] * 1e6:.1f} us a call ({calls[label]} calls)")
    q = torch.randn(1, 9, 64, dtype=torch.bfloat16)
    for _ in range(1000):
        torch.ops.probe.empty(q)
    start = time.perf_counter()
    for _ in range(10000):
        torch.ops.probe.empty(q)
    print(f"an empty custom_op called from Python: {(time.perf_counter() - start) / 10000 * 1e6:.1f} us a call")
