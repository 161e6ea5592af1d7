"""The quality suite: per-task quality of each adapter kind, and the orchestrated system
(the ICaRus paper's Table 4), from one YAML spec.

Each *system* is one served engine holding the base and three specialists of one kind (math,
code, QA). For every benchmark, the system's adapters run on the same items in the same
batches (the specialist, plus the other two when ``cross`` names the system), so adapters
that may share KV really do: ICaRus reuses the base's prompt KV for every adapter, aLoRA up
to its invocation, conventional LoRA nothing. Routing sends each benchmark to its specialist.

Outputs (in ``--out``): ``samples/<system>/<adapter>/<task>/`` (resumable logs and scores of
each run), ``quality.json`` + ``quality.md`` (the specialists on their own tasks, with 95%
intervals, and ICaRus and aLoRA each paired with LoRA item by item: the difference with its
bootstrap interval and an equivalence verdict at the spec's margin, :mod:`kvshare.eval.compare`),
``orchestration.json`` +
``orchestration.md`` (base, single adapters on every task, routed systems, KV-sharing
column, average). A rerun reuses every finished sample, so an interrupted suite continues and
a finished one just rebuilds its tables.

The tables also gather runs that earlier invocations finished in the same ``--out`` folder
(their ``results.json``), when their settings hash equals the one this spec gives them: the
same base weights, adapter weights (read from the spec's folder for that row, else from the
folder the run recorded; never matched by name), dtype, prompts and generation settings, and
the same limit. So a suite can be run in parts, one spec per set of adapters trained so far or
per machine, and the tables show the union; per-sample logs need not travel with the scores.
Runs that do not match are listed, with the reason, under ``not_merged`` in quality.json.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from .. import manifest
from ..errors import KvshareError
from ..fingerprint import fingerprints
from ..fsutil import write_text_atomic
from ..kinds import kind_spec, parse_kind
from ..models import resolve_model_dir
from ..serve.exec.adapters import adapter_digest
from ..yamlspec import StrictSpec, load_spec
from . import compare
from .code import code_task
from .gsm8k import gsm8k_task
from .harness import (EvalTask, as_logged_base, ci_cell, engine_settings, load_llm, run_samples, run_settings,
                      score, settings_diff, settings_hash)
from .qa import f1_task

DOMAINS = {"math": "gsm8k", "code": "humanevalplus", "qa": "f1-hotpotqa"}
# (task, metric path, column title): what the tables show
COLUMNS = [("gsm8k", ("flexible-extract",), "GSM8K"), ("gsm8k", ("strict-match",), "GSM8K strict"),
           ("humanevalplus", ("humaneval", "pass@1"), "HumanEval"), ("humanevalplus", ("humaneval+", "pass@1"), "HumanEval+"),
           ("f1-hotpotqa", ("f1",), "HotpotQA F1")]
HEADLINE = ["GSM8K", "HumanEval", "HumanEval+", "HotpotQA F1"]  # averaged in the orchestration table
PER_ITEM = {"GSM8K": "flexible-extract", "GSM8K strict": "strict-match", "HumanEval": "passed",
            "HumanEval+": "humaneval+", "HotpotQA F1": "f1"}  # column -> per-item score in samples.jsonl


class Limits(StrictSpec):
    gsm8k: int | None = Field(250, ge=1)  # test problems (first N); None = all 1,319
    humanevalplus: int | None = Field(None, ge=1)  # None = all 164
    hotpotqa: int | None = Field(100, ge=1)  # dev_hard_500 questions (first N)


class MaxTokens(StrictSpec):
    gsm8k: int = Field(256, ge=1)
    humanevalplus: int = Field(512, ge=1)
    hotpotqa: int = Field(32, ge=1)


class SystemSpec(StrictSpec):
    """A system's specialists (adapter folders); one not trained yet may be left out."""
    math: str | None = None
    code: str | None = None
    qa: str | None = None


TaskName = Literal["gsm8k", "humanevalplus", "f1-hotpotqa"]


class SuiteSpec(StrictSpec):
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
    # ICaRus/aLoRA vs LoRA: "equivalent" iff the paired difference's 90% interval lies inside
    # +-margin, in points (per-item scores in 0-1 counted x100: 3 = 0.03 of F1 or accuracy)
    equivalence_margin: float = Field(3.0, gt=0)
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


def build_task(spec: SuiteSpec, name: str) -> EvalTask:
    limits, lengths = spec.limits, spec.max_tokens
    if name == "gsm8k":
        return gsm8k_task(limit=limits.gsm8k, max_tokens=lengths.gsm8k)
    if name == "humanevalplus":
        return code_task("humanevalplus", limit=limits.humanevalplus, max_tokens=lengths.humanevalplus)
    return f1_task("hotpotqa", limit=limits.hotpotqa, max_tokens=lengths.hotpotqa)


def build_tasks(spec: SuiteSpec) -> dict[str, EvalTask]:
    return {name: build_task(spec, name) for name in DOMAINS.values() if name in spec.tasks}


LIMITS = {"gsm8k": "gsm8k", "humanevalplus": "humanevalplus", "f1-hotpotqa": "hotpotqa"}  # task -> Limits field


def folder_digest(folder: str | Path) -> str:
    """An exported adapter's content digest, as the engine computes it when loading it."""
    data = manifest.read(Path(folder))
    kind = parse_kind(data["kind"])
    invocation = data["alora"]["invocation_token_ids"] if kind_spec(kind).needs_invocation else None
    return adapter_digest(Path(folder), kind, invocation)


def finished_runs(spec: SuiteSpec, out: Path,
                  tasks: dict[str, EvalTask]) -> tuple[dict[tuple[str, str], dict], list[str]]:
    """Scores of runs finished earlier under ``out/samples`` for this spec's systems whose
    settings hash is the one this spec gives them, and why each other run was left out.

    A row's adapter is the spec's folder for it, else the folder the run recorded (a partial
    spec need not name every adapter); its identity is its content digest, never its name."""
    systems = {"base"} if spec.base else set()
    found, skipped, base = {}, [], []

    def expected(system: str, row: str, task: str, results: dict) -> dict:
        if not base:
            base.append(fingerprints(resolve_model_dir(spec.model)).base)
        if task not in tasks:
            tasks[task] = build_task(spec, task)
        digest = None
        if row != "base":
            domain = row[: -len(system) - 1]
            folder = getattr(spec.systems[system], domain, None) if system in spec.systems else None
            folder = folder or results.get("adapter")
            try:
                digest = folder_digest(folder)
            except (KvshareError, OSError, TypeError) as err:
                raise KvshareError(f"its adapter cannot be read ({err})") from None
        return run_settings(tasks[task], spec.model, base[0], row, digest, spec.dtype_of(task))

    for path in sorted((out / "samples").glob("*/*/*/results.json")):
        system, row, task = path.parts[-4:-1]
        if task not in LIMITS or (system not in systems and system not in spec.systems):
            continue
        label = f"{row}/{task}"
        try:
            results = json.loads(path.read_text())
            wanted = as_logged_base(results, expected(system, row, task, results))  # a sharded base's old digest
        except (json.JSONDecodeError, OSError) as err:
            skipped.append(f"{label}: unreadable ({err})")
            continue
        except KvshareError as err:
            skipped.append(f"{label}: {err}")
            continue
        limit = getattr(spec.limits, LIMITS[task])
        if "settings_hash" not in results:
            skipped.append(f"{label}: no settings hash (an older kvshare)")
        elif results["settings_hash"] != settings_hash(wanted):
            skipped.append(f"{label}: other settings ({settings_diff(results['settings'], wanted)})")
        elif results.get("limit") != limit:
            skipped.append(f"{label}: other settings (limit {results.get('limit')} -> {limit})")
        elif results.get("scoring", 1) != tasks[task].scoring:
            skipped.append(f"{label}: scored under rule {results.get('scoring', 1)}, now {tasks[task].scoring}")
        else:
            found[(row, task)] = results
    return found, skipped


def run_suite(spec_path: str | Path, out: str | Path, overwrite: bool = False) -> dict:
    """Run a suite spec into ``out``; ``overwrite`` regenerates the logs of the runs it
    performs when they were made with other settings (else such a log is refused)."""
    spec = load_spec(spec_path, SuiteSpec, "evaluation suite")
    out = Path(out)
    tasks = build_tasks(spec)
    # (row label, task) -> results; runs below replace these
    known_tasks = dict(tasks)  # and those of earlier runs: their items select per-item scores
    scores, not_merged = finished_runs(spec, out, known_tasks)
    earlier = set(scores)
    kinds = {system: results["kind"] for (row, _), results in scores.items() if "kind" in results
             for system in spec.systems if row.endswith(f"-{system}")}
    sharing: dict[str, dict] = {}
    performed: set[str] = set()

    def evaluate_together(llm, task_name: str, adapters: dict[str | None, str | None], system: str) -> list[dict]:
        """Run adapters (engine name -> folder; None = base) on one task at once; keep scores."""
        task = tasks[task_name]
        folders = {name: out / "samples" / system / (name or "base") / task_name for name in adapters}
        results = run_samples(llm, task, folders, spec.batch, overwrite)
        for name, folder in folders.items():
            kind = llm.engine.adapter(name).kind.value if name else "base"
            extra = {"dtype": spec.dtype_of(task_name), "max_tokens": getattr(spec.max_tokens, LIMITS[task_name]),
                     "kind": kind}
            scores[(name or "base", task_name)] = score(task, results[name], folder, spec.model, adapters[name],
                                                        engine_settings(llm, task, name), extra)
            earlier.discard((name or "base", task_name))
            performed.add(f"{name or 'base'}/{task_name}")
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
    logs = {(row, task): (_log_folder(out, row, task), {item["id"] for item in known_tasks[task].items})
            for row, task in scores}  # (every scored task is known: run here or found by finished_runs)
    report = tables(spec, scores, kinds, sharing, logs)
    report["quality"]["from_earlier_runs"] = sorted(f"{row}/{task}" for row, task in earlier)
    report["quality"]["not_merged"] = [why for why in not_merged if why.partition(":")[0] not in performed]
    if earlier:
        report["quality_md"] += ("\nScores from runs finished by earlier invocations (same settings): "
                                 + ", ".join(report["quality"]["from_earlier_runs"]) + ".\n")
    if report["quality"]["not_merged"]:
        report["quality_md"] += ("\nEarlier runs left out (their settings are not this spec's): "
                                 + "; ".join(report["quality"]["not_merged"]) + ".\n")
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / "quality.json", json.dumps(report["quality"], indent=1))
    write_text_atomic(out / "quality.md", report["quality_md"])
    write_text_atomic(out / "orchestration.json", json.dumps(report["orchestration"], indent=1))
    write_text_atomic(out / "orchestration.md", report["orchestration_md"])
    return report


def _log_folder(out: Path, row: str, task: str) -> Path:
    """Where a row's run of a task keeps its samples: samples/<system>/<row>/<task>."""
    system = "base" if row == "base" else row.split("-", 1)[1]  # rows are <domain>-<system>
    return out / "samples" / system / row / task


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


KIND_TITLES = {"icarus": "ICaRus", "alora": "aLoRA"}


def _paired_with_lora(spec: SuiteSpec, rows: dict, logs: dict, system: str, lora: str) -> tuple[dict, list[str]]:
    """Each column's paired comparison of ``system``'s specialist with LoRA's (and the share
    of LoRA's gain over the base it keeps), from the runs' per-item scores."""
    task_domain = {task: domain for domain, task in DOMAINS.items()}
    found, lines = {}, []
    for task, _, title in COLUMNS:
        mine, theirs = rows[system][title], rows[lora][title]
        if mine is None or theirs is None:
            continue
        domain = task_domain[task]
        found[title] = {"system": mine["mean"], "lora": theirs["mean"]}
        try:
            runs = {"system": _per_item(logs, f"{domain}-{system}", task, title),
                    "lora": _per_item(logs, f"{domain}-{lora}", task, title)}
            if None in runs.values():
                raise KvshareError("no per-item scores here (samples.jsonl not in the output folder)")
            base = _base_per_item(logs, task, title) if spec.base else None
            result = compare.compare_systems({name: [run] for name, run in {**runs, "base": base}.items() if run},
                                             "lora", "base" if base else None, spec.equivalence_margin)
        except KvshareError as err:
            found[title].update(paired=None, why=str(err))
            lines.append(f"- {title}: not paired: {err}")
            continue
        found[title]["paired"] = {k: result["systems"]["system"][k] for k in (
            "difference", "ci95", "ci90", "equivalent", "verdict", "mcnemar", "gain_share")}
        found[title].update({k: result[k] for k in ("unit", "margin", "items", "clusters", "cluster_source")})
        lines.append(_paired_line(title, found[title]["paired"]))
    return found, lines


def _base_per_item(logs: dict, task: str, title: str) -> compare.Run | None:
    """The base's per-item scores, None where they are not here: the comparison stands without
    the share of the gain."""
    try:
        return _per_item(logs, "base", task, title)
    except KvshareError:
        return None


def _per_item(logs: dict, row: str, task: str, title: str) -> compare.Run | None:
    """A row's per-item scores for a column, None where its log is not here."""
    folder, items = logs.get((row, task), (None, None))
    if folder is None or not (folder / "samples.jsonl").is_file():
        return None
    return compare.load_run(folder, PER_ITEM[title], items=items)


def _paired_line(title: str, paired: dict) -> str:
    low, high = paired["ci95"]
    line = f"- {title}: {paired['difference']:+.1f} [{low:.1f}, {high:.1f}]: {paired['verdict']}"
    if paired["mcnemar"] is not None:
        line += f"; McNemar p = {paired['mcnemar']['p']:.3g}"
    share = paired["gain_share"]
    if share is not None and share["share"] == share["share"]:
        line += (f"; keeps {share['share']:.0%} [{share['ci95'][0]:.0%}, {share['ci95'][1]:.0%}] of LoRA's gain "
                 f"over the base ({share['reference_gain']:+.1f})")
    return line


def tables(spec: SuiteSpec, scores: dict, kinds: dict[str, str], sharing: dict[str, dict],
           logs: dict[tuple[str, str], tuple[Path, set[str]]] | None = None) -> dict:
    """The quality and orchestration tables; ``logs``: (row, task) -> (its run's folder, the
    task's item ids), for the paired comparisons' per-item scores."""
    task_domain = {task: domain for domain, task in DOMAINS.items()}
    # quality: each kind's specialist on its own task (and the base), with intervals
    quality = {"settings": spec.model_dump(), "rows": {}, "icarus_vs_lora": {}, "alora_vs_lora": {}}
    lines = ["| system | " + " | ".join(title for _, _, title in COLUMNS) + " |", "|---" * (len(COLUMNS) + 1) + "|"]
    labels = (["base"] if spec.base else []) + list(spec.systems)
    for label in labels:
        row = {title: _metric(scores, "base" if label == "base" else f"{task_domain[task]}-{label}", task, path)
               for task, path, title in COLUMNS}
        quality["rows"][label] = row
        lines.append(f"| {label} | " + " | ".join(_cell(row[title]) for _, _, title in COLUMNS) + " |")
    by_kind = {kind: system for system, kind in kinds.items()}
    for kind in ("icarus", "alora"):
        if kind in by_kind and "lora" in by_kind:
            quality[f"{kind}_vs_lora"], paired_lines = _paired_with_lora(spec, quality["rows"], logs or {},
                                                                         by_kind[kind], by_kind["lora"])
            lines += ["", f"{KIND_TITLES[kind]} - LoRA, paired on the same items (in points: per-item scores x100; "
                      "95% bootstrap interval over the items' clusters; TOST at alpha 0.05, equivalent iff the "
                      f"90% interval lies inside ±{spec.equivalence_margin:g}):", "", *paired_lines]
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
