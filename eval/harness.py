"""Shared machinery of the evaluations: generate through the engine, resumably, with logs.

A benchmark is an :class:`EvalTask`: its items, how an item becomes a prompt for an adapter,
how a reply is judged, and how judged samples become scores. :func:`run_samples` runs one
task for one or several adapters of one engine at once: the same item goes to every adapter
in the same batch, so adapters whose sharing rule allows it (ICaRus; aLoRA up to its
invocation) reuse each other's prompt KV, as they would serving a multi-agent system.

Finished samples are appended to ``samples.jsonl`` in each adapter's output folder as they
complete; a rerun skips them, so an interrupted evaluation continues where it stopped. The
log's first line is a header: the settings that change outputs and their hash
(:func:`run_settings`). A rerun whose settings hash differs is refused (or, with
``overwrite``, starts a fresh log), so a log never mixes samples of two configurations and
``results.json`` never claims settings its samples were not made with. Results are written
(atomically) as JSON plus a markdown line.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from tqdm import tqdm

from ..errors import KvshareError
from ..fsutil import write_text_atomic
from ..serve import LLM, LLMEngine, SamplingParams
from .samples_log import HEADER_FORMAT, HEADER_KEY, read_log

# task settings that choose which items run, not what an item's output is: a rerun with a
# larger limit extends a log instead of being refused
SELECTION = frozenset({"limit", "problems", "samples"})
NAMES = frozenset({"model", "adapter"})  # readable names; identity is in the fingerprint/digest
# files computed from a folder's samples, stale once the samples are generated again
DERIVED = ("results.json", "results.md", "evalplus.jsonl")


@dataclass
class EvalTask:
    name: str
    items: list[dict]  # each with a unique "id"
    prompt: Callable[[LLMEngine, dict, str | None], list[int]]  # (engine, item, adapter) -> token ids
    judge: Callable[[dict, str], dict]  # (item, reply) -> verdict fields logged with the sample
    params: SamplingParams | Callable[[dict], SamplingParams]  # one for all, or per item (seeds)
    summarize: Callable[[list[dict], Path], dict]  # (judged samples, output folder) -> scores
    row: Callable[[dict], str]  # scores -> the markdown cells after "| task | adapter |"
    settings: dict  # what a reader needs to reproduce the scores (limit, shots, ...)
    # the judge's version: samples logged under another are judged again on resume (their
    # outputs kept), so one score never mixes verdicts of two scoring rules
    scoring: int = 1


def mean_ci95(values: list[float]) -> dict:
    """Mean with lm-eval's standard error (sample std / sqrt(n)) and a 95% interval: normal for
    scores such as F1, Wilson's for pass/fail scores (accuracy, pass@1), whose normal interval
    collapses to a point at 0 of n or n of n (0 of 100 passes: 0.000-0.037, not 0.000-0.000)."""
    n = len(values)
    if n == 0:
        raise KvshareError("no samples were scored")
    mean = sum(values) / n
    stderr = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1) / n) if n > 1 else float("nan")
    ci95 = [mean - 1.96 * stderr, mean + 1.96 * stderr]
    if n > 1 and all(v in (0, 1) for v in values):
        z2 = 1.96 ** 2
        center = (mean + z2 / (2 * n)) / (1 + z2 / n)
        half = 1.96 * math.sqrt(mean * (1 - mean) / n + z2 / (4 * n * n)) / (1 + z2 / n)
        ci95 = [center - half, center + half]
    return {"mean": mean, "stderr": stderr, "ci95": ci95, "n": n}


def require_adapter_dir(adapter: str | None) -> None:
    """An evaluated adapter is an exported folder (a fresh engine knows none by name): a
    clear error before the model loads."""
    if adapter and not Path(adapter).is_dir():
        raise KvshareError(f"{adapter}: no such adapter folder")


def load_llm(model: str, adapter: str | None, dtype: str = "float32", kv_cache_tokens: int = 32768,
             device: str = "cpu", kernels: str = "auto", compile: str = "auto") -> tuple[LLM, str | None]:
    """An engine with the adapter (folder) loaded; returns it and the adapter's name."""
    require_adapter_dir(adapter)
    llm = LLM(model, kv_cache_tokens=kv_cache_tokens, dtype=dtype, device=device, kernels=kernels, compile=compile)
    name = llm.engine.load_adapter(adapter) if adapter else None
    return llm, name


def run_settings(task: EvalTask, model: str, base_fingerprint: str, adapter: str | None,
                 adapter_digest: str | None, dtype: str) -> dict:
    """Everything that changes an item's output, readable: the base and adapter by identity
    (weights, not names), the dtype, the task's prompt settings and the sampling parameters."""
    sampling = None
    if task.items:
        params = task.params(task.items[0]) if callable(task.params) else task.params
        sampling = asdict(params)
        if callable(task.params) and sampling["seed"] is not None:
            sampling["seed"] = "per item"  # derived from each item's id
    prompt = {k: v for k, v in sorted(task.settings.items()) if k not in SELECTION}
    return {"task": task.name, "model": str(model), "base_fingerprint": base_fingerprint, "adapter": adapter,
            "adapter_digest": adapter_digest, "dtype": dtype, **prompt, "sampling": sampling}


def settings_hash(settings: dict) -> str:
    """sha256 of the settings that change outputs (names left out: a renamed adapter with
    the same weights is the same run)."""
    hashed = {k: v for k, v in settings.items() if k not in NAMES}
    return "sha256:" + hashlib.sha256(json.dumps(hashed, sort_keys=True, default=str).encode()).hexdigest()


def engine_settings(llm: LLM, task: EvalTask, adapter: str | None) -> dict:
    """:func:`run_settings` of an adapter (None = the base) loaded in ``llm``; a fast path
    asked for by name (``kernels``, ``compile`` other than auto) and a device other than the CPU
    are part of the settings, so their outputs never mix with the default path's in one log."""
    engine = llm.engine
    digest = engine.adapter(adapter).digest if adapter else None
    settings = run_settings(task, engine.model_name, engine.fingerprint, adapter, digest, engine.config.dtype)
    device = {"device": engine.config.device} if engine.config.device != "cpu" else {}
    return {**settings, **{k: v for k, v in fast_path(engine.config).items() if v != "auto"}, **device}


def fast_path(config) -> dict:
    """The kernels and compile settings an engine was asked for (``auto`` where not named)."""
    return {"kernels": config.kernels, "compile": config.compile}


def _header(settings: dict, scoring: int = 1) -> dict:
    return {HEADER_KEY: HEADER_FORMAT, "settings_hash": settings_hash(settings), "settings": settings,
            "scoring": scoring}


def _short(value) -> str:
    text = json.dumps(value, default=str) if not isinstance(value, str) else value
    return text[:19] + "..." if text.startswith("sha256:") else text


def settings_diff(old: dict, new: dict) -> str:
    """What differs between two runs' settings, for a one-line error."""
    keys = [k for k in dict.fromkeys([*old, *new]) if k not in NAMES and old.get(k) != new.get(k)]
    parts = []
    for key in keys:
        if isinstance(old.get(key), dict) and isinstance(new.get(key), dict):
            parts += [f"{key}.{k} {_short(old[key].get(k))} -> {_short(new[key].get(k))}"
                      for k in dict.fromkeys([*old[key], *new[key]]) if old[key].get(k) != new[key].get(k)]
        else:
            parts.append(f"{key} {_short(old.get(key))} -> {_short(new.get(key))}")
    return ", ".join(parts) or "the settings hash"


def logged_samples(path: str | Path) -> list[dict]:
    """The samples of a log in the order they were written, its header left out: for readers
    of ``samples.jsonl``."""
    return list(read_log(Path(path))[1].values())


def _open_log(path: Path, settings: dict, overwrite: bool, task: EvalTask | None = None) -> dict[str, dict]:
    """Finished samples of ``path`` made with ``settings``; refuses a log made otherwise.
    Samples judged under another version of ``task``'s judge are judged again, and the log
    rewritten with the new verdicts (atomically; the outputs are kept)."""
    if overwrite:
        return {}
    header, records = read_log(path)
    if header is None and not records:
        return {}
    settings = as_logged_base(header, settings)
    records = _rejudged(path, header, records, settings, task)
    retry = "rerun with --overwrite to generate every sample again, or use another --out"
    if header is None:
        raise KvshareError(f"{path} has no settings header (written by an older kvshare), so its samples "
                           f"cannot be matched to these settings; {retry}")
    if header.get(HEADER_KEY) != HEADER_FORMAT:
        raise KvshareError(f"{path}: header format {header.get(HEADER_KEY)!r} is not {HEADER_FORMAT}; {retry}")
    if header.get("settings_hash") != settings_hash(settings):
        raise KvshareError(f"{path} holds samples made with other settings "
                           f"({settings_diff(header.get('settings') or {}, settings)}); {retry}")
    return records


def as_logged_base(header: dict | None, settings: dict) -> dict:
    """``settings`` under the base fingerprint ``header`` (a log's header, or a results.json:
    anything with the ``settings`` it was made with) names, when that is this
    base's shard-by-shard digest from before fingerprints ignored sharding
    (:func:`kvshare.fingerprint.matches_base`): a sharded base's logged samples still count."""
    logged = ((header or {}).get("settings") or {}).get("base_fingerprint")
    if not logged or logged == settings.get("base_fingerprint"):
        return settings
    from ..fingerprint import matches_base
    from ..models import resolve_model_dir

    try:
        same = matches_base(resolve_model_dir(settings["model"]), logged)
    except (KvshareError, OSError, KeyError):
        same = False
    return {**settings, "base_fingerprint": logged} if same else settings


def _rejudged(path: Path, header: dict | None, records: dict[str, dict], settings: dict,
              task: EvalTask | None) -> dict[str, dict]:
    """``records`` with the samples of this run that were judged under another scoring rule
    judged again (the log rewritten). A sample this run does not take (a smaller limit) keeps
    its verdict and says under which rule (``"scoring"``), so a later run judges it again."""
    if task is None or header is None or header.get("settings_hash") != settings_hash(settings):
        return records  # refused below
    logged = header.get("scoring", 1)
    stale = [sample_id for sample_id, record in records.items() if record.get("scoring", logged) != task.scoring]
    if not stale:
        return records
    items = {item["id"]: item for item in task.items}
    for sample_id in stale:
        record = records[sample_id]
        if sample_id in items:
            record.update(task.judge(items[sample_id], record["output"]))
            record.pop("scoring", None)  # the header's rule now
        else:
            record["scoring"] = record.get("scoring", logged)
    lines = [_header(settings, task.scoring), *records.values()]
    write_text_atomic(path, "".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines))
    return records


def run_samples(llm: LLM, task: EvalTask, out_dirs: dict[str | None, Path], batch: int = 8,
                overwrite: bool = False) -> dict[str | None, list[dict]]:
    """Generate and judge every item for every adapter (None = the base); returns the judged
    samples per adapter in item order, reusing samples already logged in its folder under
    the same settings. Every log is checked before any is touched; ``overwrite`` replaces
    each log (atomically, by one with only the header) and what was computed from it."""
    logs, done, headers = {}, {}, {}
    for adapter, folder in out_dirs.items():
        logs[adapter] = folder / "samples.jsonl"
        settings = engine_settings(llm, task, adapter)
        headers[adapter] = _header(settings, task.scoring)
        done[adapter] = _open_log(logs[adapter], settings, overwrite, task)
    for adapter, folder in out_dirs.items():
        folder.mkdir(parents=True, exist_ok=True)
        if overwrite or not done[adapter]:
            if overwrite:
                for name in DERIVED:
                    (folder / name).unlink(missing_ok=True)
            write_text_atomic(logs[adapter], json.dumps(headers[adapter], ensure_ascii=False) + "\n")
    todo = [(item, a) for item in task.items for a in out_dirs if item["id"] not in done[a]]
    total = len(task.items) * len(out_dirs)
    handles = {a: open(logs[a], "a", encoding="utf-8") for a in out_dirs}
    try:
        with tqdm(total=total, initial=total - len(todo), desc=task.name, unit="sample") as bar:
            per_step = batch * len(out_dirs)
            for start in range(0, len(todo), per_step):
                chunk = todo[start:start + per_step]
                prompts = [task.prompt(llm.engine, item, a) for item, a in chunk]
                params = [task.params(item) if callable(task.params) else task.params for item, _ in chunk]
                outputs = llm.generate(prompts, params, adapter=[a for _, a in chunk])
                for (item, adapter), prompt, out in zip(chunk, prompts, outputs):
                    record = {"id": item["id"], "prompt": llm.engine.tokenizer.decode(prompt), "output": out.text,
                              "prompt_tokens": len(prompt), "cached_tokens": out.metrics["prompt_tokens_cached"],
                              **task.judge(item, out.text)}
                    handles[adapter].write(json.dumps(record, ensure_ascii=False) + "\n")
                    handles[adapter].flush()
                    done[adapter][item["id"]] = record
                    bar.update()
    finally:
        for handle in handles.values():
            handle.close()
    return {a: [done[a][item["id"]] for item in task.items] for a in out_dirs}


def score(task: EvalTask, samples: list[dict], out_dir: Path, model: str, adapter: str | None,
          settings: dict, extra: dict | None = None) -> dict:
    """Scores of one adapter's samples, written (atomically) as results.json and results.md;
    results.json carries the run's settings and their hash, as the samples log does."""
    results = {"task": task.name, "model": str(model), "adapter": adapter, **task.settings, **(extra or {}),
               "scoring": task.scoring, "settings_hash": settings_hash(settings), "settings": settings,
               **task.summarize(samples, out_dir)}
    write_text_atomic(out_dir / "results.json", json.dumps(results, indent=1))
    write_text_atomic(out_dir / "results.md", f"| {task.name} | {adapter or 'base'} | {task.row(results)} |\n")
    return results


def evaluate(task: EvalTask, model: str, adapter: str | None, out_dir: str | Path, batch: int = 8,
             dtype: str = "float32", overwrite: bool = False, device: str = "cpu", kernels: str = "auto",
             compile: str = "auto") -> dict:
    """One task, one adapter (a folder or None for the base), a fresh engine."""
    llm, name = load_llm(model, adapter, dtype=dtype, device=device, kernels=kernels, compile=compile)
    out_dir = Path(out_dir)
    samples = run_samples(llm, task, {name: out_dir}, batch, overwrite)[name]
    return score(task, samples, out_dir, model, adapter, engine_settings(llm, task, name), {"dtype": dtype})


def ci_cell(metric: dict) -> str:
    low, high = metric["ci95"]
    return f"{metric['mean']:.3f} ({low:.3f}-{high:.3f})"
