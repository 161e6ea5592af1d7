"""Paged attention's key tiling on a GPU (written in session 27, not yet run). Decode at batch 1
was 2.6-2.9x SDPA's GPU time on the H200 (`h200-graphs/kernels-bgmv`: 0.0148 against 0.0052 ms,
SmolLM2's shapes, 1k keys), where the issue asks for 1.5x: a few programs each walk 256 keys or
more in steps of 32, one dependent load after another. For each (keys per step, fewest keys a
split takes, block-table entries loaded a step ahead: session 28) this runs `bench kernels`' attention rows (each checked against SDPA first) and
prints the Triton kernel's replayed GPU time against SDPA's. The first variant is the default
kernel (session 27's); the others load block-table entries a step ahead (session 28).

    python3 attention_sweep.py
"""
import kvshare.kernels.triton.attention as attention
from kvshare.eval.perf.kernels import run_kernel_bench

if __name__ == "__main__":
    for block_n, min_split, ahead in ((32, 256, False), (32, 256, True), (64, 256, True), (32, 64, True),
                                      (64, 128, True), (16, 64, True)):
        attention._BLOCK_N, attention._MIN_SPLIT_KEYS, attention._PREFETCH_TABLE = block_n, min_split, ahead
        results = run_kernel_bench(device="cuda", dtype="bfloat16", kernels=["triton"],
                                   shapes=["smollm2-135m", "llama-8b"], batches=(1,), contexts=(1024, 4096),
                                   lora_rows=())
        for row in results["attention"]:
            triton, sdpa = row.get("triton_graph_ms"), row.get("sdpa_gathered_graph_ms")
            ratio = f"{triton / sdpa:.2f}x" if triton and sdpa else "-"
            table = "ahead" if ahead else "in step"
            print(f"keys/step {block_n:3d}, split >= {min_split:3d} keys, table {table:7s} | "
                  f"{row['shape']:12s} {row['rows']:11s} "
                  f"batch {row['batch']:2d} context {row['context']:4d} | triton {triton or 0:.4f} ms, "
                  f"SDPA {sdpa or 0:.4f} ms, {ratio}", flush=True)
