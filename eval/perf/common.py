"""What the benchmarks share: filler prompts, thread and model setup, running requests to
the end through the engine facade, and writing JSON + markdown reports."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Callable

import torch

from ...errors import KvshareError
from ...fsutil import write_text_atomic
from ...provenance import provenance, this_command
from ...models import resolve_model_dir
from ...serve.engine.llm_engine import LLMEngine, RequestOutput
from ...serve.sampling_params import SamplingParams

TEXT = ("The history of the Roman empire spans many centuries, from the founding of the city to the "
        "fall of Constantinople, and includes wars, reforms, emperors and the rise of Christianity. ")


def filler_prompt(tokenizer, n_tokens: int) -> list[int]:
    """``n_tokens`` token ids of plain prose (TEXT repeated)."""
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    return (ids * (n_tokens // len(ids) + 1))[:n_tokens]


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank ``q`` quantile: the smallest value with at least ``q`` of the values at
    or below it (NaN for no values)."""
    values = sorted(values)
    return values[max(0, math.ceil(q * len(values)) - 1)] if values else float("nan")


def setup(model: str, threads: int) -> Path:
    """Pin torch's CPU threads (figures are per thread count) and resolve the model folder."""
    if threads < 1:
        raise KvshareError("--threads must be at least 1")
    torch.set_num_threads(threads)
    return resolve_model_dir(model)


def run_requests(engine: LLMEngine, requests: list[tuple[list[int], str | None]],
                 max_tokens: int) -> tuple[list[RequestOutput], float]:
    """Submit requests together, step to the end; return outputs in order and the wall time."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    ids = [engine.add_request(p, params, adapter=a) for p, a in requests]
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[i] for i in ids], time.perf_counter() - start


def engine_decode_rate(llm, prompts: list[list[int]], new: int, adapter: str | None = None) -> float:
    """Decode tokens per second of ``llm`` over ``prompts`` together, prefill excluded."""
    engine = llm.engine
    params = SamplingParams(max_tokens=new, ignore_eos=True)
    for p in prompts:
        engine.add_request(p, params, adapter=adapter)
    engine.step()  # prefill every prompt and sample the first token
    while engine.num_prefilling():
        engine.step()
    start, produced = time.perf_counter(), 0
    while engine.has_unfinished():
        produced += len(engine.step())
    return produced / (time.perf_counter() - start)


def folder_mb(folder: Path) -> float:
    """Megabytes of the files under ``folder`` (0 where it does not exist)."""
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) / 2**20 if folder.exists() else 0.0


def write_report(results: dict, out_dir: str | Path, stem: str, markdown: Callable[[dict], str]) -> None:
    """``out_dir/stem.json`` (the figures, with their provenance) and ``out_dir/stem.md`` (the
    table people read)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    results.setdefault("provenance", provenance(this_command()))  # command, commit, machine, versions
    write_text_atomic(out / f"{stem}.json", json.dumps(results, indent=1))  # never a half-written report
    write_text_atomic(out / f"{stem}.md", markdown(results))


def same_memory_settings(base_tokens: int, width: int, rank: int, agents: int) -> dict:
    """Engine settings that give ForkKV the bytes of a ``base_tokens`` exact pool: a base pool
    and a residual pool with a slot per base slot for each of ``agents`` agents. A residual
    token costs rank/width of an exact one, so base = total / (1 + agents * rank / width)."""
    share = rank / width
    base = max(1, int(base_tokens / (1 + agents * share)))
    residual = max(1, int((base_tokens - base) / share))
    return {"kv_layout": "forkkv", "kv_cache_tokens": base, "forkkv_residual_tokens": residual,
            "forkkv_max_rank": rank}
