"""A decode step (batch 1, bfloat16, compiled) with Dynamo's full guards against one with only its
differentiating guards, four alternations in one process.

``python results/engine-cpu-bf16/session23/guards.py``

Run before the compiled step skipped guards itself (commit 4b89da3): it patches the graph call.
At a later commit both columns skip them.
"""
import time
from pathlib import Path

import torch

from kvshare.eval.perf.engine import _engine_step_time
from kvshare.serve import LLM
import kvshare.serve.exec.compiled as C

model = Path.home() / ".cache/kvshare/models/smollm2-135m-instruct"
llm = LLM(model, [], dtype="bfloat16", compile="on")
prompt = torch.randint(100, 40000, (256,), generator=torch.Generator().manual_seed(0)).tolist()
llm.engine.warm_up((1,))
orig = C.call_in_fresh_chunk
def skipping(*a, **k):
    with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
        return orig(*a, **k)
_engine_step_time(llm, prompt, None)
for _ in range(4):
    C.call_in_fresh_chunk = orig
    a = _engine_step_time(llm, prompt, None)
    C.call_in_fresh_chunk = skipping
    b = _engine_step_time(llm, prompt, None)
    print(f"guards {a*1e3:.2f} ms  skipped {b*1e3:.2f} ms  ratio {b/a:.3f}", flush=True)
