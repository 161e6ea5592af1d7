"""What one compiled step costs by its row count: the bucket, not the rows, sets it.

    python results/cpu-attention/session19/bucket_costs.py > results/cpu-attention/session19/bucket_costs.txt

SmolLM2 bfloat16, compiled buckets up to 128 (graphs from the graph cache, or compiled on first
use), a cached 1,600-token prefix and then a prompt of n new tokens: the step computing those
n rows, median of 5 rounds (rounds alternate the sizes). Behind ``Scheduler._fill_bucket``.
"""
import time, torch, statistics as st
from pathlib import Path
from kvshare.serve import LLM, SamplingParams
model = Path.home() / ".cache/kvshare/models/smollm2-135m-instruct"
llm = LLM(model, [], dtype="bfloat16", compile="on", max_num_batched_tokens=1024, compile_max_rows=128)
e = llm.engine
e._scheduler.row_buckets = ()  # steps of exactly n rows: no chunk cut back to a bucket
g = torch.Generator().manual_seed(0)
base = torch.randint(100, 40000, (1600,), generator=g).tolist()
e.add_request(base, SamplingParams(max_tokens=1, ignore_eos=True))
while e.has_unfinished(): e.step()
def one(n):
    p = base + torch.randint(100, 40000, (n,), generator=g).tolist()
    e.add_request(p, SamplingParams(max_tokens=1, ignore_eos=True))
    t = time.perf_counter(); e.step(); dt = time.perf_counter() - t
    while e.has_unfinished(): e.step()
    return dt
ns = [16, 31, 32, 33, 48, 63, 64, 65, 80, 96, 112, 127, 128]
for n in ns: one(n)
res = {n: [] for n in ns}
for r in range(5):
    for n in ns: res[n].append(one(n))
for n in ns:
    bucket = e.runner.compiled.bucket(n)
    print(f'{n} rows (bucket {bucket}): {1000 * st.median(res[n]):.1f} ms')
