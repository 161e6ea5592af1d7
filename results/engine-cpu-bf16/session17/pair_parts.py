"""Decompose the batch-1 ICaRus pair step: base 1 row, base 2 sequences (bucket 2, no adapters),
the pair (bucket 2 with adapters), 2 pairs; then the time of the attention op in each, from the
profiler.

    python results/engine-cpu-bf16/session17/pair_parts.py
"""
import sys, tempfile, time
from pathlib import Path
import torch
from torch.profiler import profile, ProfilerActivity
from kvshare.eval.perf.engine import _engine_step_time
from kvshare.random_adapters import random_adapter
from kvshare.serve import LLM, SamplingParams

model = Path.home() / ".cache/kvshare/models/smollm2-135m-instruct"
llm = LLM(model, [], dtype="bfloat16", compile="on")
prompt = torch.randint(100, 40000, (256,), generator=torch.Generator().manual_seed(0)).tolist()
prompt2 = torch.randint(100, 40000, (256,), generator=torch.Generator().manual_seed(1)).tolist()
with tempfile.TemporaryDirectory() as tmp:
    name = llm.engine.load_adapter(random_adapter("icarus", model, tmp, "icarus-step", seed=0))
llm.engine.warm_up((1, 2))
llm.engine.warm_up((2,), adapters=True)
engine = llm.engine

def steps(reqs, n=40, prof=False):
    for p, a in reqs:
        engine.add_request(p, SamplingParams(max_tokens=n + 2, ignore_eos=True), adapter=a)
    engine.step()
    times = []
    attn = []
    while engine.has_unfinished():
        if prof:
            with profile(activities=[ProfilerActivity.CPU]) as pr:
                s = time.perf_counter(); engine.step(); times.append(time.perf_counter() - s)
            attn.append(sum(e.cpu_time_total for e in pr.key_averages() if e.key == "kvshare::step_attention") / 1e3)
        else:
            s = time.perf_counter(); engine.step(); times.append(time.perf_counter() - s)
    times.sort()
    return times[len(times) // 2] * 1e3, (sorted(attn)[len(attn) // 2] if attn else None)

cases = {"base 1 row": [(prompt, None)], "base 2 seqs": [(prompt, None), (prompt2, None)],
         "pair": [(prompt, name)], "2 pairs": [(prompt, name), (prompt2, name)]}
for rnd in range(3):
    out = {k: steps(v)[0] for k, v in cases.items()}
    print(" ".join(f"{k}: {t:.2f} ms" for k, t in out.items()), flush=True)
for k, v in cases.items():
    t, a = steps(v, 12, prof=True)
    print(f"profiled {k}: step {t:.2f} ms, step_attention {a:.2f} ms")
