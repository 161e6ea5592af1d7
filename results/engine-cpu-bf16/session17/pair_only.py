"""Run batch-1 base steps or ICaRus pair steps for 12 s, for ``perf stat`` / ``perf record -p``.

    python results/engine-cpu-bf16/session17/pair_only.py base|pair &
    # once /tmp/kvshare-pair-ready exists: perf stat -e context-switches,page-faults -p PID -- sleep 8
"""
import sys, tempfile, time
from pathlib import Path
import torch
from kvshare.random_adapters import random_adapter
from kvshare.serve import LLM, SamplingParams
model = Path.home() / ".cache/kvshare/models/smollm2-135m-instruct"
llm = LLM(model, [], dtype="bfloat16", compile="on")
prompt = torch.randint(100, 40000, (256,), generator=torch.Generator().manual_seed(0)).tolist()
with tempfile.TemporaryDirectory() as tmp:
    name = llm.engine.load_adapter(random_adapter("icarus", model, tmp, "icarus-step", seed=0))
llm.engine.warm_up((1, 2)); llm.engine.warm_up((1, 2,), adapters=True)
engine = llm.engine
adapter = name if sys.argv[1] == "pair" else None
engine.add_request(prompt, SamplingParams(max_tokens=3, ignore_eos=True), adapter=adapter)
while engine.has_unfinished(): engine.step()
open("/tmp/kvshare-pair-ready", "w").write("1")
t = time.time()
n = 0
while time.time() - t < 12:
    engine.add_request(prompt, SamplingParams(max_tokens=60, ignore_eos=True), adapter=adapter)
    while engine.has_unfinished(): engine.step(); n += 1
print("steps", n)
