"""The LM head alone (SmolLM2-135M: 49,152 x 576), bfloat16, 2 threads, at each decode row count:
``F.linear`` (oneDNN: AMX tiles where the CPU has them) against the AVX512-BF16 dot-product
kernel. Where the two cross is how many rows ``cpu_linear.head_rows()`` gives the kernel.

``python results/engine-cpu-bf16/session30-spr/head_rows.py`` (repo root, venv active): medians
of 20 calls each, the two measured in turn three times.
"""

import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, "results/engine-cpu-bf16/session22")
from head import median_ms  # noqa: E402

from kvshare.kernels.cpu import linear as cpu_linear  # noqa: E402

if __name__ == "__main__":
    torch.set_num_threads(2)
    w = (torch.randn(49152, 576) / 24).bfloat16()
    packed = cpu_linear.pack(w)
    print("rows | F.linear bf16 ms | dot products bf16 ms | F.linear / dot products")
    for rows in (1, 2, 3, 4, 6, 8, 12, 16):
        x = torch.randn(rows, 576).bfloat16()
        dense, dots = [], []
        for _ in range(3):
            dense.append(median_ms(lambda: F.linear(x, w)))
            dots.append(median_ms(lambda: cpu_linear.linear_vnni(x, packed)))
        d, v = sorted(dense)[1], sorted(dots)[1]
        print(f"{rows} | {d:.2f} | {v:.2f} | {d / v:.2f}x", flush=True)
