"""Where a bfloat16 prefill's time goes now (eager step, compile off): wall time of each part the
step calls, summed over the prompt, for 1k and 4k tokens; medians of 3 after a warm-up.
The fused C++ parts are no torch operators, so torch's profiler would not see them: each part is
timed around its call instead. Run alone: python results/engine-vllm/intel-amx-bfloat16/prefill_parts.py"""
import collections, statistics, subprocess, sys, time

import torch

from kvshare.kernels import cpu
from kvshare.serve import LLM, SamplingParams

torch.set_num_threads(2)
assert cpu.extension() is not None, "the C++ kernels are not built here"
llm = LLM("smollm2-135m-instruct", dtype="bfloat16", compile="off", max_num_batched_tokens=4096)
kernels = llm.engine.runner.model.kernels
spent = collections.Counter()


def timed(owner, name, part):
    call = getattr(owner, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return call(*args, **kwargs)
        finally:
            spent[part] += time.perf_counter() - start
    setattr(owner, name, wrapper)


timed(kernels, "paged_attention", "attention")
timed(kernels, "write_kv", "KV write")
timed(kernels.linear, "apply", "projections (matmuls)")
pointwise = type("Timed", (kernels.pointwise,), {})
kernels.pointwise = pointwise
for name in ("rms_norm", "add_rms_norm", "rope", "silu_mul"):
    timed(pointwise, name, "norms, RoPE, SiLU*up (C++)")
commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
print(f"$ python {' '.join(sys.argv)}   # at {commit}, {llm.engine.runner.model.kernels.choice}")
for n in (1024, 4096):
    prompt = [(i * 7919) % 40000 + 100 for i in range(n)]
    rounds = []
    for i in range(4):
        spent.clear()
        llm.engine.reset_prefix_cache()
        start = time.perf_counter()
        llm.generate([prompt], SamplingParams(max_tokens=1))
        total = time.perf_counter() - start
        if i:  # the first pays set-up
            rounds.append({"total": total, **spent, "other": total - sum(spent.values())})
    print(f"\n{n} tokens: {n / statistics.median(r['total'] for r in rounds):.0f} tok/s (median of 3)")
    for part in rounds[0]:
        ms = statistics.median(r[part] * 1e3 for r in rounds)
        print(f"  {part:28s} {ms:8.1f} ms")
