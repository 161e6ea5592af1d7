"""Where a batch-1 decode step's time goes (torch profiler, self CPU us per step), int4 and bfloat16.

``python results/engine-cpu-bf16/session30-spr/step_profile.py`` (repo root, venv active)."""
import sys
sys.path.insert(0, "results/engine-cpu-bf16/session21")  # its decode(): self CPU time per step by op
from pair_profile import decode
from kvshare.serve import LLM

if __name__ == "__main__":
    for kernels in ("int4,cpu", "auto"):
        llm = LLM("smollm2-135m-instruct", dtype="bfloat16", kernels=kernels, kv_cache_tokens=4096)
        prompt = list(range(100, 356))
        decode(llm, prompt, None, 8)  # compile/warm
        table = decode(llm, prompt, None, 48)
        top = sorted(table.items(), key=lambda kv: -kv[1])[:12]
        print(f"== {kernels}")
        for name, us in top:
            print(f"{us:9.0f} us  {name}")
