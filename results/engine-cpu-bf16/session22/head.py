"""The LM head alone (SmolLM2-135M: 49,152 x 576), bfloat16 rows, 2 threads: F.linear on the
bfloat16 weight and the AVX512-BF16 dot-product kernel (up to 16 rows). ``head.txt`` also has
a third column, the int8-group head kernel of commit 0b39a2e (reverted: no faster in the engine,
``q8_head_decode.txt``), measured with this script at that commit.

``python results/engine-cpu-bf16/session22/head.py``: median of 20 calls each, per row count.
"""

import time

import torch
import torch.nn.functional as F

from kvshare.kernels.cpu import linear as cpu_linear


def median_ms(fn, calls: int = 20) -> float:
    fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[calls // 2] * 1e3


if __name__ == "__main__":
    torch.set_num_threads(2)
    w = (torch.randn(49152, 576) / 24).bfloat16()
    packed = cpu_linear.pack(w)
    print("rows | F.linear bf16 ms | dot products bf16 ms")
    for rows in (1, 2, 4, 16, 32, 64, 128):
        x = torch.randn(rows, 576).bfloat16()
        dense = median_ms(lambda: F.linear(x, w))
        dots = median_ms(lambda: cpu_linear.linear_vnni(x, packed)) if rows <= cpu_linear.MAX_ROWS else float("nan")
        print(f"{rows} | {dense:.2f} | {dots:.2f}", flush=True)
