"""SmolLM2's 30 layers of projections (qkv, o, gate_up, down; bfloat16) at 1-16 rows: the
AVX512-BF16 dot-product kernel against ``F.linear`` and against Inductor's C++ GEMM template
(the same stack through ``torch.compile`` with frozen weights and max_autotune, as the compiled
step compiles it), medians of 20 runs each, in one process.

``python results/engine-cpu-bf16/session21/projections.py``
"""

import time

import torch
import torch._inductor.config
import torch.nn.functional as F

from kvshare.kernels.cpu import linear as cpu_linear
from kvshare.serve.exec.compiled import INDUCTOR_OPTIONS

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]


class Stack(torch.nn.Module):
    def __init__(self, weights):
        super().__init__()
        self.w = torch.nn.ParameterList([torch.nn.Parameter(w, requires_grad=False) for w in weights])

    def forward(self, xs):
        return [F.linear(xs[i % len(SHAPES)], w) for i, w in enumerate(self.w)]


def median_ms(fn) -> float:
    fn()
    times = []
    for _ in range(20):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[10] * 1e3


if __name__ == "__main__":
    torch.manual_seed(0)
    plain = [(torch.randn(n, k) * 0.05).bfloat16() for _ in range(30) for n, k in SHAPES]
    packed = [cpu_linear.pack(w) for w in plain]
    stack = Stack(plain).eval()
    for rows in (1, 2, 4, 8, 16):
        x = [torch.randn(rows, k).bfloat16() for _, k in SHAPES]
        xs = [x[i % len(SHAPES)] for i in range(len(plain))]
        with torch.no_grad(), torch._inductor.config.patch(freezing=True):
            compiled = torch.compile(stack, options=INDUCTOR_OPTIONS, dynamic=False)
            template = median_ms(lambda: compiled(x))
        ours = median_ms(lambda: [cpu_linear.linear_vnni(a, p) for a, p in zip(xs, packed)])
        eager = median_ms(lambda: [F.linear(a, w) for a, w in zip(xs, plain)])
        print(f"{rows:2d} rows: dot products {ours:5.2f} ms | Inductor template {template:5.2f} ms | "
              f"F.linear {eager:5.2f} ms | template / dot products {template / ours:.2f}x", flush=True)
