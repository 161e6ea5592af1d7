"""Where a 1k-token bfloat16 prefill's time goes (eager engine step), on this CPU."""
import sys, time, torch
from torch.profiler import profile, ProfilerActivity
from kvshare.serve import LLM, SamplingParams
torch.set_num_threads(2)
n = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
llm = LLM("smollm2-135m-instruct", dtype="bfloat16", compile="off")
prompt = [(i * 7919) % 40000 + 100 for i in range(n)]
for _ in range(2):
    llm.engine.reset_prefix_cache(); t = time.perf_counter(); llm.generate([prompt], SamplingParams(max_tokens=1)); print("prefill s", time.perf_counter() - t, n / (time.perf_counter() - t), "tok/s")
llm.engine.reset_prefix_cache()
with profile(activities=[ProfilerActivity.CPU]) as prof:
    llm.generate([prompt], SamplingParams(max_tokens=1))
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
