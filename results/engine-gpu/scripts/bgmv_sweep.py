"""The BGMV kernels' tile on a GPU (session 27): an ICaRus pair step's LoRA launches carry a few
rows each, so they are latency-bound; a wider tile (fewer, wider loads; more warps) may beat the
loop of narrow ones, and one launch for a fused projection's parts may beat one each. For each
(weight elements a program holds, most warps, one launch or one a part) this records the CUDA
graphs again and times the engine's pair / base step (wall, as `bench engine` does) and the two
graphs' replays alone (GPU time). The first variant is the kernel before session 27.
Run in session 27 (sweep.txt) its second variant could not record: the dropped graphs' memory
pool, fixed since in serve/exec/cuda_graphs.py.

    python3 bgmv_sweep.py MODEL_DIR [cuda|cpu]     (cpu: under TRITON_INTERPRET=1, a smoke run)
"""
import sys
import tempfile

import torch

from kvshare.eval.perf.engine import _pair_step_ratio
from kvshare.kernels.triton import bgmv
from kvshare.random_adapters import random_adapter
from kvshare.serve.engine.llm_engine import LLM

if __name__ == "__main__":
    model, device = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else "cuda")
    on_gpu = device == "cuda"
    llm = LLM(model, kv_cache_tokens=8192, dtype="bfloat16" if on_gpu else "float32", device=device,
              kernels="triton", compile="auto" if on_gpu else "off")
    name = llm.engine.load_adapter(random_adapter("icarus", model, tempfile.mkdtemp(), "ic", seed=0))
    prompt = list(range(100, 356 if on_gpu else 120))
    step = llm.engine.runner.compiled
    print(f"steps: {type(step).__name__ if step is not None else 'eager'}", flush=True)

    def replay_ms(key: tuple, n: int = 50) -> float:
        """The graph of ``key`` replayed over the last (pair) step's positions and block table,
        as one sequence of its rows, writing no KV."""
        size, _, rows = key
        step.slots.fill_(-1)
        step.loc[0] = 0
        step.loc[1:size + 1].fill_(rows)
        graph = step.graphs[key][0]
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        graph.replay()
        torch.cuda.synchronize()
        begin.record()
        for _ in range(n):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        return begin.elapsed_time(end) / n

    # (tile, most warps, the adapted parts of a fused projection in one launch, the graph's LoRA
    # kernel): session 25's kernel first, then session 27's tile, then session 27's kernel (the
    # default), then session 28's projection and LoRA in one launch (KVSHARE_GRAPH_LORA=fused)
    for tile, warps, one_launch, lora_kernel in ((4096, 4, False, "bgmv"), (16384, 8, False, "bgmv"),
                                                 (16384, 8, True, "bgmv"), (16384, 8, True, "fused")):
        bgmv._TILE, bgmv._MAX_WARPS = tile, warps
        bgmv._parts_failed = None if one_launch else "the sweep's choice"
        if step is not None:
            step.lora_kernel = lora_kernel
            step.graphs.clear()
            llm.engine.warm_up((1,))
            llm.engine.warm_up((2,), adapters=True)
        r = _pair_step_ratio(llm, prompt, name, times=5 if on_gpu else 1)
        launches = ("a launch a fused projection" if one_launch and bgmv._parts_failed is None else
                    f"a launch a part ({bgmv._parts_failed})")  # the multi-part kernel may have failed here
        launches = "projection and LoRA one launch" if lora_kernel == "fused" else launches
        line = (f"tile {tile:5d}, warps <= {warps}, {launches}: engine step base {r['base_step_s'] * 1e3:.2f} ms, "
                f"pair {r['icarus_step_s'] * 1e3:.2f} ms, ratio {r['ratio']:.2f}x")
        if step is not None:
            base, pair = replay_ms((1, False, 1)), replay_ms((2, True, 2))
            line += f"; graph replay base {base:.3f} ms, pair {pair:.3f} ms, ratio {pair / base:.2f}x"
        print(line, flush=True)
