"""The batch-1 ICaRus pair step against a base step, for the four ways of calling the graph
with adapters, in one process, five alternating rounds (medians of 24 steps each, as
``kvshare bench engine`` takes them):

- ``python``: Inductor's Python wrapper, called as it was before session 18;
- ``python+fresh``: the same, called from a fresh data-stack chunk (``serve/exec/fresh_stack.py``);
- ``cpp``: Inductor's C++ wrapper;
- ``cpp+fresh``: the C++ wrapper from a fresh chunk (what the engine does since session 18).

    python results/engine-cpu-bf16/session18/wrapper_ratio.py

Whether ``python`` pays for a chunk per op call depends on how deep the caller's stack is, so
its figure depends on this script's layout (session 17's ``spacer_ratio.py 1`` hit it: 1.39x).
"""

import tempfile
from pathlib import Path

import torch

import kvshare.serve.exec.compiled as compiled
from kvshare.eval.perf.engine import _engine_step_time
from kvshare.random_adapters import random_adapter
from kvshare.serve import LLM

MODEL = Path.home() / ".cache/kvshare/models/smollm2-135m-instruct"
PROMPT = torch.randint(100, 40000, (256,), generator=torch.Generator().manual_seed(0)).tolist()
FRESH, PLAIN = compiled.call_in_fresh_chunk, (lambda fn, *args: fn(*args))


def engine(cpp_wrapper: bool) -> tuple[LLM, str]:
    compiled.GRAPH_OPTIONS[True] = {**compiled.GRAPH_OPTIONS[True], "cpp_wrapper": cpp_wrapper}
    llm = LLM(MODEL, [], dtype="bfloat16", compile="on")
    llm.engine.warm_up((1,))
    with tempfile.TemporaryDirectory() as tmp:
        name = llm.engine.load_adapter(random_adapter("icarus", MODEL, tmp, "icarus-step", seed=0))
    llm.engine.warm_up((2,), adapters=True)
    _engine_step_time(llm, PROMPT, name)
    return llm, name


if __name__ == "__main__":
    engines = {"python": engine(False), "cpp": engine(True)}
    ratios: dict[str, list[float]] = {}
    for _ in range(5):
        for wrapper, (llm, name) in engines.items():
            for fresh in (False, True):
                compiled.call_in_fresh_chunk = FRESH if fresh else PLAIN
                label = wrapper + ("+fresh" if fresh else "")
                base, pair = _engine_step_time(llm, PROMPT, None), _engine_step_time(llm, PROMPT, name)
                ratios.setdefault(label, []).append(pair / base)
                print(f"{label:13s} base {base * 1e3:.2f} ms  pair {pair * 1e3:.2f} ms  ratio {pair / base:.2f}",
                      flush=True)
    for label, values in ratios.items():
        print(f"{label:13s} median ratio {sorted(values)[2]:.2f}")
