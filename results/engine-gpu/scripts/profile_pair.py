"""Where an ICaRus pair step's time goes on the GPU (triton kernels): host vs device, top ops."""
import sys, tempfile, time
import torch
from torch.profiler import profile, ProfilerActivity
from kvshare.serve.engine.llm_engine import LLM
from kvshare.serve.sampling_params import SamplingParams
from kvshare.random_adapters import random_adapter

model, dtype = sys.argv[1], sys.argv[2]
dev = sys.argv[3] if len(sys.argv) > 3 else "cuda"
llm = LLM(model, kv_cache_tokens=8192, dtype=dtype, device=dev, kernels="triton" if dev == "cuda" else "torch", compile="off")
if dev == "cpu":
    torch.cuda.synchronize = lambda: None
tmp = tempfile.mkdtemp()
name = llm.engine.load_adapter(random_adapter("icarus", model, tmp, "ic", seed=0))
prompt = list(range(100, 132))
for adapter in (None, name):
    e = llm.engine
    e.add_request(prompt, SamplingParams(max_tokens=40, ignore_eos=True), adapter=adapter)
    for _ in range(10):
        e.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            e.step()
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        e.step()
    torch.cuda.synchronize()
    print(f"== adapter={adapter}: {(time.perf_counter() - t) / 10 * 1e3:.2f} ms/step")
    ka = prof.key_averages()
    print("device time total (ms/step):", sum(k.self_device_time_total for k in ka) / 5 / 1e3)
    print(ka.table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=50))
    while e.has_unfinished():
        e.step()
