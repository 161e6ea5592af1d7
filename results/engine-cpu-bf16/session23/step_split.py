"""Where a batch-1 ICaRus pair step's time goes beside a base step, without a profiler.

``python results/engine-cpu-bf16/session23/step_split.py``

Builds the engine as ``session15/pair_ratio.py icarus`` does, then alternates a base and a pair
measure five times; each prints the engine step, the compiled step's ``forward`` (graph + head on
the sampled rows) and its ``_run`` (the graph alone), medians of 24 steps in milliseconds.
"""
import tempfile
import time
from pathlib import Path
import torch
from kvshare.eval.perf.engine import _engine_step_time
from kvshare.random_adapters import random_adapter
from kvshare.serve import LLM

model = Path.home() / ".cache/kvshare/models/smollm2-135m-instruct"
llm = LLM(model, [], dtype="bfloat16", compile="on")
prompt = torch.randint(100, 40000, (256,), generator=torch.Generator().manual_seed(0)).tolist()
llm.engine.warm_up((1,))
with tempfile.TemporaryDirectory() as tmp:
    name = llm.engine.load_adapter(random_adapter("icarus", model, tmp, "icarus-step", seed=0))
llm.engine.warm_up((2,), adapters=True)
step = llm.engine.runner.compiled
fwd, run = step.forward, step._run
log = {"fwd": [], "run": []}
def f(*a, **k):
    s = time.perf_counter(); r = fwd(*a, **k); log["fwd"].append(time.perf_counter() - s); return r
def g(*a, **k):
    s = time.perf_counter(); r = run(*a, **k); log["run"].append(time.perf_counter() - s); return r
step.forward, step._run = f, g
def measure(adapter):
    for v in log.values(): v.clear()
    total = _engine_step_time(llm, prompt, adapter)
    med = lambda xs: sorted(xs)[len(xs) // 2] * 1e3
    return total * 1e3, med(log["fwd"][1:]), med(log["run"][1:])
measure(name)
for _ in range(5):
    b, p = measure(None), measure(name)
    print("base step %.2f fwd %.2f run %.2f | pair step %.2f fwd %.2f run %.2f | step ratio %.2f"
          % (*b, *p, p[0] / b[0]), flush=True)
