"""``kvshare bench kvflow``: workflow-aware eviction and prefetch vs LRU, on KVFlow's setting.

A workflow is a loop of 10 sequential agents (ReAct round-robin); each agent has its own
fixed prompt (F tokens of HotpotQA paragraphs) and gets a new dynamic suffix per call
(D tokens) and answers O tokens. The fixed prompts together exceed the device KV pool (it
holds about half of them), so what the cache keeps decides what is recomputed. Modes, run
one after the other in one process on the same prompts:
- ``lru``: LRU eviction, evicted KV is dropped (recomputed on the next call);
- ``lru+host``: LRU, evicted KV goes to a host tier and is loaded back when a request
  needs it (reactive, as SGLang's HiCache);
- ``kvflow``: step-aware eviction + host tier + prefetch of the agents due next.
Every call carries the hints the workflow runtime sends (workflow/agent ids, fixed-prompt
length, steps to each agent's next call from the step graph).

On CPU the host link is simulated (``--links``): ``25`` GB/s is about PCIe 4.0 x16, which
on a 135M model on CPU makes a load ~1000x cheaper than recomputing; ``gpu-ratio`` sets the
link so that loading a token's KV costs 1/8 of prefilling it here, the ratio an H100 has
for an 8B model over PCIe 4.0 (128 KB of bf16 KV per token at 25 GB/s = 5 us vs about
40 us of prefill at 400 TFLOP/s effective). Figures are over the calls after the first
round (every mode computes every fixed prompt once in round one).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from tqdm import tqdm

from ...errors import KvshareError
from ...serve.engine.llm_engine import LLMEngine
from ...serve.exec.graph_cache import release_compiled_graphs
from ...serve.sampling_params import SamplingParams
from ...serve.task_graph import StepGraph
from ...splits import require_data_dir
from .common import percentile, setup, write_report as _write

MODES = {
    "lru": dict(eviction_policy="lru"),
    "lru+host": dict(eviction_policy="lru", host_cache_tokens=None),
    "kvflow": dict(eviction_policy="step", host_cache_tokens=None, prefetch_steps=1),
}
GPU_LOAD_TO_PREFILL = 1 / 8  # H100, 8B model, PCIe 4.0: seconds to load a token's KV / to prefill it


def hotpot_text_ids(tokenizer, n_tokens: int) -> list[int]:
    """Token ids of HotpotQA paragraphs, in file order, at least ``n_tokens`` of them."""
    ids: list[int] = []
    with open(require_data_dir() / "hotpotqa" / "dev_hard_500.jsonl", encoding="utf-8") as handle:
        for line in handle:
            row = json.loads(line)
            text = "\n".join(f"{title}: {''.join(sents)}" for title, sents in row["context"])
            ids += tokenizer.encode(text + "\n", add_special_tokens=False)
            if len(ids) >= n_tokens:
                break
    return ids


def run_workflows(engine: LLMEngine, fixed: list[list[int]], dynamic_source: list[int], workflows: int,
                  rounds: int, dynamic_tokens: int, output_tokens: int) -> tuple[list[dict], float]:
    """Run ``workflows`` copies of the agent loop at once (each workflow calls its agents one
    after another); return one record per call and the makespan."""
    n = len(fixed)
    order = [f"agent{c % n}" for c in range(rounds * n)]
    graph = StepGraph.chain(order)
    params = SamplingParams(max_tokens=output_tokens, ignore_eos=True)
    pending: dict[str, tuple[int, int, float]] = {}
    records: list[dict] = []

    def submit(w: int, call: int) -> None:
        agent = call % n
        offset = ((w * rounds * n + call) * dynamic_tokens) % max(1, len(dynamic_source) - dynamic_tokens)
        prompt = fixed[agent] + dynamic_source[offset:offset + dynamic_tokens]
        done = {f"n{c}" for c in range(call + 1)}
        hints = {"workflow_id": f"wf{w}", "agent_id": order[call], "fixed_prefix_tokens": len(fixed[agent]),
                 "steps_to_execution": {a: s + 1 for a, s in graph.agent_steps(done).items()}}
        request_id = engine.add_request(prompt, params, hints=hints)
        pending[request_id] = (w, call, time.perf_counter())

    start = time.perf_counter()
    for w in range(workflows):
        submit(w, 0)
    while pending:
        for out in engine.step():
            if not out.finished:
                continue
            w, call, began = pending.pop(out.request_id)
            m = out.metrics
            records.append({"workflow": w, "call": call, "latency_s": time.perf_counter() - began,
                            "ttft_s": m["time_to_first_token"], "prompt_tokens": m["prompt_tokens"],
                            "cached_tokens": m["prompt_tokens_cached"], "fixed_tokens": len(fixed[call % n]),
                            "computed_tokens": m["prompt_tokens_computed"], "load_wait_s": m["load_wait_time"]})
            if call + 1 < rounds * n:
                submit(w, call + 1)
    return records, time.perf_counter() - start


def _summary(records: list[dict], agents: int, makespan: float, stats: dict) -> dict:
    warm = [r for r in records if r["call"] >= agents]  # after every fixed prompt was computed once
    lat = [r["latency_s"] for r in warm]
    return {
        "calls": len(records), "warm_calls": len(warm), "makespan_s": makespan,
        "mean_latency_s": sum(lat) / len(lat), "p95_latency_s": percentile(lat, 0.95),
        "mean_ttft_s": sum(r["ttft_s"] for r in warm) / len(warm),
        "p95_ttft_s": percentile([r["ttft_s"] for r in warm], 0.95),
        "fixed_hit_rate": sum(min(r["cached_tokens"], r["fixed_tokens"]) for r in warm) / sum(r["fixed_tokens"] for r in warm),
        "prefix_hit_rate": stats["prefix_hit_rate"],
        "tokens_recomputed": sum(r["computed_tokens"] for r in warm),
        "load_wait_s": sum(r["load_wait_s"] for r in warm),
        "bytes_moved": stats.get("host_bytes_moved", 0), "evictions": stats["evictions"],
        "blocks_loaded": stats.get("host_loaded_blocks", 0), "blocks_prefetched": stats.get("host_prefetched_blocks", 0),
    }


def run_kvflow_bench(model: str = "smollm2-135m-instruct", fixed_tokens: tuple[int, ...] = (512, 1024, 2048),
                     output_tokens: tuple[int, ...] = (16, 32, 64), dynamic_tokens: int = 32, agents: int = 10,
                     rounds: int = 3, concurrent: int = 4, links: tuple[str, ...] = ("25", "gpu-ratio"),
                     pool_fraction: float = 0.5, modes: tuple[str, ...] = tuple(MODES), dtype: str = "float32",
                     threads: int = 2, block_size: int = 16, out_dir: str | Path | None = None) -> dict:
    """Points: the fixed-length sweep at the middle output length, the output sweep at the
    middle fixed length, and ``concurrent`` workflows at the middle of both; each point at
    every link and mode (``lru`` does not use a link, so it runs once per point)."""
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        raise KvshareError(f"unknown kvflow bench mode(s) {unknown} (known: {', '.join(MODES)})")
    modes = tuple(m for m in MODES if m in modes)  # lru first: the others' ratios and the gpu-ratio link need it
    if rounds < 2 or agents < 2:
        raise KvshareError("the kvflow bench needs at least 2 agents and 2 rounds (figures are over rounds 2+)")
    for link in links:
        if link != "gpu-ratio":
            _bandwidth(link, None, None)  # a bad link name fails before anything runs
    model_dir = setup(model, threads)
    mid_fixed, mid_out = fixed_tokens[len(fixed_tokens) // 2], output_tokens[len(output_tokens) // 2]
    points = [(f, mid_out, 1) for f in fixed_tokens] + [(mid_fixed, o, 1) for o in output_tokens if o != mid_out]
    if concurrent > 1:
        points.append((mid_fixed, mid_out, concurrent))
    engine = None
    # the gpu-ratio link's prefill time per token, from one workflow's cold calls at each fixed
    # length: at the concurrent point the cold calls queue behind each other, so their time to
    # first token is not one prefill's (the link would come out slower there)
    calibrated: dict[int, tuple[float, int]] = {}
    results, bar = [], tqdm(total=len(points) * len(links) * len(modes), desc="bench kvflow", unit="run")
    for fixed_len, out_len, flows in points:
        per_call = fixed_len + dynamic_tokens + out_len + block_size
        pool = int(pool_fraction * agents * fixed_len) + flows * per_call  # about half the fixed prompts
        host = 2 * agents * per_call * flows
        prefill_s_per_token, kv_bytes_per_token = calibrated.get(fixed_len, (None, None)) if flows > 1 \
            else (None, None)
        for link in links:
            for mode in modes:
                if mode == "lru" and link != links[0]:
                    bar.update()
                    continue  # no host tier: the link does not matter
                settings = dict(MODES[mode], kv_cache_tokens=pool, block_size=block_size, dtype=dtype,
                                max_num_batched_tokens=1024)
                if "host_cache_tokens" in settings:
                    settings["host_cache_tokens"] = host
                if mode != "lru":
                    settings["host_bandwidth_gbps"] = _bandwidth(link, prefill_s_per_token, kv_bytes_per_token)
                del engine  # one engine's KV pool at a time, and its compiled graphs
                release_compiled_graphs()
                engine = LLMEngine(model_dir, **settings)
                engine.warm_up_all()  # each step bucket compiles before the clock, not inside a call
                text = hotpot_text_ids(engine.tokenizer, agents * fixed_len + 4096)
                fixed = [text[i * fixed_len:(i + 1) * fixed_len] for i in range(agents)]
                records, makespan = run_workflows(engine, fixed, text[agents * fixed_len:], flows, rounds,
                                                  dynamic_tokens, out_len)
                if mode == "lru" and prefill_s_per_token is None:  # cold first-round calls
                    cold = sorted(r["ttft_s"] / r["prompt_tokens"] for r in records if r["call"] < agents)
                    prefill_s_per_token, kv_bytes_per_token = cold[len(cold) // 2], engine.kv_bytes_per_token
                    calibrated.setdefault(fixed_len, (prefill_s_per_token, kv_bytes_per_token))
                results.append({"mode": mode, "link": "none" if mode == "lru" else link,
                                "host_bandwidth_gbps": None if mode == "lru" else engine.config.host_bandwidth_gbps,
                                "fixed_tokens": fixed_len, "dynamic_tokens": dynamic_tokens,
                                "output_tokens": out_len, "workflows": flows, "agents": agents, "rounds": rounds,
                                "kv_cache_tokens": pool, "host_cache_tokens": settings.get("host_cache_tokens", 0),
                                **_summary(records, agents, makespan, engine.stats())})
                bar.update()
    bar.close()
    report = {"model": str(model), "dtype": dtype, "threads": threads, "block_size": block_size,
              "pool": f"{pool_fraction} x the agents' fixed prompts + one call per workflow",
              "gpu_load_to_prefill": GPU_LOAD_TO_PREFILL, "records": _with_ratios(results)}
    if out_dir:
        write_report(report, Path(out_dir))
    return report


def _bandwidth(link: str, prefill_s_per_token: float | None, kv_bytes_per_token: int | None) -> float:
    """GB/s for a link name: a number, or 'gpu-ratio' (a token's KV loads in 1/8 of its prefill)."""
    if link != "gpu-ratio":
        try:
            return float(link)
        except ValueError:
            raise KvshareError(f"--links takes GB/s numbers or 'gpu-ratio', not {link!r}") from None
    if prefill_s_per_token is None:
        raise KvshareError("the 'gpu-ratio' link needs the lru mode (it measures the prefill time)")
    return kv_bytes_per_token / (GPU_LOAD_TO_PREFILL * prefill_s_per_token) / 1e9


def _with_ratios(records: list[dict]) -> list[dict]:
    """Add each record's mean-latency speed-up over LRU and over the reactive tier (same point)."""
    def key(r):
        return (r["fixed_tokens"], r["output_tokens"], r["workflows"])

    lru = {key(r): r["mean_latency_s"] for r in records if r["mode"] == "lru"}
    reactive = {(key(r), r["link"]): r["mean_latency_s"] for r in records if r["mode"] == "lru+host"}
    for r in records:
        r["speedup_vs_lru"] = lru[key(r)] / r["mean_latency_s"] if key(r) in lru else None
        base = reactive.get((key(r), r["link"]))
        r["speedup_vs_reactive"] = base / r["mean_latency_s"] if base and r["mode"] != "lru" else None
    return records


def markdown(results: dict) -> str:
    def ratio(x):
        return f"{x:.2f}x" if x else "-"

    lines = ["| fixed | out | workflows | link | mode | mean s | P95 s | TTFT s | fixed hit | recomputed tok | "
             "moved MB | load wait s | vs LRU | vs reactive |", "|" + "---|" * 14]
    for r in results["records"]:
        lines.append(f"| {r['fixed_tokens']} | {r['output_tokens']} | {r['workflows']} | {r['link']} | {r['mode']} | "
                     f"{r['mean_latency_s']:.2f} | {r['p95_latency_s']:.2f} | {r['mean_ttft_s']:.2f} | "
                     f"{r['fixed_hit_rate']:.2f} | {r['tokens_recomputed']} | {r['bytes_moved'] / 1e6:.0f} | "
                     f"{r['load_wait_s']:.2f} | {ratio(r['speedup_vs_lru'])} | {ratio(r['speedup_vs_reactive'])} |")
    return "\n".join(lines) + "\n"


def write_report(results: dict, out_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    _write(results, out_dir, "kvflow_bench", markdown)
    single = [r for r in results["records"] if r["workflows"] == 1]
    outs = sorted({r["output_tokens"] for r in single}, key=lambda o: -sum(x["output_tokens"] == o for x in single))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for mode, link in sorted({(r["mode"], r["link"]) for r in single}):
        pts = sorted((r["fixed_tokens"], r["mean_latency_s"]) for r in single
                     if r["mode"] == mode and r["link"] == link and r["output_tokens"] == outs[0])
        ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=f"{mode} (link {link})")
    ax.set_xlabel("fixed prompt tokens per agent")
    ax.set_ylabel(f"mean agent latency, s ({outs[0]} output tokens)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_dir / "kvflow_latency.png", dpi=110)
    plt.close(fig)
