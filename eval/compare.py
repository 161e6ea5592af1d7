"""Paired comparison of evaluation runs on the same items (``kvshare eval compare``).

Two systems scored on the same items differ item by item far less than their marginal
intervals suggest, so the question "does ICaRus learn the task as well as LoRA?" is answered
with the paired difference: the mean over items of per-item differences (a system's runs,
e.g. training seeds, averaged per item). Its interval comes from a bootstrap that resamples
what is independent: the items' natural clusters (questions on one SQuAD paragraph share
their context, so they are resampled together) and, where a system has several runs, the
runs too (a two-level bootstrap: seed-to-seed variation is part of a training recipe's
quality). Equivalence is TOST at alpha 0.05: equivalent within a margin the user states iff
the 90% interval lies inside it. Exact-match (binary) scores also get McNemar's exact test,
and, given a base, each system's share of the reference's gain over the base.

This module reads logs and computes; it imports nothing of the engine (fast to start).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import KvshareError
from ..fsutil import write_text_atomic
from ..provenance import provenance as shared_provenance
from . import samples_log

QA_MARKER = "\n\nAnswer the question with a short phrase from the text.\nQuestion:"  # train.data.qa_prompt's layout
ALIASES = {"em": "exact_match", "pass@1": "passed", "accuracy": "flexible-extract"}
CLUSTER_FIELDS = ("cluster", "context", "paragraph", "title", "task_id")  # "auto" takes the first present
DEFAULT_REPLICATES = 10000
MIN_CLUSTERS = 20  # fewer: no verdict (a bootstrap over a handful of units understates its spread)
ALPHA = 0.05


@dataclass(frozen=True)
class Run:
    """One evaluation run's per-item scores of one metric, and each item's cluster."""
    path: Path
    task: str | None
    metric: str
    scores: dict[str, float]  # item id -> score
    clusters: dict[str, str]  # item id -> cluster key
    cluster_source: str  # where the keys came from (a field, the QA prompt's context, or "item")
    settings_hash: str | None


def default_metric(task: str | None) -> str:
    """The task's headline per-item score: what ``kvshare eval`` reports first."""
    if task and task.startswith("f1-"):
        return "f1"
    known = {"gsm8k": "flexible-extract", "humanevalplus": "humaneval+", "humaneval": "passed", "mbpp": "passed"}
    if task not in known:
        raise KvshareError(f"no default metric for task {task!r}: name one with --metric")
    return known[task]


def samples_path(run: str | Path) -> Path:
    """A run's ``samples.jsonl``: the file itself, or the evaluation's --out folder (its
    ``samples.jsonl``, else the ``samples.jsonl.gz`` a results folder commits)."""
    path = Path(run)
    if path.is_dir():
        path = path / "samples.jsonl" if (path / "samples.jsonl").is_file() else path / "samples.jsonl.gz"
    if not path.is_file():
        raise KvshareError(f"{run}: no samples.jsonl (is it a kvshare eval --out folder?)")
    return path


def read_log(path: Path) -> tuple[dict, list[dict]]:
    """The header (empty if none) and the records of a log, read only (a last line cut short
    by a killed run is left out): the records judged under the header's scoring rule."""
    header, records = samples_log.read_log(path, repair=False)
    header = header or {}
    scoring = header.get("scoring", 1)
    return header, [r for r in records.values() if r.get("scoring", scoring) == scoring]


def _lookup(record: dict, metric: str):
    """A record's value at a dotted path; a verdict dict gives its ``correct``."""
    value = record
    for key in metric.split("."):
        if not isinstance(value, dict) or key not in value:
            return None
        value = value[key]
    return value.get("correct") if isinstance(value, dict) else value


def _evalplus_scores(path: Path, records: list[dict]) -> list[float | None]:
    """HumanEval+ per item from ``evalplus.jsonl`` beside the log: passed iff both the base
    and the plus tests pass, for the verdict of this very solution (its digest)."""
    log = path.parent / "evalplus.jsonl"
    if not log.is_file():
        raise KvshareError(f"{path.parent}: no evalplus.jsonl, so no per-item humaneval+ (use --metric passed)")
    digests = {r["id"]: hashlib.sha256(str(r.get("solution", "")).encode()).hexdigest() for r in records}
    verdicts = {v["id"]: v for v in read_log(log)[1] if v.get("digest") == digests.get(v["id"])}
    return [float(verdicts[r["id"]].get("base_status") == verdicts[r["id"]].get("plus_status") == "pass")
            if r["id"] in verdicts else None for r in records]


def item_scores(path: Path, records: list[dict], metric: str) -> dict[str, float]:
    """Item id -> score; an error naming the metric when any record lacks it."""
    values = _evalplus_scores(path, records) if metric == "humaneval+" else [_lookup(r, metric) for r in records]
    missing = [r["id"] for r, v in zip(records, values) if not isinstance(v, (int, float)) or v != v]
    if missing:
        fields = ", ".join(sorted(records[0])) if records else "none"
        raise KvshareError(f"{path}: {len(missing)} of {len(records)} items have no numeric '{metric}' "
                           f"(first: {missing[0]}; fields: {fields})")
    return {r["id"]: float(v) for r, v in zip(records, values)}


def cluster_keys(records: list[dict], field: str = "auto") -> tuple[dict[str, str], str]:
    """Each item's cluster and where it came from: a named field, with ``auto`` the first of
    CLUSTER_FIELDS present, else a QA prompt's context (the text before its question: SQuAD's
    paragraph; a HotpotQA question's own paragraphs), else each item alone (``none``)."""
    if field == "none" or not records:
        return {r["id"]: r["id"] for r in records}, "item"
    if field != "auto":
        if any(field not in r for r in records):
            raise KvshareError(f"--cluster {field}: not a field of every record")
        return {r["id"]: json.dumps(r[field], sort_keys=True) for r in records}, field
    for name in CLUSTER_FIELDS:
        if all(name in r for r in records):
            return cluster_keys(records, name)
    if all(QA_MARKER in str(r.get("prompt", "")) for r in records):
        return {r["id"]: r["prompt"].rpartition(QA_MARKER)[0] for r in records}, "the QA prompt's context"
    return cluster_keys(records, "none")


def load_run(run: str | Path, metric: str | None = None, cluster: str = "auto", items: set[str] | None = None) -> Run:
    """A run's per-item scores of ``metric`` (default: its task's headline metric); ``items``:
    only these ids (a log keeps the samples of an earlier run with a larger limit)."""
    path = samples_path(run)
    header, records = read_log(path)
    records = records if items is None else [r for r in records if r["id"] in items]
    if not records:
        raise KvshareError(f"{path}: no scored items")
    task = (header.get("settings") or {}).get("task")
    metric = ALIASES.get(metric, metric) if metric else default_metric(task)
    clusters, source = cluster_keys(records, cluster)
    return Run(path, task, metric, item_scores(path, records, metric), clusters, source, header.get("settings_hash"))


# the statistics ---------------------------------------------------------------------------
def score_matrix(runs: list[Run], items: list[str]) -> np.ndarray:
    """(runs, items) scores in ``items`` order."""
    return np.array([[run.scores[i] for i in items] for run in runs], dtype=float)


def cluster_codes(keys: list[str]) -> np.ndarray:
    """Integer codes 0..C-1 of cluster keys."""
    return np.unique(np.asarray(keys, dtype=object).astype(str), return_inverse=True)[1].ravel()


def _seed_means(runs: np.ndarray, replicates: int, rng: np.random.Generator) -> np.ndarray:
    """Per-item means over a resample of the runs (one row per replicate); one run: itself."""
    if len(runs) == 1:
        return runs
    counts = rng.multinomial(len(runs), np.full(len(runs), 1 / len(runs)), size=replicates)
    return counts @ runs / len(runs)


def bootstrap_means(systems: dict[str, np.ndarray], clusters: np.ndarray, replicates: int = DEFAULT_REPLICATES,
                    seed: int = 0, chunk: int = 1000) -> dict[str, np.ndarray]:
    """Bootstrap replicates of each system's mean score. Every system sees the same resampled
    clusters (so differences stay paired); each system's runs (rows) are resampled on their
    own (independent trainings). A replicate's mean weighs clusters by their size."""
    rng = np.random.default_rng(seed)
    order = np.argsort(clusters, kind="stable")
    sorted_codes = clusters[order]
    starts = np.flatnonzero(np.r_[True, sorted_codes[1:] != sorted_codes[:-1]])
    sizes = np.diff(np.r_[starts, len(sorted_codes)])
    out = {name: np.empty(replicates) for name in systems}
    for first in range(0, replicates, chunk):
        count = min(chunk, replicates - first)
        weights = rng.multinomial(len(starts), np.full(len(starts), 1 / len(starts)), size=count)
        totals = weights @ sizes
        for name, runs in systems.items():
            sums = np.add.reduceat(_seed_means(runs[:, order], count, rng), starts, axis=1)
            out[name][first:first + count] = (weights * sums).sum(axis=1) / totals
    return out


def interval(replicates: np.ndarray, level: float) -> list[float]:
    """Percentile interval of bootstrap replicates (non-finite ones left out)."""
    finite = replicates[np.isfinite(replicates)]
    if not len(finite):
        return [float("nan"), float("nan")]
    return [float(q) for q in np.quantile(finite, [(1 - level) / 2, (1 + level) / 2])]


def tost(ci90: list[float], margin: float) -> bool:
    """Two one-sided tests at alpha 0.05: equivalent iff the 90% interval lies inside +-margin."""
    return -margin < ci90[0] and ci90[1] < margin


def verdict(difference: float, ci95: list[float], ci90: list[float], margin: float) -> str:
    """Equivalent within the margin (TOST), different (the 95% interval excludes 0), or undecided."""
    if tost(ci90, margin):
        return f"equivalent within ±{margin:g}"
    if ci95[0] > 0 or ci95[1] < 0:
        word, value, (low, high) = ("costs", -difference, (-ci95[1], -ci95[0])) if difference < 0 else \
            ("gains", difference, tuple(ci95))
        return f"different: {word} {value:.1f} [{low:.1f}, {high:.1f}]"
    return "undecided"


def is_binary(*matrices: np.ndarray) -> bool:
    return all(np.isin(m, (0.0, 1.0)).all() for m in matrices)


def mcnemar(reference: np.ndarray, other: np.ndarray) -> dict:
    """McNemar's exact test on paired pass/fail items: a binomial test of the discordant pairs."""
    from scipy.stats import binomtest

    reference, other = reference.astype(bool), other.astype(bool)
    only_reference, only_other = int((reference & ~other).sum()), int((~reference & other).sum())
    discordant = only_reference + only_other
    p = binomtest(only_other, discordant, 0.5).pvalue if discordant else 1.0
    return {"only_reference": only_reference, "only_other": only_other, "p": float(p)}


def gain_share(system: np.ndarray, reference: np.ndarray, base: np.ndarray) -> np.ndarray:
    """(system - base) / (reference - base): the share of the reference's gain a system keeps
    (elementwise over replicates; NaN where the reference does not beat the base)."""
    gain = reference - base
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(gain > 0, (system - base) / np.where(gain > 0, gain, 1), np.nan)


# a comparison -----------------------------------------------------------------------------
def aligned_items(systems: dict[str, list[Run]], reference: str) -> list[str]:
    """The reference's first run's items, which every run must cover exactly."""
    first = systems[reference][0]
    items = list(first.scores)
    for runs in systems.values():
        for run in runs:
            extra, missing = len(set(run.scores) - set(items)), len(set(items) - set(run.scores))
            if extra or missing:
                raise KvshareError(f"runs do not cover the same items: {run.path} has {extra} items that "
                                   f"{first.path} lacks and lacks {missing} of its {len(items)}")
    return items


def _check_systems(systems: dict[str, list[Run]], reference: str, base: str | None) -> None:
    if len(systems) < 2:
        raise KvshareError(f"compare needs at least two systems, not {len(systems)}")
    for role, name in (("--reference", reference), ("--base", base)):
        if name is not None and name not in systems:
            raise KvshareError(f"{role} {name}: no such system (systems: {', '.join(systems)})")
    if base is not None and base == reference:
        raise KvshareError("--base and --reference name the same system")
    tasks = {run.task for runs in systems.values() for run in runs if run.task}
    if len(tasks) > 1:
        raise KvshareError(f"runs of different tasks: {', '.join(sorted(tasks))}")


def scale_of(matrices: list[np.ndarray]) -> tuple[float, str]:
    """Points: scores in 0-1 are reported x100 (F1 0.03 = 3 points); others in their own unit."""
    if all(((m >= 0) & (m <= 1)).all() for m in matrices):
        return 100.0, "points (per-item score x 100)"
    return 1.0, "the metric's own unit"


@dataclass(frozen=True)
class _Figures:
    """What every system's row is computed from."""
    matrices: dict[str, np.ndarray]  # (runs, items) scores
    boot: dict[str, np.ndarray]  # bootstrap replicates of each mean, in points
    means: dict[str, float]  # in points
    reference: str
    base: str | None
    margin: float
    scale: float
    clusters: int


def compare_systems(systems: dict[str, list[Run]], reference: str | None = None, base: str | None = None,
                    margin: float = 3.0, replicates: int = DEFAULT_REPLICATES, seed: int = 0) -> dict:
    """Every system against the reference (default: the first) on the same items: means,
    paired differences with 95% and 90% bootstrap intervals, the TOST verdict at ``margin``
    (in points), McNemar for binary scores with one run per system, and, given ``base``, the
    share of the reference's gain over the base each system keeps."""
    reference = reference or next(iter(systems))
    _check_systems(systems, reference, base)
    if not margin > 0:
        raise KvshareError(f"--margin must be > 0, not {margin:g}")
    items = aligned_items(systems, reference)
    first = systems[reference][0]
    matrices = {name: score_matrix(runs, items) for name, runs in systems.items()}
    scale, unit = scale_of(list(matrices.values()))
    clusters = cluster_codes([first.clusters[i] for i in items])
    boot = {name: reps * scale for name, reps in bootstrap_means(matrices, clusters, replicates, seed).items()}
    means = {name: float(m.mean(axis=0).mean()) * scale for name, m in matrices.items()}
    figures = _Figures(matrices, boot, means, reference, base, margin, scale, int(clusters.max()) + 1)
    return {"task": first.task, "metric": first.metric, "unit": unit, "scale": scale, "margin": margin,
            "reference": reference, "base": base, "items": len(items), "clusters": figures.clusters,
            "cluster_source": first.cluster_source, "bootstrap": {"replicates": replicates, "seed": seed},
            "runs": {name: [{"path": str(r.path), "settings_hash": r.settings_hash} for r in runs]
                     for name, runs in systems.items()},
            "systems": {name: _row(name, figures) for name in systems}}


def unseen_difference_bound(clusters: int, level: float) -> float:
    """Where no item differs, the bootstrap's interval is the point 0, yet some share of items
    could differ unseen: its exact (Clopper-Pearson) bound for 0 of ``clusters``, which bounds
    a 0-1 score's difference (each differing item moves it by at most 1)."""
    from scipy.stats import binomtest

    return float(binomtest(0, clusters).proportion_ci(level, method="exact").high)


def _intervals(name: str, f: _Figures) -> tuple[list[float], list[float]]:
    """The difference's 95% and 90% intervals: the bootstrap's, or, where every run of both
    systems scores every item alike, the exact bound on differences unseen (0-1 scores)."""
    runs = np.vstack([f.matrices[name], f.matrices[f.reference]])
    if f.scale == 100 and (runs == runs[0]).all():
        return [[-b * f.scale, b * f.scale] for b in (unseen_difference_bound(f.clusters, level)
                                                     for level in (0.95, 0.90))]
    replicates = f.boot[name] - f.boot[f.reference]
    return interval(replicates, 0.95), interval(replicates, 0.90)


def _row(name: str, f: _Figures) -> dict:
    """One system's figures against the reference."""
    row = {"runs": len(f.matrices[name]), "mean": f.means[name], "mean_ci95": interval(f.boot[name], 0.95)}
    if name == f.reference:
        return row
    difference = f.means[name] - f.means[f.reference]
    ci95, ci90 = _intervals(name, f)
    equivalent = tost(ci90, f.margin) and f.clusters >= MIN_CLUSTERS
    said = verdict(difference, ci95, ci90, f.margin) if f.clusters >= MIN_CLUSTERS else \
        f"undecided: {f.clusters} clusters, too few to bootstrap (at least {MIN_CLUSTERS})"
    row.update(difference=difference, ci95=ci95, ci90=ci90, equivalent=equivalent, verdict=said, mcnemar=None,
               gain_share=None)
    ref_runs, runs = f.matrices[f.reference], f.matrices[name]
    if len(ref_runs) == len(runs) == 1 and is_binary(ref_runs, runs):
        row["mcnemar"] = mcnemar(ref_runs[0], runs[0])
    if f.base is not None and name != f.base:
        row["gain_share"] = _gain_share_figures(name, f)
    return row


def _gain_share_figures(name: str, f: _Figures) -> dict:
    """The share of the reference's gain over the base that ``name`` keeps, and that gain."""
    share = gain_share(np.array(f.means[name]), np.array(f.means[f.reference]), np.array(f.means[f.base]))
    replicates = gain_share(f.boot[name], f.boot[f.reference], f.boot[f.base])
    return {"share": float(share), "ci95": interval(replicates, 0.95),
            "reference_gain": f.means[f.reference] - f.means[f.base],
            "reference_gain_ci95": interval(f.boot[f.reference] - f.boot[f.base], 0.95)}


# the report -------------------------------------------------------------------------------
def _span(values: list[float], digits: int = 1) -> str:
    return f"[{values[0]:.{digits}f}, {values[1]:.{digits}f}]"


def _share_cell(share: dict | None) -> str:
    if share is None:
        return "-"
    if share["share"] != share["share"]:
        return "n/a (the reference does not beat the base)"
    return f"{share['share']:.0%} [{share['ci95'][0]:.0%}, {share['ci95'][1]:.0%}]"


def _mcnemar_cell(test: dict | None) -> str:
    return "-" if test is None else f"{test['p']:.3g} ({test['only_reference']} vs {test['only_other']})"


def markdown(result: dict) -> str:
    """The comparison as a Markdown table with a paragraph saying how to read it."""
    ref, base = result["reference"], result["base"]
    lines = [f"## {result['metric']} ({result['task'] or 'task not recorded'}): paired comparison to {ref}", "",
             f"{result['items']} items in {result['clusters']} clusters (by {result['cluster_source']}). "
             f"Differences are system - {ref} in {result['unit']}: the mean over items of per-item differences, "
             f"a system's runs averaged per item. Intervals: percentile bootstrap "
             f"({result['bootstrap']['replicates']} replicates, seed {result['bootstrap']['seed']}) resampling "
             f"clusters, and runs where a system has several. Verdict: TOST at alpha {ALPHA:g}, equivalent iff "
             f"the 90% interval lies inside ±{result['margin']:g}; different iff the 95% interval excludes 0; "
             f"no verdict under {MIN_CLUSTERS} clusters. Where no item differs at all, the interval is the exact "
             "bound on the share of items that could differ unseen (Clopper-Pearson, 0 of the clusters). "
             "McNemar: exact test on the discordant items (pass/fail scores, one run each; "
             f"counts: right only with {ref} vs right only with the system).", ""]
    head = ["system", "runs", "mean [95%]", f"difference to {ref}", "95% interval", "90% interval", "verdict",
            "McNemar p"] + ([f"share of {ref}'s gain over {base}"] if base else [])
    lines += ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for name, row in result["systems"].items():
        cells = [name + (" (reference)" if name == ref else ""), str(row["runs"]),
                 f"{row['mean']:.1f} {_span(row['mean_ci95'])}"]
        if name == ref:
            cells += ["-"] * (len(head) - 3)
        else:
            cells += [f"{row['difference']:+.1f}", _span(row["ci95"]), _span(row["ci90"]), row["verdict"],
                      _mcnemar_cell(row["mcnemar"])] + ([_share_cell(row["gain_share"])] if base else [])
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    """Each system's difference to the reference with its 95% (thin) and 90% (thick) interval,
    over the shaded ±margin band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    others = [(name, row) for name, row in result["systems"].items() if name != result["reference"]]
    fig, ax = plt.subplots(figsize=(7, 1.2 + 0.6 * len(others)))
    margin = result["margin"]
    ax.axvspan(-margin, margin, color="tab:green", alpha=0.15, label=f"±{margin:g} margin")
    ax.axvline(0, color="black", linewidth=0.8)
    for y, (_, row) in enumerate(others):
        ax.plot(row["ci95"], [y, y], color="tab:blue", linewidth=1.5)
        ax.plot(row["ci90"], [y, y], color="tab:blue", linewidth=4)
        ax.plot([row["difference"]], [y], "o", color="black")
    ax.set_yticks(range(len(others)), [name for name, _ in others])
    ax.set_ylim(-0.7, len(others) - 0.3)
    ax.set_xlabel(f"{result['metric']}: difference to {result['reference']} ({result['unit']})")
    ax.set_title("paired difference, 95% (thin) and 90% (thick, TOST) bootstrap intervals", fontsize=9)
    ax.legend(loc="best", fontsize=8)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def provenance(argv: list[str]) -> dict:
    """What reproduces the report: the command, kvshare's commit, the machine, the versions."""
    return shared_provenance(["kvshare", "eval", "compare", *argv], packages=("numpy", "scipy", "matplotlib"))


def _jsonable(value):
    """``value`` with NaN (an undefined share or interval) as null: strict JSON."""
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    return None if isinstance(value, float) and value != value else value


def write_report(result: dict, out: Path) -> None:
    """compare.md, compare.json and compare.png in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / "compare.md", markdown(result))
    write_text_atomic(out / "compare.json", json.dumps(_jsonable(result), indent=1, allow_nan=False))
    plot(result, out / "compare.png")
