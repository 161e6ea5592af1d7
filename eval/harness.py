"""Shared machinery of the evaluations: generate through the engine, resumably, with logs.

Finished samples are appended to ``samples.jsonl`` in the output folder as they complete; a
rerun skips them, so an interrupted evaluation continues where it stopped. Results are
written as JSON plus a markdown line.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable

from tqdm import tqdm

from ..errors import KvshareError
from ..serve import LLM, SamplingParams


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
        llm.engine.adapters.get(name)  # unknown names fail here with a clear error
    return llm, name


def run_samples(llm: LLM, adapter: str | None, items: list[dict], make_prompt: Callable[[dict], list[int]],
                judge: Callable[[dict, str], dict], params: SamplingParams | Callable[[dict], SamplingParams],
                out_dir: Path, batch: int = 8, desc: str = "eval") -> list[dict]:
    """Generate and judge every item (dicts with an "id"), reusing samples already logged.
    ``params`` may be a function of the item (e.g. a seed per sample)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    log = out_dir / "samples.jsonl"
    done: dict[str, dict] = {}
    if log.is_file():
        for line in log.read_text().splitlines():
            if line.strip():
                record = json.loads(line)
                done[record["id"]] = record
    todo = [item for item in items if item["id"] not in done]
    with open(log, "a", encoding="utf-8") as handle, tqdm(total=len(items), initial=len(items) - len(todo),
                                                           desc=desc, unit="sample") as bar:
        for start in range(0, len(todo), batch):
            chunk = todo[start:start + batch]
            prompts = [make_prompt(item) for item in chunk]
            outputs = llm.generate(prompts, [params(item) for item in chunk] if callable(params) else params,
                                   adapter=adapter)
            for item, prompt, out in zip(chunk, prompts, outputs):
                record = {"id": item["id"], "prompt": llm.engine.tokenizer.decode(prompt),
                          "output": out.text, **judge(item, out.text)}
                handle.write(json.dumps(record, ensure_ascii=False) + "\n")
                handle.flush()
                done[item["id"]] = record
                bar.update()
    return [done[item["id"]] for item in items]


def write_results(out_dir: Path, results: dict, table_row: str) -> None:
    (out_dir / "results.json").write_text(json.dumps(results, indent=1))
    (out_dir / "results.md").write_text(table_row + "\n")
