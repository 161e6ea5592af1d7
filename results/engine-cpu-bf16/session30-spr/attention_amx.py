"""Batch-1 decode step with the C++ attention's AMX path on and off (the generic path), alternating.

``python results/engine-cpu-bf16/session30-spr/attention_amx.py`` (repo root, venv active)."""
import time
from kvshare.kernels import cpu
from kvshare.serve import LLM, SamplingParams

def steps_ms(llm, prompt, n=48):
    e = llm.engine
    e.add_request(prompt, SamplingParams(max_tokens=n + 2, ignore_eos=True))
    e.step()
    start = time.perf_counter(); k = 0
    while e.has_unfinished():
        e.step(); k += 1
    return (time.perf_counter() - start) / k * 1e3

if __name__ == "__main__":
    ext = cpu.extension()
    for kernels in ("int4,cpu", "auto"):
        llm = LLM("smollm2-135m-instruct", dtype="bfloat16", kernels=kernels, kv_cache_tokens=8192)
        for ctx in (256, 1024):
            prompt = list(range(100, 100 + ctx))
            steps_ms(llm, prompt, 4)
            res = {True: [], False: []}
            for _ in range(3):
                for amx in (True, False):
                    ext.paged_attention_set_amx(amx)
                    res[amx].append(steps_ms(llm, prompt))
            ext.paged_attention_set_amx(True)
            print(f"{kernels} ctx {ctx}: amx on {sorted(res[True])[1]:.2f} ms, off {sorted(res[False])[1]:.2f} ms per step "
                  f"(runs {['%.2f' % x for x in res[True]]} / {['%.2f' % x for x in res[False]]})", flush=True)
