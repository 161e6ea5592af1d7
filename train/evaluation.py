"""Evaluation during training (``train.eval_every``): the adapter as it stands, scored by an
engine harness on a small slice of an evaluation set.

The adapter is exported with its manifest (as at the end of a run) and served by the
kvshare engine, so the score is the one ``kvshare eval`` would give at that step, with the
adapter's real KV-sharing semantics (transformers' ``Trainer`` evaluates the training
graph instead, which for ICaRus is not how the adapter is served). Each evaluation goes to
``output_dir/eval/step-N/`` (samples and results, as ``kvshare eval`` writes them) and one
record ``{"step": N, "eval": {...}}`` in ``metrics.jsonl``.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import KvshareError

# the harness tasks eval_task may name
EVAL_TASKS = ("gsm8k", "f1-hotpotqa", "f1-squad", "humaneval", "mbpp")


def build_eval_task(name: str, limit: int, max_tokens: int | None):
    """The harness task ``name`` over its first ``limit`` items."""
    if name == "gsm8k":
        from ..eval.gsm8k import gsm8k_task

        return gsm8k_task(limit, max_tokens=max_tokens or 256)
    if name.startswith("f1-"):
        from ..eval.qa import f1_task

        return f1_task(name[3:], limit, max_tokens=max_tokens or 32)
    if name in ("humaneval", "mbpp"):
        from ..eval.code import code_task

        return code_task(name, limit, max_tokens=max_tokens or 512)
    raise KvshareError(f"unknown eval_task {name!r} (known: {', '.join(EVAL_TASKS)})")


def headline(results: dict) -> dict[str, float]:
    """Every mean in a harness result (``{"f1": {"mean": ..}}``, ``{"humaneval": {"pass@1": {"mean": ..}}}``)
    as a flat ``name -> value`` mapping, for the metrics log and the trackers."""
    flat: dict[str, float] = {}

    def walk(prefix: str, value) -> None:
        if isinstance(value, dict):
            if "mean" in value and isinstance(value["mean"], (int, float)):
                flat[prefix] = float(value["mean"])
                return
            for key, inner in value.items():
                walk(f"{prefix}/{key}" if prefix else str(key), inner)

    walk("", {k: v for k, v in results.items() if k not in ("settings",)})
    return flat


def evaluate_adapter(adapter_dir: Path, base_model: str, task_name: str, limit: int,
                     max_tokens: int | None, out_dir: Path, device: str = "cpu") -> dict:
    """Score an exported adapter folder on the task's first ``limit`` items (on the training
    process's device); returns ``{"task", "n", <metric>: value, ...}``."""
    from ..eval.harness import evaluate

    task = build_eval_task(task_name, limit, max_tokens)
    # eager: a curve point's few questions never amortise a compile (each step bucket took a
    # minute), and graphs lowered in the background would outlive the evaluation, beside training
    results = evaluate(task, base_model, str(adapter_dir), out_dir, overwrite=True, device=device, compile="off")
    return {"task": task.name, "n": len(task.items), **headline(results)}
