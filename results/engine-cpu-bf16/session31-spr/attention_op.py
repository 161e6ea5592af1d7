"""The compiled step's attention op per layer: C++ (``kvshare::step_attention_cpu``, the
default) against the Python custom op it replaced, alternating in one process.

``python results/engine-cpu-bf16/session31-spr/attention_op.py [KERNELS]`` (repo root, venv
active, nothing else running). Two engines on SmolLM2 bfloat16 (default ``int4,cpu``): one as
shipped, one whose graphs call the Python op (``native_rows`` patched to 0 before it is built).
Batch-1 greedy decode of 64 tokens after 16, 256 and 1,024 prompt tokens; wall ms per step,
medians of 3 alternations.
"""

import statistics
import sys
import time

import kvshare.serve.exec.compiled as compiled
from kvshare.serve import LLM, SamplingParams


def step_ms(llm: LLM, prompt: list[int], steps: int = 64) -> float:
    engine = llm.engine
    engine.add_request(prompt, SamplingParams(max_tokens=steps + 1, ignore_eos=True))
    engine.step()  # the prompt
    start, n = time.perf_counter(), 0
    while engine.has_unfinished():
        engine.step()
        n += 1
    return (time.perf_counter() - start) / n * 1e3


if __name__ == "__main__":
    kernels = sys.argv[1] if len(sys.argv) > 1 else "int4,cpu"
    settings = dict(dtype="bfloat16", kernels=kernels, kv_cache_tokens=4096)
    native = LLM("smollm2-135m-instruct", **settings)
    shipped = compiled.native_rows
    compiled.native_rows = lambda model: 0
    python_op = LLM("smollm2-135m-instruct", **settings)
    compiled.native_rows = shipped
    assert native.engine.runner.compiled._native > 0 and python_op.engine.runner.compiled._native == 0
    for context in (16, 256, 1024):
        prompt = list(range(100, 100 + context))
        step_ms(native, prompt, 4), step_ms(python_op, prompt, 4)  # compile / warm
        runs = {"C++ op": [], "Python op": []}
        for _ in range(3):
            runs["C++ op"].append(step_ms(native, prompt))
            runs["Python op"].append(step_ms(python_op, prompt))
        cpp, py = (statistics.median(runs[k]) for k in ("C++ op", "Python op"))
        print(f"{kernels} ctx {context}: C++ op {cpp:.2f} ms, Python op {py:.2f} ms per step, ratio {cpp / py:.3f} "
              f"(runs {[f'{x:.2f}' for x in runs['C++ op']]} / {[f'{x:.2f}' for x in runs['Python op']]})", flush=True)
