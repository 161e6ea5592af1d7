"""The ICaRus paired decode step against a base step at batch 1, five alternating times.

``python results/engine-cpu-bf16/session15/pair_ratio.py PARTS [KERNELS] [noamx]``
- PARTS ``all``: the graph with adapters is compiled before the ICaRus adapter is loaded, so
  it adapts every projection. ``icarus``: it is compiled after, for q, o, gate, up and down only.
- KERNELS: ``auto`` (the default: the C++ attention) or ``torch`` (gather + SDPA).
- ``noamx``: the C++ attention's generic path.

It prints each pair of step times (medians of 24 steps, as ``kvshare bench engine`` takes them)
and the median ratio.
"""

import sys
import tempfile
from pathlib import Path

import torch

from kvshare.eval.perf.engine import _engine_step_time
from kvshare.kernels import cpu
from kvshare.random_adapters import random_adapter
from kvshare.serve import LLM

def alternate(llm: LLM, prompt: list[int], name: str) -> float:
    """Time a base step and a pair step five times alternately (after one pair warm-up);
    print each pair of times and return the median ratio."""
    _engine_step_time(llm, prompt, name)
    ratios = []
    for _ in range(5):
        base, pair = _engine_step_time(llm, prompt, None), _engine_step_time(llm, prompt, name)
        ratios.append(pair / base)
        print(f"base {base * 1e3:.2f} ms  pair {pair * 1e3:.2f} ms  ratio {pair / base:.2f}", flush=True)
    return sorted(ratios)[2]


if __name__ == "__main__":
    model = Path.home() / ".cache/kvshare/models/smollm2-135m-instruct"
    parts, kernels = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "auto"
    llm = LLM(model, [], dtype="bfloat16", compile="on", kernels=kernels)
    if "noamx" in sys.argv[3:]:
        cpu.extension().paged_attention_set_amx(False)
    prompt = torch.randint(100, 40000, (256,), generator=torch.Generator().manual_seed(0)).tolist()
    llm.engine.warm_up((1,))
    if parts == "all":
        llm.engine.warm_up((2,), adapters=True)
    with tempfile.TemporaryDirectory() as tmp:
        name = llm.engine.load_adapter(random_adapter("icarus", model, tmp, "icarus-step", seed=0))
    llm.engine.warm_up((2,), adapters=True)
    print("projections adapted:", ", ".join(llm.engine.runner.compiled.lora.parts))
    print(f"{parts} {kernels}: median ratio {alternate(llm, prompt, name):.2f}")
