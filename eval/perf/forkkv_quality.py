"""``kvshare bench forkkv-quality``: what sharing LoRA agents' K/V costs in answers (the ForkKV paper's Table 2).

N lora agents take turns over one shared context: for each example every agent answers the
same QA prompt (HotpotQA distractor or held-out SQuAD, the prompts and F1 of
:mod:`kvshare.eval.qa`), one after another, greedy, in one engine whose adapters are loaded
with the mode's ``kv_layout``:

- ``exact``: each agent's private K/V (the reference; an agent's answer is what it gives alone),
- ``forkkv``: the base part of K/V shared among the agents, a private rank-r residual each,
- ``full_reuse``: a later agent reads the whole K/V of the agent that computed the context.

Which agent goes first rotates per example, so every agent sometimes reads another's K/V.
Exact answers do not depend on the other agents, so the exact mode runs once per task with
every agent and each N reads its agents' answers from it (tested: exact turns equal lone runs).

Divergence: for the first ``cosine_examples`` examples, the second agent's per-layer hidden
states at the prompt's last position (``LLMEngine.hidden_states``) after the first agent
computed the context, cosine against the exact mode's, per layer (mean and min over examples).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from tqdm import tqdm

from ...adapters import ADAPTER_CONFIG, lora_rank
from ...errors import KvshareError
from ...kinds import AdapterKind
from ...serve import LLM
from ...safetensors_io import read_json
from ...serve.sampling_params import SamplingParams
from ..harness import EvalTask, mean_ci95
from ..qa import f1_task
from .common import setup, write_report as _write

MODES = ("exact", "forkkv", "full_reuse")
SHARING = ("forkkv", "full_reuse")


def turn_order(agents: list[str], index: int) -> list[str]:
    """The agents' speaking order for example ``index``: rotated by one each example."""
    shift = index % len(agents)
    return agents[shift:] + agents[:shift]


def agent_engine(model_dir: Path, adapters: list[Path], names: list[str], layout: str, dtype: str,
                 kv_cache_tokens: int, block_size: int | None = None) -> LLM:
    """One engine with every agent's lora adapter loaded under ``kv_layout=layout``."""
    settings = {"kv_cache_tokens": kv_cache_tokens, "dtype": dtype}
    if layout == "forkkv":  # the residual pool as wide as the widest adapter (the bench has no flag for it)
        settings["forkkv_max_rank"] = max(lora_rank(read_json(Path(p) / ADAPTER_CONFIG)) for p in adapters)
    if block_size:
        settings["block_size"] = block_size
    llm = LLM(model_dir, [], **settings)
    for path, name in zip(adapters, names):
        llm.engine.load_adapter(path, name, kv_layout=layout)
        kind = llm.engine.adapter(name).kind
        if kind != AdapterKind.LORA:
            raise KvshareError(f"{path}: forkkv-quality compares lora adapters, this one is {kind.value!r}")
    return llm


def run_turns(llm: LLM, task: EvalTask, agents: list[str], batch: int, desc: str) -> list[dict]:
    """Every agent answers every item, in turns (rotated per item); ``batch`` items advance
    together, turn by turn, so within an item each turn starts once the previous one ended."""
    records = []
    with tqdm(total=len(task.items) * len(agents), desc=desc, unit="answer") as bar:
        for start in range(0, len(task.items), batch):
            chunk = list(enumerate(task.items[start:start + batch], start))
            for turn in range(len(agents)):
                speakers = [turn_order(agents, index)[turn] for index, _ in chunk]
                prompts = [task.prompt(llm.engine, item, agent) for (_, item), agent in zip(chunk, speakers)]
                params = [task.params(item) if callable(task.params) else task.params for _, item in chunk]
                outputs = llm.generate(prompts, params, adapter=speakers)
                for (index, item), agent, prompt, out in zip(chunk, speakers, prompts, outputs):
                    verdict = task.judge(item, out.text)
                    records.append({"id": item["id"], "index": index, "agent": agent, "turn": turn,
                                    "first": turn_order(agents, index)[0], "prompt_tokens": len(prompt),
                                    "cached_tokens": out.metrics["prompt_tokens_cached"],
                                    "output": out.text, "prediction": verdict["prediction"],
                                    "f1": verdict["f1"], "exact_match": verdict["exact_match"]})
                    bar.update()
    return records


def sharing_stats(llm: LLM) -> dict:
    """The engine's counters that show which K/V the agents read."""
    stats = llm.engine.stats()
    # forkkv_base_read_tokens: base parts read, resumed from or not (prefix_hit_tokens_forkkv_base counts
    # only what was resumed with the residual cached too)
    keys = ("prefix_hit_tokens_forkkv_base", "forkkv_base_read_tokens", "prefix_hit_tokens_lora_full_reuse",
            "forkkv_residual_hit_tokens", "prefix_hit_rate", "evictions")
    return {k: stats[k] for k in keys if k in stats}


def summarize_mode(records: list[dict], exact: dict[tuple[str, str], dict]) -> dict:
    """Mean F1/EM over agents and examples, per agent, on the turns that read another agent's
    K/V, and the paired drop vs exact (F1 points, 95% interval of the per-answer differences)."""
    f1 = mean_ci95([r["f1"] for r in records])
    reference = [exact[(r["id"], r["agent"])] for r in records]
    diffs = mean_ci95([(e["f1"] - r["f1"]) * 100 for r, e in zip(records, reference)])
    later = [r for r in records if r["turn"] > 0]
    agents = sorted({r["agent"] for r in records})
    return {"f1": f1["mean"], "f1_ci95": f1["ci95"], "exact_match": mean_ci95([r["exact_match"] for r in records])["mean"],
            "answers": len(records), "drop_vs_exact": diffs["mean"], "drop_ci95": diffs["ci95"],
            "same_answer_as_exact": sum(r["prediction"] == e["prediction"] for r, e in zip(records, reference)) / len(records),
            "later_turns_f1": mean_ci95([r["f1"] for r in later])["mean"] if later else None,
            "later_turns_exact_f1": mean_ci95([exact[(r["id"], r["agent"])]["f1"] for r in later])["mean"] if later else None,
            "per_agent_f1": {a: mean_ci95([r["f1"] for r in records if r["agent"] == a])["mean"] for a in agents}}


def layer_cosines(model_dir: Path, adapters: list[Path], names: list[str], task: EvalTask, examples: int,
                  dtype: str, kv_cache_tokens: int, block_size: int | None = None) -> dict:
    """Per-layer cosine of the second agent's hidden states vs exact, after the first agent
    computed the context (pairs rotate with the turn order), for the sharing modes."""
    items = task.items[:examples]
    states: dict[str, list[torch.Tensor]] = {}
    for layout in MODES:
        llm = agent_engine(model_dir, adapters, names, layout, dtype, kv_cache_tokens, block_size)
        states[layout] = []
        for index, item in enumerate(tqdm(items, desc=f"{task.name} cosine {layout}", unit="example")):
            llm.engine.reset_prefix_cache()  # each example: only the first agent's context is cached
            first, second = turn_order(names, index)[:2]
            if layout != "exact":  # exact K/V is private: the first agent's run changes nothing there
                llm.generate([task.prompt(llm.engine, item, first)], SamplingParams(max_tokens=1), adapter=first)
            states[layout].append(llm.engine.hidden_states(task.prompt(llm.engine, item, second), second))
    exact = torch.stack(states["exact"])  # (examples, layers, hidden)
    result = {"examples": len(items), "pairs": [turn_order(names, i)[:2] for i in range(len(items))]}
    for layout in SHARING:
        cosine = torch.nn.functional.cosine_similarity(torch.stack(states[layout]), exact, dim=-1)  # (examples, layers)
        result[layout] = {"mean": cosine.mean(0).tolist(), "min": cosine.min(0).values.tolist()}
    return result


def run_forkkv_quality(adapters: list[str | Path], model: str = "smollm2-135m-instruct",
                       tasks: tuple[str, ...] = ("hotpotqa", "squad"), agent_counts: tuple[int, ...] = (2, 4),
                       limit: int = 40, cosine_examples: int = 8, max_tokens: int = 32, batch: int = 4,
                       dtype: str = "float32", threads: int = 2, kv_cache_tokens: int = 16384,
                       block_size: int | None = None, out_dir: str | Path | None = None) -> dict:
    """The quality table (F1 per task, N and mode; drops vs exact) and the per-layer cosines.
    N agents are the first N of ``adapters``."""
    adapters = [Path(a) for a in adapters]
    if not agent_counts or min(agent_counts) < 2 or max(agent_counts) > len(adapters):
        raise KvshareError(f"--agents must be between 2 and the number of adapters ({len(adapters)})")
    for path in adapters:
        if not (path / "kvshare.json").is_file():
            raise KvshareError(f"{path} is not an exported kvshare adapter (no kvshare.json)")
    model_dir = setup(model, threads)
    names = [f"agent{i}-{p.parent.name if p.name == 'adapter' else p.name}" for i, p in enumerate(adapters)]
    largest = max(agent_counts)
    results = {"model": str(model), "dtype": dtype, "threads": threads, "limit": limit, "max_tokens": max_tokens,
               "agents": {n: str(p) for n, p in zip(names, adapters)}, "agent_counts": list(agent_counts),
               "quality": [], "cosine": {}, "stats": {}, "seconds": {}}
    samples = []
    for dataset in tasks:
        task = f1_task(dataset, limit, max_tokens)
        if not task.items:
            raise KvshareError(f"{dataset}: no evaluation items found")
        started = time.perf_counter()
        llm = agent_engine(model_dir, adapters[:largest], names[:largest], "exact", dtype, kv_cache_tokens, block_size)
        exact_records = run_turns(llm, task, names[:largest], batch, f"{dataset} exact N={largest}")
        results["stats"][f"{dataset}/exact"] = sharing_stats(llm)
        del llm
        exact = {(r["id"], r["agent"]): r for r in exact_records}
        samples += [{"task": dataset, "mode": "exact", "agents": largest, **r} for r in exact_records]
        for n in agent_counts:
            agents = names[:n]
            row = {"task": dataset, "agents": n, "examples": len(task.items), "modes": {}}
            row["modes"]["exact"] = summarize_mode([r for r in exact_records if r["agent"] in agents], exact)
            for layout in SHARING:
                llm = agent_engine(model_dir, adapters[:n], agents, layout, dtype, kv_cache_tokens, block_size)
                records = run_turns(llm, task, agents, batch, f"{dataset} {layout} N={n}")
                results["stats"][f"{dataset}/{layout}/N={n}"] = sharing_stats(llm)
                del llm
                row["modes"][layout] = summarize_mode(records, exact)
                samples += [{"task": dataset, "mode": layout, "agents": n, **r} for r in records]
            results["quality"].append(row)
        if cosine_examples:
            results["cosine"][dataset] = layer_cosines(model_dir, adapters[:largest], names[:largest], task,
                                                       cosine_examples, dtype, kv_cache_tokens, block_size)
        results["seconds"][dataset] = time.perf_counter() - started
    results["average"] = average_drops(results["quality"])
    results["samples"] = samples
    if out_dir:
        write_report(results, Path(out_dir))
    return results


def average_drops(rows: list[dict]) -> dict:
    """Mean F1 drop vs exact over every (task, N) row, per sharing mode (the paper's headline)."""
    return {layout: sum(r["modes"][layout]["drop_vs_exact"] for r in rows) / len(rows) for layout in SHARING} if rows else {}


def _interval(values: list[float]) -> str:
    return f"[{values[0]:+.1f}, {values[1]:+.1f}]"


def markdown(results: dict) -> str:
    lines = [f"Model {results['model']}, {results['dtype']}, {results['threads']} threads, greedy, "
             f"max {results['max_tokens']} tokens; examples = the first n of each task. "
             "F1 x 100, mean over agents and examples; drop = exact - mode in F1 points (95% interval "
             "of the paired per-answer differences); 'same' = answers identical to exact.", "",
             "| task | N | n | exact F1 | ForkKV F1 | ForkKV drop | same | full reuse F1 | full-reuse drop | same |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in results["quality"]:
        e, f, u = (row["modes"][m] for m in MODES)
        lines.append(f"| {row['task']} | {row['agents']} | {row['examples']} | {e['f1'] * 100:.2f} | {f['f1'] * 100:.2f} | "
                     f"{f['drop_vs_exact']:+.2f} {_interval(f['drop_ci95'])} | {f['same_answer_as_exact']:.0%} | "
                     f"{u['f1'] * 100:.2f} | {u['drop_vs_exact']:+.2f} {_interval(u['drop_ci95'])} | "
                     f"{u['same_answer_as_exact']:.0%} |")
    avg = results.get("average") or {}
    if avg:
        lines.append(f"| **average** | | | | | **{avg['forkkv']:+.2f}** | | | **{avg['full_reuse']:+.2f}** | |")
    lines += ["", "Turns after the first only (the answers that read another agent's K/V), F1 x 100:", "",
              "| task | N | exact | ForkKV | full reuse |", "|---|---|---|---|---|"]
    for row in results["quality"]:
        f, u = row["modes"]["forkkv"], row["modes"]["full_reuse"]
        lines.append(f"| {row['task']} | {row['agents']} | {f['later_turns_exact_f1'] * 100:.2f} | "
                     f"{f['later_turns_f1'] * 100:.2f} | {u['later_turns_f1'] * 100:.2f} |")
    if results["cosine"]:
        tasks = list(results["cosine"])
        lines += ["", "Per-layer cosine of the second agent's hidden states vs exact (mean / min over examples; "
                  + ", ".join(f"{t}: {results['cosine'][t]['examples']} examples" for t in tasks) + "):", "",
                  "| layer | " + " | ".join(f"{t} ForkKV | {t} full reuse" for t in tasks) + " |",
                  "|---|" + "---|---|" * len(tasks)]
        layers = len(results["cosine"][tasks[0]]["forkkv"]["mean"])
        for layer in range(layers):
            cells = []
            for t in tasks:
                for m in SHARING:
                    c = results["cosine"][t][m]
                    cells.append(f"{c['mean'][layer]:.4f} / {c['min'][layer]:.4f}")
            lines.append(f"| {layer} | " + " | ".join(cells) + " |")
        for t in tasks:
            c = results["cosine"][t]
            lines.append("")
            lines.append(f"{t}: lowest layer mean ForkKV {min(c['forkkv']['mean']):.4f}, full reuse "
                         f"{min(c['full_reuse']['mean']):.4f}; lowest single example ForkKV "
                         f"{min(c['forkkv']['min']):.4f}, full reuse {min(c['full_reuse']['min']):.4f}.")
    return "\n".join(lines) + "\n"


def write_report(results: dict, out_dir: Path) -> None:
    """quality.json (figures, without the answers), quality.md, quality_samples.jsonl (every
    answer) and cosine.png."""
    out_dir.mkdir(parents=True, exist_ok=True)
    _write({k: v for k, v in results.items() if k != "samples"}, out_dir, "quality", markdown)
    with open(out_dir / "quality_samples.jsonl", "w", encoding="utf-8") as handle:
        for record in results.get("samples", []):
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")
    if results["cosine"]:
        plot_cosines(results, out_dir / "cosine.png")


def plot_cosines(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for task, cos in results["cosine"].items():
        for layout, style in (("forkkv", "-"), ("full_reuse", "--")):
            ax.plot(cos[layout]["mean"], linestyle=style, marker=".",
                    label=f"{task} {'ForkKV' if layout == 'forkkv' else 'full reuse'} (mean)")
    ax.set_xlabel("decoder layer")
    ax.set_ylabel("cosine vs exact hidden state")
    ax.set_title("second agent's hidden states over a context another agent computed")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
