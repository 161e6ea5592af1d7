"""``kvshare bench forkkv``: what ForkKV's split KV buys LoRA agents, measured in the engine.

Three measurements, all on the same base and random rank-r lora adapters (speed and memory
do not depend on their values), in one process:

1. **Memory per agent.** N agents (N = 2, 4, 8) answer over one shared context of C tokens;
   the bytes holding KV in both pools, per agent, with ForkKV vs exact per-agent LoRA KV.
   ForkKV holds the base part once and a rank-r residual per agent, so the ratio should be
   ``1/N + r/n`` (n = kv_heads x head_dim, the width of one layer's K): the formula is
   printed beside the measured value.
2. **Concurrent agents a fixed pool holds.** One byte budget (``--budget-contexts`` exact
   contexts); ForkKV splits it between its base pool and a residual pool with room for every
   agent's residual. M agents arrive at once over the shared context and decode D tokens;
   the peak number running together, the wall time and the decode throughput.
3. **ReAct workflows under memory pressure**: ``kvshare bench workflow``'s workload with
   ForkKV lora agents vs exact lora agents vs ICaRus agents, the same bytes of KV each.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from tqdm import tqdm

from ...random_adapters import random_adapter
from ...serve.engine.llm_engine import LLMEngine
from ...serve.sampling_params import SamplingParams
from .common import filler_prompt, same_memory_settings, setup, write_report as _write


def kv_widths(engine: LLMEngine) -> tuple[int, int]:
    """(bytes of one token's exact K/V over all layers, n = kv_heads x head_dim)."""
    shape = engine.block_shape
    return engine.kv_bytes_per_token, shape.kv_heads * shape.head_dim


def _bytes_holding(engine: LLMEngine) -> int:
    return sum(pool["bytes_holding_kv"] for pool in engine.kv_usage().values())


def memory_per_agent(model_dir: Path, adapters: list[Path], context: list[int], agent_counts: tuple[int, ...],
                     rank: int, block_size: int) -> list[dict]:
    """Part 1: bytes of KV per agent, ForkKV vs exact, after N agents each answered once."""
    rows = []
    for n in agent_counts:
        held = {}
        for layout in ("exact", "forkkv"):
            engine = LLMEngine(model_dir, kv_cache_tokens=(n + 1) * (len(context) + block_size), kv_layout=layout,
                               forkkv_max_rank=rank, block_size=block_size)
            names = [engine.load_adapter(path, f"agent{i}") for i, path in enumerate(adapters[:n])]
            for name in names:  # one after another: each later agent finds the earlier ones' blocks
                engine.add_request(context, SamplingParams(max_tokens=1, ignore_eos=True), adapter=name)
                while engine.has_unfinished():
                    engine.step()
            held[layout] = _bytes_holding(engine)
            kv_bytes, width = kv_widths(engine)
        ratio = held["forkkv"] / held["exact"]
        formula = 1 / n + rank / width
        rows.append({"agents": n, "context_tokens": len(context), "rank": rank, "kv_width": width,
                     "exact_bytes_per_agent": held["exact"] / n, "forkkv_bytes_per_agent": held["forkkv"] / n,
                     "measured_ratio": ratio, "formula_ratio": formula, "off_formula": ratio / formula - 1})
    return rows


def concurrent_agents(model_dir: Path, adapters: list[Path], context: list[int], budget_contexts: int,
                      decode_tokens: int, block_size: int, rank: int) -> list[dict]:
    """Part 2: M agents at once over one context in a pool of ``budget_contexts`` contexts' bytes."""
    budget = budget_contexts * (len(context) + decode_tokens)
    _, width = kv_widths(LLMEngine(model_dir, kv_cache_tokens=block_size, block_size=block_size))
    rows = []
    for mode in ("lora", "forkkv", "icarus"):
        # eager for every mode: ForkKV steps have no compiled graph, and the comparison is of KV layouts
        settings = {"kv_cache_tokens": budget, "block_size": block_size, "max_num_batched_tokens": 2048,
                    "compile": "off"}
        if mode == "forkkv":
            settings |= same_memory_settings(budget, width, rank, len(adapters))
        engine = LLMEngine(model_dir, **settings)
        with tempfile.TemporaryDirectory(prefix="kvshare-forkkv-") as tmp:
            paths = adapters if mode != "icarus" else [
                random_adapter("icarus", model_dir, tmp, f"icarus-{i}", seed=i, rank=rank) for i in range(len(adapters))]
            names = [engine.load_adapter(path, f"agent{i}") for i, path in enumerate(paths)]
        params = SamplingParams(max_tokens=decode_tokens, ignore_eos=True)
        start, peak, produced = time.perf_counter(), 0, 0
        for name in names:
            engine.add_request(context, params, adapter=name)
        while engine.has_unfinished():
            produced += len(engine.step())
            peak = max(peak, engine.num_running())
        wall = time.perf_counter() - start
        stats = engine.stats()
        rows.append({"mode": mode, "agents": len(names), "budget_exact_tokens": budget,
                     "kv_cache_tokens": settings["kv_cache_tokens"],
                     "forkkv_residual_tokens": settings.get("forkkv_residual_tokens"),
                     "peak_running": peak, "wall_s": wall, "tokens_per_s": produced / wall,
                     "preemptions": stats["preemptions"], "prefix_hit_rate": stats["prefix_hit_rate"]})
    return rows


def run_forkkv_bench(model: str = "smollm2-135m-instruct", agent_counts: tuple[int, ...] = (2, 4, 8),
                     context_tokens: int = 512, rank: int = 8, block_size: int = 16, concurrent: int = 16,
                     budget_contexts: int = 4, decode_tokens: int = 16, workflow_agents: int = 4,
                     workflow_qps: tuple[float, ...] = (0.5,), workflows: int = 6, turns: int = 8,
                     workflow_kv_contexts: float = 6.0, threads: int = 2, out_dir: str | Path | None = None) -> dict:
    from .workflow import run_workflow_bench

    model_dir = setup(model, threads)
    probe = LLMEngine(model_dir, kv_cache_tokens=block_size, block_size=block_size)
    context = filler_prompt(probe.tokenizer, context_tokens)
    parts = tqdm(total=3, desc="bench forkkv", unit="part")
    with tempfile.TemporaryDirectory(prefix="kvshare-forkkv-") as tmp:
        count = max(max(agent_counts), concurrent)
        adapters = [random_adapter("lora", model_dir, tmp, f"lora-{i}", seed=i, rank=rank) for i in range(count)]
        memory = memory_per_agent(model_dir, adapters, context, agent_counts, rank, block_size)
        parts.update()
        capacity = concurrent_agents(model_dir, adapters[:concurrent], context, budget_contexts, decode_tokens,
                                     block_size, rank)
        parts.update()
    kv_tokens = int(workflow_kv_contexts * (context_tokens + turns * (16 + 32 + 24)))
    workflow = run_workflow_bench(model, agents=(workflow_agents,), qps=workflow_qps,
                                  modes=("icarus", "lora", "forkkv"), workflows=workflows, turns=turns,
                                  context_tokens=context_tokens, kv_cache_tokens=kv_tokens, threads=threads,
                                  adapter_rank=rank, compile="off")
    parts.update()
    parts.close()
    results = {"model": str(model), "dtype": "float32", "threads": threads, "rank": rank, "block_size": block_size,
               "memory": memory, "concurrency": capacity,
               "workflow": {k: workflow[k] for k in ("workflows_per_point", "turns", "context_tokens", "max_tokens",
                                                     "kv_cache_tokens", "points")}}
    if out_dir:
        write_report(results, Path(out_dir))
    return results


def markdown(results: dict) -> str:
    lines = [f"Model {results['model']}, float32, {results['threads']} threads, random lora adapters of rank "
             f"{results['rank']}; every mode runs eager (ForkKV's steps have no compiled graph: the "
             "comparison is of KV layouts, not of execution modes).", "",
             "**KV bytes per agent over one shared context**", "",
             "| agents | context | exact KB/agent | ForkKV KB/agent | measured ratio | 1/N + r/n | off |",
             "|---|---|---|---|---|---|---|"]
    for r in results["memory"]:
        lines.append(f"| {r['agents']} | {r['context_tokens']} | {r['exact_bytes_per_agent'] / 1024:.0f} | "
                     f"{r['forkkv_bytes_per_agent'] / 1024:.0f} | {r['measured_ratio']:.4f} | "
                     f"{r['formula_ratio']:.4f} | {r['off_formula']:+.1%} |")
    lines += ["", "**Agents running at once in one byte budget**", "",
              "| mode | agents | base pool tokens | residual tokens | peak running | wall s "
              "| generated tok/s (prefill in the wall time) | preemptions |",
              "|---|---|---|---|---|---|---|---|"]
    for r in results["concurrency"]:
        lines.append(f"| {r['mode']} | {r['agents']} | {r['kv_cache_tokens']} | {r['forkkv_residual_tokens'] or '-'} | "
                     f"{r['peak_running']} | {r['wall_s']:.1f} | {r['tokens_per_s']:.1f} | {r['preemptions']} |")
    wf = results["workflow"]
    lines += ["", f"**ReAct workflows** ({wf['workflows_per_point']} workflows x {wf['turns']} turns, context "
              f"{wf['context_tokens']} tokens, the bytes of a {wf['kv_cache_tokens']}-token exact pool for every mode)",
              "", "| mode | agents | QPS | tok/s | P95 latency s | hit rate | evictions | vs lora |", "|---|---|---|---|---|---|---|---|"]
    lora = {(p["agents"], p["qps"]): p["tokens_per_s"] for p in wf["points"] if p["mode"] == "lora"}
    for p in wf["points"]:
        vs = p["tokens_per_s"] / lora[(p["agents"], p["qps"])] if (p["agents"], p["qps"]) in lora else None
        lines.append(f"| {p['mode']} | {p['agents']} | {p['qps']} | {p['tokens_per_s']:.1f} | {p['p95_latency_s']:.2f} | "
                     f"{p['hit_rate']:.2f} | {p['evictions']} | {f'{vs:.2f}x' if vs else '-'} |")
    return "\n".join(lines) + "\n"


def write_report(results: dict, out_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    _write(results, out_dir, "forkkv_bench", markdown)
    fig, ax = plt.subplots(figsize=(6, 4))
    memory = results["memory"]
    ax.plot([r["agents"] for r in memory], [r["measured_ratio"] for r in memory], marker="o", label="measured")
    ax.plot([r["agents"] for r in memory], [r["formula_ratio"] for r in memory], linestyle="--", label="1/N + r/n")
    ax.set_xlabel("agents over one context")
    ax.set_ylabel("ForkKV bytes / exact LoRA bytes")
    ax.set_xscale("log", base=2)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "forkkv_memory.png", dpi=120)
    plt.close(fig)
