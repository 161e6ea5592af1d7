"""Prompt chunks in the kernel against SDPA over the gathered keys, one process, alternating.

    python results/cpu-attention/session19/chunk_sweep.py [OUT_DIR]   # writes chunk_sweep.json / .md (default: here)

The kernel's chunk path is the machine's: AMX tiles (session 19, Sapphire Rapids) or AVX512-BF16
dot products (session 20, AMD EPYC); the JSON names it and the CPU.

One sequence's chunk of ``rows`` query rows at the end of ``context`` keys (the rows before
are a cached prefix; ``rows == context`` is a causal prompt), SmolLM2's heads (9 query heads,
3 KV heads, 64 dims), bfloat16, blocks of 16 at random places in the pool, times 30 layers.
The kernel path is what the engine now runs for chunks (``kvshare.kernels.cpu.attend``); SDPA
is what it ran before (gather the blocks, then ``scaled_dot_product_attention``, masked when
the chunk follows a prefix). Each figure is the best of two timed runs of the pair.
"""
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from kvshare.kernels import cpu

SHAPES = [(17, 1600), (60, 1600), (128, 1700), (256, 2000), (512, 2048), (1024, 1024), (1024, 2048)]
BLOCK, KV_HEADS, HEADS, DIM, LAYERS = 16, 3, 9, 64, 30


def main():
    path = cpu.extension().paged_attention_chunk_path()
    assert path, "this benchmark measures the kernel's chunk path; this machine has none (SDPA takes chunks)"
    torch.manual_seed(0)
    ext = cpu.extension()
    k_cache = torch.randn(600, BLOCK, KV_HEADS, DIM, dtype=torch.bfloat16)
    v_cache = torch.randn(600, BLOCK, KV_HEADS, DIM, dtype=torch.bfloat16)
    scale, rows_out = DIM ** -0.5, []
    for rows, context in SHAPES:
        table = torch.randperm(600)[:(context + BLOCK - 1) // BLOCK].to(torch.int32)
        q = torch.randn(rows, HEADS, DIM, dtype=torch.bfloat16)
        positions = torch.arange(context - rows, context)

        def kernel():
            out = torch.empty_like(q)
            ext.paged_attention(q, k_cache, v_cache, table[None].contiguous(), torch.tensor([0, rows], dtype=torch.int32),
                                (positions + 1).to(torch.int32), torch.tensor([0], dtype=torch.int32), scale, out)
            return out

        def sdpa():
            index = table.long()
            keys = k_cache.index_select(0, index).flatten(0, 1)[:context].transpose(0, 1).unsqueeze(0)
            values = v_cache.index_select(0, index).flatten(0, 1)[:context].transpose(0, 1).unsqueeze(0)
            causal = rows == context
            mask = None if causal else (torch.arange(context)[None, :] <= positions[:, None])[None, None]
            out = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), keys, values, attn_mask=mask,
                                                 scale=scale, is_causal=causal, enable_gqa=True)
            return out[0].transpose(0, 1)

        diff = (kernel().float() - sdpa().float()).abs().max().item()
        best = {"kernel": float("inf"), "sdpa": float("inf")}
        for name, fn in [("kernel", kernel), ("sdpa", sdpa)] * 2:
            fn()
            n = max(3, 200 // rows)
            start = time.perf_counter()
            for _ in range(n):
                fn()
            best[name] = min(best[name], (time.perf_counter() - start) / n * 1e3 * LAYERS)
        row = {"rows": rows, "context": context, "kernel_ms": round(best["kernel"], 1), "sdpa_ms": round(best["sdpa"], 1),
               "sdpa_over_kernel": round(best["sdpa"] / best["kernel"], 2), "max_abs_diff": round(diff, 4)}
        print(row, flush=True)
        rows_out.append(row)
    here = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent
    here.mkdir(parents=True, exist_ok=True)
    cpu_model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    (here / "chunk_sweep.json").write_text(json.dumps({"threads": torch.get_num_threads(), "layers": LAYERS,
                                                        "chunk_path": path, "cpu": cpu_model,
                                                        "points": rows_out}, indent=1) + "\n")
    lines = ["| rows | context | kernel ms (30 layers) | SDPA ms | SDPA / kernel | max abs diff |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['rows']} | {r['context']} | {r['kernel_ms']} | {r['sdpa_ms']} | {r['sdpa_over_kernel']}x | {r['max_abs_diff']} |"
              for r in rows_out]
    (here / "chunk_sweep.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
