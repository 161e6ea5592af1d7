"""``kvshare bench swiftcache``: what lending idle KV between co-located models buys.

A long-context model and ``agents`` small chat engines share one KV arena
(:func:`~kvshare.serve.driver.colocation.colocate`); each engine's home share is its static
partition. Modes, run one after the other in one process on the same requests:
- ``static``: the arena stays a static partition (``colocate(..., lending=False)``);
- ``lending``: idle blocks move between the engines (SwiftCache's elastic cache);
- ``lending+stream``: lending, and the long model's home share becomes a layer buffer and home
  blocks (``kv_stream``, split by :func:`kvshare.serve.driver.lender.stream_split`); every layer of
  its KV streams through the buffer, from its home blocks and what the agents lend. On one device
  lent blocks are directly addressable, so this mode shows the stream's cost: it pays off
  only where the lender's memory is not (another GPU), which this machine cannot show.

Two figures per mode:
1. **Maximum context served**: the longest prompt the long model accepts (one token more is
   refused), served for real (greedy, a few tokens) on a fresh co-location.
2. **Mixed workload**: long documents (60-90% of the long model's home share each, so one
   fits its static share and two do not) arrive at the long model and multi-turn chats at
   the agents, both as seeded Poisson processes; one thread adds a request once its arrival
   time has passed and steps the co-location. TTFT counts from the arrival time, so a
   request that waits for memory (or for a step in progress) pays for it.

Lending can only cut the waits for memory, not those for compute: the report's "queued"
column (arrival to first step) is, in the static mode, exactly the long requests' memory
wait, so it says whether a workload tests lending at all. The defaults put a burst of long
documents on the long model while the agents stay light (their memory mostly idle).
"""

from __future__ import annotations

import gc
import json
import math
import os
import platform
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from ...errors import KvshareError
from ...models import resolve_model_dir
from ...splits import require_data_dir
from ...serve.driver.colocation import Colocation, colocate
from ...serve.config import EngineConfig
from ...serve.sampling_params import SamplingParams
from .common import percentile, setup, write_report as _write
from .kvflow import hotpot_text_ids

MODES = ("static", "lending", "lending+stream")
LONG = "long"  # the long model's served name; the agents are agent0, agent1, ...
MAX_CONTEXT_OUTPUT = 4  # tokens the maximum-context request generates
STALL_S = 300.0  # no token from any engine for this long while work remains: something is stuck
GOALS = {"max_context_ratio": 2.0, "long_p99_ttft_reduction": 0.40, "agent_slowdown": 1.10}


@dataclass(frozen=True)
class Arrival:
    """One request of the mixed workload: when it arrives (seconds after the start) and where."""

    at: float
    engine: str
    kind: str  # "long" or "chat"
    prompt: list[int]
    max_tokens: int


# the workload --------------------------------------------------------------------------------
def long_documents(tokenizer, lengths: list[int]) -> list[list[int]]:
    """Disjoint spans of HotpotQA paragraphs, one per length (no two share a prefix block)."""
    text = hotpot_text_ids(tokenizer, sum(lengths))
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    return [text[s:s + n] for s, n in zip(starts, lengths)]


def chat_prompts(engine, count: int, mean_tokens: int, rng: random.Random) -> list[list[int]]:
    """``count`` ShareGPT-like conversations from Alpaca: earlier turns (instruction, answer)
    then a new instruction, through the model's chat template, each about ``mean_tokens``
    long (uniform in 0.5-1.5x)."""
    with open(require_data_dir() / "alpaca" / "alpaca_small.json", encoding="utf-8") as handle:
        records = json.load(handle)
    rng.shuffle(records)
    turns = iter(records * (1 + count))

    def user(record: dict) -> dict:
        text = record["instruction"] + (f"\n\n{record['input']}" if record["input"] else "")
        return {"role": "user", "content": text[:400]}

    prompts = []
    for _ in range(count):
        target = rng.randint(max(1, mean_tokens // 2), max(1, mean_tokens * 3 // 2))
        history: list[dict] = []
        while True:
            prompt = engine.chat_prompt(history + [user(next(turns))])
            if len(prompt) >= target or len(history) >= 40:
                break
            record = next(turns)
            history += [user(record), {"role": "assistant", "content": record["output"][:400]}]
        prompts.append(prompt)
    return prompts


def workload(colo: Colocation, agents: list[str], long_requests: int, long_qps: float,
             long_fraction: tuple[float, float], long_output: int, chats: int, chat_qps: float,
             chat_tokens: int, chat_output: int, home_tokens: int, seed: int) -> list[Arrival]:
    """The mixed workload's requests in arrival order (the same for every mode: seeded; the
    long requests and the chats draw from their own streams, so changing one leaves the other)."""
    long_rng, chat_rng = random.Random(f"long-{seed}"), random.Random(f"chat-{seed}")
    lo, hi = long_fraction
    lengths = [round(long_rng.uniform(lo, hi) * home_tokens) - long_output for _ in range(long_requests)]
    docs = long_documents(colo.engines[LONG].tokenizer, lengths)
    talks = chat_prompts(colo.engines[agents[0]], chats, chat_tokens, chat_rng)
    arrivals, at = [], 0.0
    for doc in docs:
        arrivals.append(Arrival(at, LONG, "long", doc, long_output))
        at += long_rng.expovariate(long_qps)
    at = chat_rng.expovariate(chat_qps)
    for i, talk in enumerate(talks):
        arrivals.append(Arrival(at, agents[i % len(agents)], "chat", talk, chat_output))
        at += chat_rng.expovariate(chat_qps)
    return sorted(arrivals, key=lambda a: a.at)


# one co-location -----------------------------------------------------------------------------
def build(model: Path, agent_model: Path, agents: int, home_tokens: int, agent_home_tokens: int,
          config: EngineConfig, mode: str) -> Colocation:
    """The long model and ``agents`` agent engines in one arena, each with its home share (the
    long model's is its layer buffer in ``lending+stream``)."""
    long_config = config.updated(kv_cache_tokens=home_tokens, kv_stream=mode == "lending+stream")
    specs = [(str(model), [], long_config, LONG)]
    specs += [(str(agent_model), [], config.updated(kv_cache_tokens=agent_home_tokens), f"agent{i}")
              for i in range(agents)]
    return colocate(specs, lending=mode != "static")


def block_bytes(colo: Colocation) -> dict[str, int]:
    return {name: engine.block_shape.block_bytes for name, engine in colo.engines.items()}


def lent_bytes(colo: Colocation, sizes: dict[str, int]) -> int:
    """Bytes of the engines' home shares that another engine holds now."""
    return sum(s["lent_blocks"] * sizes[name] for name, s in colo.stats().items())


def max_context(colo: Colocation) -> dict:
    """The longest request the long model accepts (one token more is refused), served for real."""
    engine = colo.engines[LONG]
    blocks = engine.max_kv_blocks or engine.num_kv_blocks
    context = min(blocks * engine.block_size, engine.max_model_len)
    prompt_tokens = context - MAX_CONTEXT_OUTPUT
    params = SamplingParams(max_tokens=MAX_CONTEXT_OUTPUT, ignore_eos=True)
    prompt = long_documents(engine.tokenizer, [prompt_tokens + 1])[0]
    try:
        colo.add_request(LONG, prompt, params)
        refused = False
    except KvshareError:
        refused = True
    if not refused:
        raise KvshareError(f"the long model accepted {prompt_tokens + 1} + {MAX_CONTEXT_OUTPUT} tokens, "
                           f"more than the {context} its KV memory ({blocks} blocks) holds")
    start = time.perf_counter()
    request = colo.add_request(LONG, prompt[:prompt_tokens], params)
    out = None
    while colo.has_unfinished():
        out = next((o for o in colo.step() if o.request_id == request and o.finished), out)
    if out is None or out.finish_reason != "length" or len(out.token_ids) != MAX_CONTEXT_OUTPUT:
        raise KvshareError(f"the maximum-context request did not finish: {out and out.finish_reason}")
    return {"context_tokens": context, "prompt_tokens": prompt_tokens, "output_tokens": len(out.token_ids),
            "kv_blocks": blocks, "bound": "max_model_len" if context < blocks * engine.block_size else "kv_memory",
            "ttft_s": out.metrics["time_to_first_token"], "wall_s": time.perf_counter() - start,
            "refuses_one_more_token": refused}


def warm_up(colo: Colocation) -> None:
    """Compile every engine's step buckets (a compiled CPU step compiles each on first use:
    before the clock, not inside the run), then one short request per engine, so that the
    first measured steps do not pay for torch's first calls."""
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    for name, engine in colo.engines.items():
        engine.warm_up_all()
        colo.add_request(name, list(range(5, 21)), params)
    while colo.has_unfinished():
        colo.step()


def run_mixed(colo: Colocation, arrivals: list[Arrival], bar: tqdm) -> tuple[list[dict], list[dict]]:
    """Drive the co-location through ``arrivals`` in one thread; one record per request and
    a timeline (after every step: time, lent bytes, the long model's KV bytes)."""
    sizes = block_bytes(colo)
    pending = list(arrivals)
    added: dict[str, tuple[Arrival, float]] = {}
    records, timeline = [], []
    start = last_token = time.perf_counter()
    while pending or colo.has_unfinished():
        now = time.perf_counter() - start
        while pending and pending[0].at <= now:
            arrival = pending.pop(0)
            params = SamplingParams(max_tokens=arrival.max_tokens, ignore_eos=True)
            request = colo.add_request(arrival.engine, arrival.prompt, params)
            added[request] = (arrival, time.perf_counter() - start)
        if not colo.has_unfinished():
            time.sleep(max(0.0, pending[0].at - (time.perf_counter() - start)))
            continue
        outputs = colo.step()
        stepped = time.perf_counter()
        if outputs:
            last_token = stepped
        elif stepped - last_token > STALL_S:
            raise KvshareError(f"no engine produced a token for {STALL_S:.0f} s with requests waiting: "
                               f"{colo.stats()}")
        timeline.append({"t_s": stepped - start, "lent_bytes": lent_bytes(colo, sizes),
                         "long_kv_bytes": colo.engines[LONG].num_kv_blocks * sizes[LONG]})
        for out in outputs:
            if not out.finished:
                continue
            arrival, added_at = added.pop(out.request_id)
            m, n = out.metrics, len(out.token_ids)
            ttft = added_at - arrival.at + m["time_to_first_token"]
            records.append({"engine": arrival.engine, "kind": arrival.kind, "arrival_s": arrival.at,
                            "prompt_tokens": len(arrival.prompt), "output_tokens": n,
                            "finish_reason": out.finish_reason, "ttft_s": ttft,
                            "queue_s": added_at - arrival.at + m["queue_time"],
                            "tpot_s": (m["e2e_time"] - m["time_to_first_token"]) / (n - 1) if n > 1 else None,
                            "e2e_s": added_at - arrival.at + m["e2e_time"], "preemptions": m["preemptions"]})
            bar.update()
    return sorted(records, key=lambda r: r["arrival_s"]), timeline


def summarize(records: list[dict], timeline: list[dict], colo: Colocation) -> dict:
    """Per-mode figures: long TTFT percentiles, agents' TTFT and TPOT, lent bytes, moves."""
    long = [r["ttft_s"] for r in records if r["kind"] == "long"]
    queued = [r["queue_s"] for r in records if r["kind"] == "long"]
    chats = [r for r in records if r["kind"] == "chat"]
    ttft = [r["ttft_s"] for r in chats]
    tpot = [r["tpot_s"] for r in chats if r["tpot_s"] is not None]
    lent = [p["lent_bytes"] for p in timeline]
    spans = [b["t_s"] - a["t_s"] for a, b in zip(timeline, timeline[1:])]
    lending = colo.lending
    counters = lending.counters if lending is not None else None
    return {
        "requests": len(records), "failed": sum(r["finish_reason"] not in ("length", "stop") for r in records),
        "makespan_s": timeline[-1]["t_s"] if timeline else 0.0,
        "long_requests": len(long), "long_p50_ttft_s": percentile(long, 0.5), "long_p99_ttft_s": percentile(long, 0.99),
        "long_mean_ttft_s": sum(long) / len(long) if long else math.nan,
        # before its first step: in the static mode only memory keeps a long request waiting
        "long_mean_queue_s": sum(queued) / len(queued) if queued else math.nan,
        "long_max_queue_s": max(queued, default=math.nan),
        "chats": len(chats), "agent_mean_ttft_s": sum(ttft) / len(ttft) if ttft else math.nan,
        "agent_p99_ttft_s": percentile(ttft, 0.99), "agent_mean_tpot_s": sum(tpot) / len(tpot) if tpot else math.nan,
        "agent_p99_tpot_s": percentile(tpot, 0.99),
        "max_lent_bytes": max(lent, default=0),
        "mean_lent_bytes": sum(x * s for x, s in zip(lent, spans)) / sum(spans) if sum(spans) > 0 else 0.0,
        "max_long_kv_bytes": max((p["long_kv_bytes"] for p in timeline), default=0),
        "units_moved": lending.arena.units_moved if lending is not None else 0,
        "units_lent": counters.units_lent if counters else 0,
        "units_reclaimed": counters.units_reclaimed if counters else 0,
        "units_returned": counters.units_returned if counters else 0,
        "reclaim_preemptions": counters.preempted if counters else 0,
        "engine_preemptions": {name: e.stats()["preemptions"] for name, e in colo.engines.items()},
        "long_requests_preempted": sum(r["preemptions"] > 0 for r in records if r["kind"] == "long"),
        "long_stream": colo.lenders[LONG].stream_stats(),  # the layer stream's loads and stalls, if any
    }


def ratios(modes: dict[str, dict]) -> dict:
    """Lending against static: what the issue's goals are stated in (None without both)."""
    if not {"static", "lending"} <= set(modes):
        return {}
    s, g = modes["static"], modes["lending"]
    sm, gm = s["mixed"], g["mixed"]
    out = {"max_context_ratio": g["max_context"]["context_tokens"] / s["max_context"]["context_tokens"],
           "long_p99_ttft_reduction": 1 - gm["long_p99_ttft_s"] / sm["long_p99_ttft_s"],
           "long_p50_ttft_reduction": 1 - gm["long_p50_ttft_s"] / sm["long_p50_ttft_s"]}
    for key in ("agent_mean_ttft_s", "agent_p99_ttft_s", "agent_mean_tpot_s", "agent_p99_tpot_s"):
        out[key.replace("_s", "") + "_ratio"] = gm[key] / sm[key]
    out["goals"] = {
        "max_context_ratio": out["max_context_ratio"] >= GOALS["max_context_ratio"],
        "long_p99_ttft_reduction": out["long_p99_ttft_reduction"] >= GOALS["long_p99_ttft_reduction"],
        "agents_within_10pct": all(out[k] <= GOALS["agent_slowdown"] for k in
                                   ("agent_mean_ttft_ratio", "agent_mean_tpot_ratio")),
    }
    return out


# the bench -----------------------------------------------------------------------------------
def _check(agents: int, home_tokens: int, agent_home_tokens: int, long_requests: int, chats: int, long_qps: float,
           chat_qps: float, long_fraction: tuple[float, float], long_output: int, chat_tokens: int,
           chat_output: int, block_size: int, modes: tuple[str, ...]) -> None:
    """Refuse settings the bench cannot run or that would measure nothing, before loading a model."""
    unknown = sorted(set(modes) - set(MODES))
    if unknown or not modes:
        raise KvshareError(f"unknown swiftcache bench mode(s) {unknown} (known: {', '.join(MODES)})")
    if not 1 <= agents <= 8:
        raise KvshareError("--agents must be between 1 and 8")
    for flag, value in (("--long-requests", long_requests), ("--chats", chats), ("--long-output-tokens", long_output),
                        ("--chat-tokens", chat_tokens), ("--chat-output-tokens", chat_output)):
        if value < 1:
            raise KvshareError(f"{flag} must be at least 1")
    if not (long_qps > 0 and chat_qps > 0):
        raise KvshareError("--long-qps and --chat-qps must be positive")
    lo, hi = long_fraction
    if not 0.5 < lo <= hi <= 1:
        raise KvshareError("--long-fraction LO HI needs 0.5 < LO <= HI <= 1 (one long request fits the home share, "
                           "two do not)")
    if round(lo * home_tokens) - long_output < block_size:
        raise KvshareError(f"--home-tokens {home_tokens} leaves no room for a long prompt beside "
                           f"{long_output} output tokens")
    if agent_home_tokens < 2 * (chat_tokens + chat_output):
        raise KvshareError(f"--agent-home-tokens {agent_home_tokens} must hold two chats "
                           f"(2 x ({chat_tokens} + {chat_output}) tokens)")


def run_swiftcache_bench(model: str = "smollm2-135m-instruct", agent_model: str | None = None, agents: int = 2,
                         home_tokens: int = 1024, agent_home_tokens: int = 1024, long_requests: int = 10,
                         long_qps: float = 0.1, long_fraction: tuple[float, float] = (0.6, 0.9),
                         long_output: int = 64, chats: int = 8, chat_qps: float = 0.1, chat_tokens: int = 256,
                         chat_output: int = 32, block_size: int = 16, chunk_tokens: int = 256,
                         modes: tuple[str, ...] = MODES, seed: int = 0, dtype: str = "float32", threads: int = 2,
                         out_dir: str | Path | None = None) -> dict:
    """Both figures for every mode (each part on a fresh co-location), ratios and goals."""
    _check(agents, home_tokens, agent_home_tokens, long_requests, chats, long_qps, chat_qps, long_fraction,
           long_output, chat_tokens, chat_output, block_size, modes)
    modes = tuple(m for m in MODES if m in modes)
    model_dir = setup(model, threads)
    agent_dir = resolve_model_dir(agent_model) if agent_model else model_dir
    config = EngineConfig(dtype=dtype, block_size=block_size, max_num_batched_tokens=chunk_tokens)
    names = [f"agent{i}" for i in range(agents)]
    settings = {"model": str(model), "agent_model": str(agent_model or model), "agents": agents,
                "home_tokens": home_tokens, "agent_home_tokens": agent_home_tokens, "long_requests": long_requests,
                "long_qps": long_qps, "long_fraction": list(long_fraction), "long_output_tokens": long_output,
                "chats": chats, "chat_qps": chat_qps, "chat_tokens": chat_tokens, "chat_output_tokens": chat_output,
                "block_size": block_size, "chunk_tokens": chunk_tokens, "modes": list(modes), "seed": seed,
                "dtype": dtype, "threads": threads}
    results: dict = {"settings": settings, "command": command_line(settings, out_dir), "machine": machine(threads),
                     "modes": {}}
    arrivals = None
    for mode in modes:
        bar = tqdm(total=1 + long_requests + chats, desc=f"bench swiftcache {mode}", unit="request")
        colo = build(model_dir, agent_dir, agents, home_tokens, agent_home_tokens, config, mode)
        biggest = max_context(colo)
        bar.update()
        del colo
        gc.collect()
        colo = build(model_dir, agent_dir, agents, home_tokens, agent_home_tokens, config, mode)
        home_blocks = {name: engine.num_kv_blocks for name, engine in colo.engines.items()}
        arrivals = arrivals or workload(colo, names, long_requests, long_qps, long_fraction, long_output, chats,
                                        chat_qps, chat_tokens, chat_output, home_tokens, seed)
        warm_up(colo)
        records, timeline = run_mixed(colo, arrivals, bar)
        bar.close()
        results["modes"][mode] = {"max_context": biggest, "mixed": summarize(records, timeline, colo),
                                  "block_bytes": block_bytes(colo), "home_blocks": home_blocks,
                                  "records": records, "timeline": timeline}
        del colo
        gc.collect()
    results["ratios"] = ratios(results["modes"])
    if out_dir:
        write_report(results, Path(out_dir))
    return results


def command_line(settings: dict, out_dir: str | Path | None) -> str:
    """The command that reproduces this run (every setting spelled out)."""
    s = settings
    parts = ["kvshare bench swiftcache", f"--model {s['model']}"]
    if s["agent_model"] != s["model"]:
        parts.append(f"--agent-model {s['agent_model']}")
    parts += [f"--agents {s['agents']}", f"--home-tokens {s['home_tokens']}",
              f"--agent-home-tokens {s['agent_home_tokens']}", f"--long-requests {s['long_requests']}",
              f"--long-qps {s['long_qps']}", f"--long-fraction {s['long_fraction'][0]} {s['long_fraction'][1]}",
              f"--long-output-tokens {s['long_output_tokens']}", f"--chats {s['chats']}",
              f"--chat-qps {s['chat_qps']}", f"--chat-tokens {s['chat_tokens']}",
              f"--chat-output-tokens {s['chat_output_tokens']}", f"--block-size {s['block_size']}",
              f"--chunk-tokens {s['chunk_tokens']}", f"--modes {' '.join(s['modes'])}", f"--seed {s['seed']}",
              f"--dtype {s['dtype']}", f"--threads {s['threads']}"]
    if out_dir:
        parts.append(f"--out {out_dir}")
    return " ".join(parts)


def machine(threads: int) -> dict:
    """What the figures were measured on."""
    cpu = platform.processor() or platform.machine()
    try:
        text = Path("/proc/cpuinfo").read_text()
        cpu = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {"cpu": cpu, "cpu_count": os.cpu_count(), "torch_threads": threads, "torch": torch.__version__,
            "cpu_capability": torch.backends.cpu.get_cpu_capability()}


# the report ----------------------------------------------------------------------------------
def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:+.0%}"


def _x(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def _met(ok: bool | None) -> str:
    return "-" if ok is None else ("met" if ok else "not met")


def markdown(results: dict) -> str:
    s, m = results["settings"], results["machine"]
    r = results["ratios"]
    goals = r.get("goals", {})
    lines = [f"`{results['command']}`", "",
             f"Machine: {m['cpu']}, {m['cpu_count']} CPUs, {m['torch_threads']} torch threads, {s['dtype']}, "
             f"torch {m['torch']} ({m['cpu_capability']}). Long model {s['model']} (home {s['home_tokens']} tokens), "
             f"{s['agents']} agent engines of {s['agent_model']} (home {s['agent_home_tokens']} tokens each), "
             f"block size {s['block_size']}.", "",
             "`lending+stream`: the long model's home share becomes a layer buffer and home blocks in the arena "
             "(rows = home + what the agents can lend), and every layer of its KV streams through the buffer "
             "(simulated link on CPU). On one device lent blocks are "
             "directly addressable, so it costs here what it would save across devices. Its steps run eager "
             "(the compiled CPU step takes no streamed cache) where the other modes' run compiled: its cost "
             "against `lending` includes that gap.", "",
             "**Maximum context served by the long model** (one token more is refused; served for real, "
             f"greedy, {MAX_CONTEXT_OUTPUT} tokens)", "",
             "| mode | context tokens | prompt tokens | KV blocks | bound | TTFT s |", "|---|---|---|---|---|---|"]
    for mode, res in results["modes"].items():
        c = res["max_context"]
        lines.append(f"| {mode} | {c['context_tokens']} | {c['prompt_tokens']} | {c['kv_blocks']} | {c['bound']} | "
                     f"{c['ttft_s']:.1f} |")
    if r:
        lines.append(f"\nlending / static: **{_x(r['max_context_ratio'])}** "
                     f"(goal >= {GOALS['max_context_ratio']:.0f}x: "
                     f"{_met(goals.get('max_context_ratio'))})")
    lines += ["", f"**Mixed workload**: {s['long_requests']} long documents ({s['long_fraction'][0]:.0%}-"
              f"{s['long_fraction'][1]:.0%} of the long model's home share, {s['long_output_tokens']} output tokens, "
              f"{s['long_qps']} req/s) and {s['chats']} chats (about {s['chat_tokens']} prompt tokens, "
              f"{s['chat_output_tokens']} output tokens, {s['chat_qps']} req/s over the agents); seed {s['seed']}. "
              "P99 is the nearest rank (with few requests: the slowest). Queued: arrival to first step (in the "
              "static mode a long request waits only for memory).", "",
              "| mode | long P50 TTFT s | long P99 TTFT s | long queued s mean / max | agent TTFT s mean / P99 | "
              "agent TPOT ms mean / P99 | lent MiB max / mean | units moved | reclaims | reclaim preemptions | "
              "long preempted | failed | makespan s |", "|" + "---|" * 13]
    for mode, res in results["modes"].items():
        x = res["mixed"]
        lines.append(f"| {mode} | {x['long_p50_ttft_s']:.2f} | {x['long_p99_ttft_s']:.2f} | "
                     f"{x['long_mean_queue_s']:.2f} / {x['long_max_queue_s']:.2f} | "
                     f"{x['agent_mean_ttft_s']:.2f} / {x['agent_p99_ttft_s']:.2f} | "
                     f"{1000 * x['agent_mean_tpot_s']:.0f} / {1000 * x['agent_p99_tpot_s']:.0f} | "
                     f"{x['max_lent_bytes'] / 2**20:.1f} / {x['mean_lent_bytes'] / 2**20:.1f} | {x['units_moved']} | "
                     f"{x['units_reclaimed']} | {x['reclaim_preemptions']} | {x['long_requests_preempted']} | "
                     f"{x['failed']} | {x['makespan_s']:.0f} |")
    for mode, res in results["modes"].items():
        stream = res["mixed"]["long_stream"]
        if stream:
            lines.append(f"\n`{mode}`: the long model streamed {stream['stream_bytes_loaded'] / 2**30:.2f} GiB "
                         f"({stream['stream_layers_loaded']} layer loads), wrote back "
                         f"{stream['stream_bytes_written_back'] / 2**20:.1f} MiB and waited "
                         f"{stream['stream_stall_seconds']:.2f} s for layers in flight.")
    if r:
        lines += ["", "| lending vs static | value | goal |", "|---|---|---|",
                  f"| long P99 TTFT | {_pct(-r['long_p99_ttft_reduction'])} | <= -40%: "
                  f"{_met(goals['long_p99_ttft_reduction'])} |",
                  f"| long P50 TTFT | {_pct(-r['long_p50_ttft_reduction'])} | - |",
                  f"| agent TTFT mean / P99 | {_x(r['agent_mean_ttft_ratio'])} / {_x(r['agent_p99_ttft_ratio'])} | "
                  f"mean <= 1.10x: {_met(r['agent_mean_ttft_ratio'] <= GOALS['agent_slowdown'])} |",
                  f"| agent TPOT mean / P99 | {_x(r['agent_mean_tpot_ratio'])} / {_x(r['agent_p99_tpot_ratio'])} | "
                  f"mean <= 1.10x: {_met(r['agent_mean_tpot_ratio'] <= GOALS['agent_slowdown'])} |"]
    return "\n".join(lines) + "\n"


def write_report(results: dict, out_dir: Path) -> None:
    """JSON, markdown, and a plot of the long requests' TTFT CDF and KV held over time per
    mode (skipped, with a line in the markdown, without matplotlib)."""
    try:
        import matplotlib
    except ImportError:
        _write(results, out_dir, "swiftcache_bench",
               lambda res: markdown(res) + "\nNo plot: matplotlib is not installed.\n")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    _write(results, out_dir, "swiftcache_bench", markdown)
    fig, (cdf, held) = plt.subplots(1, 2, figsize=(11, 4.2))
    for mode, res in results["modes"].items():
        ttft = sorted(r["ttft_s"] for r in res["records"] if r["kind"] == "long")
        cdf.step(ttft, [(i + 1) / len(ttft) for i in range(len(ttft))], where="post", label=mode)
        line = res["timeline"]
        held.plot([p["t_s"] for p in line], [p["long_kv_bytes"] / 2**20 for p in line],
                  label=f"{mode}: KV memory the long model holds")
        if any(p["lent_bytes"] for p in line):
            held.plot([p["t_s"] for p in line], [p["lent_bytes"] / 2**20 for p in line], linestyle="--",
                      label=f"{mode}: lent (all engines)")
    cdf.set_xlabel("long request TTFT, s")
    cdf.set_ylabel("fraction of long requests")
    held.set_xlabel("time, s")
    held.set_ylabel("MiB")
    for ax in (cdf, held):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_dir / "swiftcache_bench.png", dpi=110)
    plt.close(fig)
