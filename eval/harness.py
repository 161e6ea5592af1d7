"""Shared machinery of the evaluations: generate through the engine, resumably, with logs.

A benchmark is an :class:`EvalTask`: its items, how an item becomes a prompt for an adapter,
how a reply is judged, and how judged samples become scores. :func:`run_samples` runs one
task for one or several adapters of one engine at once: the same item goes to every adapter
in the same batch, so adapters whose sharing rule allows it (ICaRus; aLoRA up to its
invocation) reuse each other's prompt KV, as they would serving a multi-agent system.

Finished samples are appended to ``samples.jsonl`` in each adapter's output folder as they
complete; a rerun skips them, so an interrupted evaluation continues where it stopped.
Results are written as JSON plus a markdown line.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from tqdm import tqdm

from ..errors import KvshareError
from ..serve import LLM, LLMEngine, SamplingParams


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


def mean_ci95(values: list[float]) -> dict:
    """Mean with lm-eval's standard error (sample std / sqrt(n)) and a normal 95% interval."""
    n = len(values)
    if n == 0:
        raise KvshareError("no samples were scored")
    mean = sum(values) / n
    stderr = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1) / n) if n > 1 else float("nan")
    return {"mean": mean, "stderr": stderr, "ci95": [mean - 1.96 * stderr, mean + 1.96 * stderr], "n": n}


def load_llm(model: str, adapter: str | None, dtype: str = "float32",
             kv_cache_tokens: int = 32768) -> tuple[LLM, str | None]:
    """An engine with the adapter (folder) loaded; returns it and the adapter's name."""
    llm = LLM(model, kv_cache_tokens=kv_cache_tokens, dtype=dtype)
    name = None
    if adapter:
        name = llm.engine.load_adapter(adapter) if Path(adapter).is_dir() else adapter
        llm.engine.adapter(name)  # unknown names fail here with a clear error
    return llm, name


def _read_log(path: Path) -> dict[str, dict]:
    """Finished samples of a log. A last line cut short (the run was killed while writing it)
    is dropped from the file, so the sample is generated again and appended cleanly; a broken
    line anywhere else means the log was damaged, and that is an error, not something to skip."""
    if not path.is_file():
        return {}
    text = path.read_text(encoding="utf-8")
    tail = text.rpartition("\n")[2]  # what follows the last newline: "" unless the run was killed
    if tail.strip():
        try:
            json.loads(tail)
            text += "\n"  # written whole, the newline not yet
        except json.JSONDecodeError:
            text = text[: len(text) - len(tail)]
        temporary = path.with_name(path.name + ".tmp")
        temporary.write_text(text, encoding="utf-8")
        temporary.replace(path)
    records = {}
    # split on newlines only: outputs may hold U+2028 or U+0085, which JSON leaves unescaped
    for number, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            raise KvshareError(f"{path}: line {number} is not a JSON record; move the file away to start over") from None
        records[record["id"]] = record
    return records


def run_samples(llm: LLM, task: EvalTask, out_dirs: dict[str | None, Path], batch: int = 8) -> dict[str | None, list[dict]]:
    """Generate and judge every item for every adapter (None = the base); returns the judged
    samples per adapter in item order, reusing samples already logged in its folder."""
    logs, done = {}, {}
    for adapter, folder in out_dirs.items():
        folder.mkdir(parents=True, exist_ok=True)
        logs[adapter] = folder / "samples.jsonl"
        done[adapter] = _read_log(logs[adapter])
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
          extra: dict | None = None) -> dict:
    """Scores of one adapter's samples, written as results.json and results.md."""
    results = {"task": task.name, "model": str(model), "adapter": adapter, **task.settings, **(extra or {}),
               **task.summarize(samples, out_dir)}
    (out_dir / "results.json").write_text(json.dumps(results, indent=1))
    (out_dir / "results.md").write_text(f"| {task.name} | {adapter or 'base'} | {task.row(results)} |\n")
    return results


def evaluate(task: EvalTask, model: str, adapter: str | None, out_dir: str | Path, batch: int = 8,
             dtype: str = "float32") -> dict:
    """One task, one adapter (a folder or None for the base), a fresh engine."""
    llm, name = load_llm(model, adapter, dtype=dtype)
    out_dir = Path(out_dir)
    samples = run_samples(llm, task, {name: out_dir}, batch)[name]
    return score(task, samples, out_dir, model, adapter, {"dtype": dtype})


def ci_cell(metric: dict) -> str:
    return f"{metric['mean']:.3f} ± {1.96 * metric['stderr']:.3f}"
