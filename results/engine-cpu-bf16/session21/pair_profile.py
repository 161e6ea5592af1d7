"""Where the batch-1 ICaRus pair step spends its time beside a base step (torch profiler).

``python results/engine-cpu-bf16/session21/pair_profile.py [STEPS]``

Builds the engine as ``pair_ratio.py icarus`` does (bfloat16, compiled step, the C++ attention),
decodes STEPS tokens once without an adapter and once with an ICaRus adapter, and prints, for each,
the ops that take the most self CPU time per step, then the per-step totals side by side.
"""

import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from kvshare.random_adapters import random_adapter
from kvshare.serve import LLM, SamplingParams


def decode(llm: LLM, prompt: list[int], adapter: str | None, steps: int, sequences: int = 1) -> dict[str, float]:
    """Self CPU microseconds per step by op name, over ``steps`` decode steps of ``sequences``
    sequences (each on the same prompt, so the second one's prefill is a prefix hit)."""
    engine = llm.engine
    for _ in range(sequences):
        engine.add_request(prompt, SamplingParams(max_tokens=steps + 2, ignore_eos=True), adapter=adapter)
    engine.step()  # the prefill
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        n = 0
        while engine.has_unfinished():
            engine.step()
            n += 1
        wall = (time.perf_counter() - start) / n
    table = {e.key: e.self_cpu_time_total / n for e in prof.key_averages()}
    table["(wall per step)"] = wall * 1e6
    return table


if __name__ == "__main__":
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 24
    model = Path.home() / ".cache/kvshare/models/smollm2-135m-instruct"
    llm = LLM(model, [], dtype="bfloat16", compile="on")
    prompt = torch.randint(100, 40000, (256,), generator=torch.Generator().manual_seed(0)).tolist()
    llm.engine.warm_up((1, 2))
    with tempfile.TemporaryDirectory() as tmp:
        name = llm.engine.load_adapter(random_adapter("icarus", model, tmp, "icarus-step", seed=0))
    llm.engine.warm_up((2,), adapters=True)
    decode(llm, prompt, None, 4), decode(llm, prompt, None, 4, 2), decode(llm, prompt, name, 4)  # warm
    base, base2, pair = (decode(llm, prompt, None, steps), decode(llm, prompt, None, steps, 2),
                         decode(llm, prompt, name, steps))
    keys = sorted(set(base) | set(pair) | set(base2), key=lambda k: -max(t.get(k, 0) for t in (base, base2, pair)))
    print(f"{'op (self CPU us per step)':60s} {'base b1':>9s} {'base b2':>9s} {'pair b1':>9s}")
    for key in keys[:30]:
        print(f"{key[:60]:60s} " + " ".join(f"{t.get(key, 0.0):9.1f}" for t in (base, base2, pair)))
