"""SmolLM2's 30 layers of projections as int4 weights (PyTorch's CPU int4 kernel) at 1, 2 and 4
bfloat16 rows: medians of 15 runs, six alternations, the median of each in milliseconds.

``python results/engine-cpu-bf16/session23/int4_rows.py``
"""
import statistics
import time

import torch

from kvshare.kernels.quant import quantize_int4
torch.manual_seed(0)
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
ws = [quantize_int4((torch.randn(n, k) * 0.05).bfloat16()) for _ in range(30) for n, k in SHAPES]
def run(rows):
    xs = {k: torch.randn(rows, k).bfloat16() for k in (576, 1536)}
    return lambda: [torch._weight_int4pack_mm_for_cpu(xs[w.packed.shape[1] * 2], w.packed, w.group, w.scales_zeros) for w in ws]
def med(fn):
    fn(); t = []
    for _ in range(15):
        s = time.perf_counter(); fn(); t.append(time.perf_counter() - s)
    return sorted(t)[7] * 1e3
r = {1: [], 2: [], 4: []}
for _ in range(6):
    for k in r: r[k].append(med(run(k)))
print({k: round(statistics.median(v), 3) for k, v in r.items()})
