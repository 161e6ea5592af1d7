"""The quality suite: per-task quality of each adapter kind, and the orchestrated system
(the ICaRus paper's Table 4), from one YAML spec.

Each *system* is one served engine holding the base and three specialists of one kind (math,
code, QA). For every benchmark, the system's adapters run on the same items in the same
batches (the specialist, plus the other two when ``cross`` names the system), so adapters
that may share KV really do: ICaRus reuses the base's prompt KV for every adapter, aLoRA up
to its invocation, conventional LoRA nothing. Routing sends each benchmark to its specialist.

Outputs (in ``--out``): ``samples/<system>/<adapter>/<task>/`` (resumable logs and scores of
each run), ``quality.json`` + ``quality.md`` (the specialists on their own tasks, with 95%
intervals, and whether ICaRus lies within LoRA's interval), ``orchestration.json`` +
``orchestration.md`` (base, single adapters on every task, routed systems, KV-sharing
column, average). A rerun reuses every finished sample, so an interrupted suite continues and
a finished one just rebuilds its tables.

The tables also gather runs that earlier invocations finished in the same ``--out`` folder
(their ``results.json``), when the model, dtype, limit and generation length they record equal
this spec's. So a suite can be run in parts, one spec per set of adapters trained so far or per
machine, and the tables show the union; per-sample logs need not travel with the scores.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..kinds import kind_spec
from ..yamlspec import load_spec
from .code import code_task
from .gsm8k import gsm8k_task
from .harness import EvalTask, ci_cell, load_llm, run_samples, score
from .qa import f1_task

DOMAINS = {"math": "gsm8k", "code": "humanevalplus", "qa": "f1-hotpotqa"}
# (task, metric path, column title): what the tables show
COLUMNS = [("gsm8k", ("flexible-extract",), "GSM8K"), ("gsm8k", ("strict-match",), "GSM8K strict"),
           ("humanevalplus", ("humaneval", "pass@1"), "HumanEval"), ("humanevalplus", ("humaneval+", "pass@1"), "HumanEval+"),
           ("f1-hotpotqa", ("f1",), "HotpotQA F1")]
HEADLINE = ["GSM8K", "HumanEval", "HumanEval+", "HotpotQA F1"]  # averaged in the orchestration table


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Limits(_Strict):
    gsm8k: int | None = Field(250, ge=1)  # test problems (first N); None = all 1,319
    humanevalplus: int | None = Field(None, ge=1)  # None = all 164
    hotpotqa: int | None = Field(100, ge=1)  # dev_hard_500 questions (first N)


class MaxTokens(_Strict):
    gsm8k: int = Field(256, ge=1)
    humanevalplus: int = Field(512, ge=1)
    hotpotqa: int = Field(32, ge=1)


class SystemSpec(_Strict):
    """A system's specialists (adapter folders); one not trained yet may be left out."""
    math: str | None = None
    code: str | None = None
    qa: str | None = None


TaskName = Literal["gsm8k", "humanevalplus", "f1-hotpotqa"]


class SuiteSpec(_Strict):
    model: str = "smollm2-135m-instruct"
    # one for every task, or per task (bfloat16 is fast only on CPUs with bf16 instructions,
    # so parts of a suite run on different machines may differ; each run records its own)
    dtype: str | dict[TaskName, str] = "bfloat16"
    batch: int = Field(8, ge=1)
    kv_cache_tokens: int = Field(65536, ge=1024)
    limits: Limits = Limits()
    max_tokens: MaxTokens = MaxTokens()
    systems: dict[str, SystemSpec]  # e.g. icarus / alora / lora, each with its three specialists
    cross: list[str] = []  # systems whose adapters also run on the other domains' tasks
    base: bool = True  # also score the base model on every task
    tasks: list[TaskName] = list(DOMAINS.values())  # run only these

    @model_validator(mode="after")
    def _dtype_for_every_task(self):
        if isinstance(self.dtype, dict) and set(self.dtype) != set(DOMAINS.values()):
            missing = sorted(set(DOMAINS.values()) - set(self.dtype))
            raise ValueError(f"dtype per task must name every task; missing: {', '.join(missing)}")
        return self

    def dtype_of(self, task: str) -> str:
        return self.dtype if isinstance(self.dtype, str) else self.dtype[task]

    def by_dtype(self, tasks) -> dict[str, list[str]]:
        """Tasks grouped by the dtype they run in (one engine per group)."""
        groups: dict[str, list[str]] = {}
        for task in tasks:
            groups.setdefault(self.dtype_of(task), []).append(task)
        return groups


def build_tasks(spec: SuiteSpec) -> dict[str, EvalTask]:
    limits, lengths = spec.limits, spec.max_tokens
    builders = {"gsm8k": lambda: gsm8k_task(limit=limits.gsm8k, max_tokens=lengths.gsm8k),
                "humanevalplus": lambda: code_task("humanevalplus", limit=limits.humanevalplus,
                                                   max_tokens=lengths.humanevalplus),
                "f1-hotpotqa": lambda: f1_task("hotpotqa", limit=limits.hotpotqa, max_tokens=lengths.hotpotqa)}
    return {name: builders[name]() for name in DOMAINS.values() if name in spec.tasks}


LIMITS = {"gsm8k": "gsm8k", "humanevalplus": "humanevalplus", "f1-hotpotqa": "hotpotqa"}  # task -> Limits field


def run_settings(spec: SuiteSpec, task: str) -> dict:
    """What a run's results.json must record to count as a run of this spec."""
    field = LIMITS[task]
    return {"task": task, "model": spec.model, "dtype": spec.dtype_of(task), "limit": getattr(spec.limits, field),
            "max_tokens": getattr(spec.max_tokens, field)}


def finished_runs(spec: SuiteSpec, out: Path) -> dict[tuple[str, str], dict]:
    """Scores of runs finished earlier under ``out/samples`` for this spec's systems and settings.

    ``max_tokens`` is checked only where recorded (earlier results.json files lack it)."""
    systems = {"base"} if spec.base else set()
    found = {}
    for path in sorted((out / "samples").glob("*/*/*/results.json")):
        system, row, task = path.parts[-4:-1]
        if task not in LIMITS or (system not in systems and system not in spec.systems):
            continue
        results = json.loads(path.read_text())
        if all(results.get(key, value if key == "max_tokens" else None) == value
               for key, value in run_settings(spec, task).items()):
            found[(row, task)] = results
    return found


def run_suite(spec_path: str | Path, out: str | Path) -> dict:
    spec = load_spec(spec_path, SuiteSpec, "evaluation suite")
    out = Path(out)
    tasks = build_tasks(spec)
    scores = finished_runs(spec, out)  # (row label, task) -> results; runs below replace these
    earlier = set(scores)
    kinds = {system: results["kind"] for (row, _), results in scores.items() if "kind" in results
             for system in spec.systems if row.endswith(f"-{system}")}
    sharing: dict[str, dict] = {}

    def evaluate_together(llm, task_name: str, adapters: dict[str | None, str | None], system: str) -> list[dict]:
        """Run adapters (engine name -> folder; None = base) on one task at once; keep scores."""
        task = tasks[task_name]
        folders = {name: out / "samples" / system / (name or "base") / task_name for name in adapters}
        results = run_samples(llm, task, folders, spec.batch)
        wanted = run_settings(spec, task_name)
        for name, folder in folders.items():
            kind = llm.engine.adapter(name).kind.value if name else "base"
            extra = {"dtype": wanted["dtype"], "max_tokens": wanted["max_tokens"], "kind": kind}
            scores[(name or "base", task_name)] = score(task, results[name], folder, spec.model, adapters[name], extra)
            earlier.discard((name or "base", task_name))
        return [sample for samples in results.values() for sample in samples]

    if spec.base:
        for dtype, group in spec.by_dtype(tasks).items():
            llm, _ = load_llm(spec.model, None, dtype=dtype, kv_cache_tokens=spec.kv_cache_tokens)
            for task_name in group:
                evaluate_together(llm, task_name, {None: None}, "base")
            del llm
    for system, adapters in spec.systems.items():
        folders = {d: getattr(adapters, d) for d in DOMAINS if getattr(adapters, d)}
        ran = [t for d, t in DOMAINS.items() if t in tasks and (d in folders or system in spec.cross)]
        if not folders or not ran:
            continue
        by_task: dict[str, dict] = {}
        for dtype, group in spec.by_dtype(ran).items():
            llm, _ = load_llm(spec.model, None, dtype=dtype, kv_cache_tokens=spec.kv_cache_tokens)
            names = {d: llm.engine.load_adapter(folder, name=f"{d}-{system}") for d, folder in folders.items()}
            kinds[system] = llm.engine.adapter(next(iter(names.values()))).kind.value
            for domain, task_name in DOMAINS.items():
                if task_name in group:
                    runs = [d for d in names if d == domain or system in spec.cross]
                    samples = evaluate_together(llm, task_name, {names[d]: folders[d] for d in runs}, system)
                    by_task[task_name] = _kv_reuse(sum(s["prompt_tokens"] for s in samples),
                                                   sum(s["cached_tokens"] for s in samples))
            del llm
        sharing[system] = {"kind": kinds[system], "rule": kind_spec(kinds[system]).scope.value,
                           **_kv_reuse(sum(t["prompt_tokens"] for t in by_task.values()),
                                       sum(t["prompt_tokens_from_cache"] for t in by_task.values())),
                           "by_task": by_task}
    report = tables(spec, scores, kinds, sharing)
    report["quality"]["from_earlier_runs"] = sorted(f"{row}/{task}" for row, task in earlier)
    if earlier:
        report["quality_md"] += ("\nScores from runs finished by earlier invocations (same settings): "
                                 + ", ".join(report["quality"]["from_earlier_runs"]) + ".\n")
    out.mkdir(parents=True, exist_ok=True)
    (out / "quality.json").write_text(json.dumps(report["quality"], indent=1))
    (out / "quality.md").write_text(report["quality_md"])
    (out / "orchestration.json").write_text(json.dumps(report["orchestration"], indent=1))
    (out / "orchestration.md").write_text(report["orchestration_md"])
    return report


def _kv_reuse(prompt: int, cached: int) -> dict:
    """How much prompt KV came from cache (the prefix cache or another adapter's prefill)."""
    return {"prompt_tokens": prompt, "prompt_tokens_from_cache": cached, "cached_fraction": cached / prompt if prompt else 0.0}


def _metric(scores: dict, row: str, task: str, path: tuple[str, ...]) -> dict | None:
    """One score, or None when that run is not in the suite (yet)."""
    results = scores.get((row, task))
    for key in path:
        if results is None:
            return None
        results = results[key]
    return results


def _cell(metric: dict | None) -> str:
    return "-" if metric is None else ci_cell(metric)


def tables(spec: SuiteSpec, scores: dict, kinds: dict[str, str], sharing: dict[str, dict]) -> dict:
    task_domain = {task: domain for domain, task in DOMAINS.items()}
    # quality: each kind's specialist on its own task (and the base), with intervals
    quality = {"settings": spec.model_dump(), "rows": {}, "icarus_vs_lora": {}}
    lines = ["| system | " + " | ".join(title for _, _, title in COLUMNS) + " |", "|---" * (len(COLUMNS) + 1) + "|"]
    labels = (["base"] if spec.base else []) + list(spec.systems)
    for label in labels:
        row = {title: _metric(scores, "base" if label == "base" else f"{task_domain[task]}-{label}", task, path)
               for task, path, title in COLUMNS}
        quality["rows"][label] = row
        lines.append(f"| {label} | " + " | ".join(_cell(row[title]) for _, _, title in COLUMNS) + " |")
    by_kind = {kind: system for system, kind in kinds.items()}
    if "icarus" in by_kind and "lora" in by_kind:
        lines += ["", "ICaRus within the 95% interval of LoRA (same task, same examples):", ""]
        for _, _, title in COLUMNS:
            icarus, lora = quality["rows"][by_kind["icarus"]][title], quality["rows"][by_kind["lora"]][title]
            if icarus is None or lora is None:
                continue
            # None when LoRA's interval is undefined (a single example)
            inside = None if lora["stderr"] != lora["stderr"] else lora["ci95"][0] <= icarus["mean"] <= lora["ci95"][1]
            quality["icarus_vs_lora"][title] = {"icarus": icarus["mean"], "lora": lora["mean"],
                                                "lora_ci95": lora["ci95"], "within": inside}
            verdict = {True: "within", False: "outside", None: "undetermined (one example)"}[inside]
            lines.append(f"- {title}: ICaRus {icarus['mean']:.3f} vs LoRA {ci_cell(lora)}: {verdict}")
    # orchestration: base, single adapters on every task, routed systems, KV sharing, average
    orchestration = {"rows": [], "sharing": sharing}
    head = ["| row | " + " | ".join(HEADLINE) + " | average | KV sharing |", "|---" * (len(HEADLINE) + 3) + "|"]
    titles = {title: (task, path) for task, path, title in COLUMNS}

    def add(label: str, row_of, kv: str) -> None:
        values = {}
        for title in HEADLINE:
            task, path = titles[title]
            metric = _metric(scores, row_of(task), task, path)
            values[title] = None if metric is None else metric["mean"]
        known = [v for v in values.values() if v is not None]
        average = sum(known) / len(known) if len(known) == len(values) else None
        orchestration["rows"].append({"row": label, **values, "average": average, "kv_sharing": kv})
        cells = ["-" if v is None else f"{v:.3f}" for v in (*values.values(), average)]
        head.append(f"| {label} | " + " | ".join(cells) + f" | {kv} |")

    if spec.base:
        add("base", lambda task: "base", "-")
    for system in spec.systems:
        if system in spec.cross:
            for domain in DOMAINS:
                add(f"{domain}-{system} alone", lambda task, d=domain: f"{d}-{system}", "-")
    for system in sharing:
        share = sharing[system]
        per_task = ", ".join(f"{task} {reuse['cached_fraction']:.0%}" for task, reuse in share["by_task"].items())
        kv = f"{share['rule']}: {share['cached_fraction']:.0%} of prompt KV from cache ({per_task})"
        add(f"{system} (routed: {', '.join(DOMAINS)})", lambda task: f"{task_domain[task]}-{system}", kv)
    return {"quality": quality, "quality_md": "\n".join(lines) + "\n",
            "orchestration": orchestration, "orchestration_md": "\n".join(head) + "\n"}
