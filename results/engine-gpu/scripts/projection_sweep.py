"""A decode projection with and without its LoRA, kernel by kernel, on a GPU (written in session
28, not yet run). The ICaRus pair step was 1.31x a base step replayed from CUDA graphs (session
27, H200), mostly the one BGMV launch each adapted projection adds after cuBLAS's. For
SmolLM2's four fused projections (and Llama-8B's q/k/v for scale), at 1 and 2 rows, this
times, replayed from a CUDA graph (the GPU's time alone):

  cublas        F.linear                              (a base step's projection)
  triton        linear_lora without parts             (the same in Triton)
  cublas+bgmv   F.linear, then bgmv_lora_add_parts    (the pair step's, KVSHARE_GRAPH_LORA=bgmv)
  fused         linear_lora with the parts            (KVSHARE_GRAPH_LORA=fused)

each checked against F.linear + lora_delta first, for each (columns a program writes, input
features a loop step reads) of the fused kernel. The issue's goal wants ``fused`` near ``cublas``.

    python3 projection_sweep.py            (python3 projection_sweep.py cpu: a smoke run, interpreted)
"""
import sys

import torch
import torch.nn.functional as F

if __name__ == "__main__":
    on_gpu = (sys.argv[1] if len(sys.argv) > 1 else "cuda") == "cuda"
    if not on_gpu:
        import os
        os.environ["TRITON_INTERPRET"] = "1"
    from kvshare.eval.perf.kernels import _timers
    from kvshare.kernels.triton import linear_lora as ll
    from kvshare.kernels.triton.bgmv import bgmv_lora_add_parts
    from kvshare.serve.exec.lora_slots import lora_delta

    device, dtype = ("cuda", torch.bfloat16) if on_gpu else ("cpu", torch.float32)
    timers = _timers(torch.device(device))
    time_it = timers.get("graph", timers["launch"])
    gen = torch.Generator().manual_seed(0)
    rank, slots = 16, 8
    # (name, input features, [(part width, adapted by ICaRus)]): SmolLM2-135M, then Llama-8B's q/k/v
    projections = [("smollm2 qkv", 576, [(576, True), (192, False), (192, False)]),
                   ("smollm2 o", 576, [(576, True)]),
                   ("smollm2 gate_up", 576, [(1536, True), (1536, True)]),
                   ("smollm2 down", 1536, [(576, True)]),
                   ("llama-8b qkv", 4096, [(4096, True), (1024, False), (1024, False)])]
    if not on_gpu:
        projections = projections[:2]
    variants = [(64, 64), (32, 64), (64, 128), (32, 128), (16, 128)] if on_gpu else [(64, 64)]
    for name, d_in, widths in projections:
        d_out = sum(width for width, _ in widths)
        weight = (torch.randn(d_out, d_in, generator=gen) / d_in ** 0.5).to(device, dtype)
        parts, first = [], 0
        for width, adapted in widths:
            if adapted:
                a = (torch.randn(slots, rank, d_in, generator=gen) / d_in ** 0.5).to(device, dtype)
                parts.append((first, a, (torch.randn(slots, rank, width, generator=gen) / rank).to(device, dtype)))
            first += width
        for rows in (1, 2):
            x = torch.randn(rows, d_in, generator=gen).to(device, dtype)
            index = torch.full((rows,), 3, dtype=torch.long, device=device)
            scale = torch.tensor([0.0, 2.0][-rows:], device=device)  # a pair: the base row, then the adapter's
            want = F.linear(x, weight).float()
            for first, a, b_t in parts:
                want[:, first:first + b_t.shape[-1]] += lora_delta(x, a, b_t, index, scale)

            def cublas_bgmv():
                bgmv_lora_add_parts(F.linear(x, weight), x, parts, index, scale)

            got = F.linear(x, weight)
            bgmv_lora_add_parts(got, x, parts, index, scale)
            torch.testing.assert_close(got.float(), want, atol=0.05, rtol=0.02)
            plain = {"cublas": time_it(lambda: F.linear(x, weight)), "cublas+bgmv": time_it(cublas_bgmv)}
            for block_n, block_k in variants:
                ll._BLOCK_N, ll._BLOCK_K = block_n, block_k
                torch.testing.assert_close(ll.linear_lora(x, weight, None, parts, index, scale).float(), want,
                                           atol=0.05, rtol=0.02)
                torch.testing.assert_close(ll.linear_lora(x, weight, None, [], index, scale).float(),
                                           F.linear(x, weight).float(), atol=0.05, rtol=0.02)
                triton_ms = time_it(lambda: ll.linear_lora(x, weight, None, [], index, scale))
                fused_ms = time_it(lambda: ll.linear_lora(x, weight, None, parts, index, scale))
                print(f"proj {name:16s} rows {rows} | cols {block_n:3d}, k-step {block_k:3d} | "
                      f"cublas {plain['cublas']:.4f} ms, triton {triton_ms:.4f}, cublas+bgmv "
                      f"{plain['cublas+bgmv']:.4f}, fused {fused_ms:.4f} | fused / cublas "
                      f"{fused_ms / plain['cublas']:.2f}x, cublas+bgmv / cublas "
                      f"{plain['cublas+bgmv'] / plain['cublas']:.2f}x", flush=True)
