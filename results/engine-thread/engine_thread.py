"""The compiled CPU decode step on the main thread and on AsyncEngine's thread, the creating
thread's OpenMP workers kept or ended (kvshare.serve.exec.openmp).

    python results/engine-thread/engine_thread.py [--out results/engine-thread]

8 requests of 1,536 prompt tokens and 48 new ones, bfloat16, 2 threads: the base model alone,
then 8 ICaRus adapters (one per request, so each step is 8 base + adapter pairs). Reports
the median forward time of the steps where all 8 sequences decode.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

from kvshare.eval.perf import workflow
from kvshare.eval.perf.common import setup
from kvshare.serve import LLMEngine, SamplingParams
from kvshare.serve.driver import engine_thread as async_engine
from kvshare.serve.driver.engine_thread import AsyncEngine
from kvshare.serve.exec.openmp import release_openmp_workers

PARAMS = SamplingParams(max_tokens=48, ignore_eos=True)


def timed(engine: LLMEngine, log: list) -> None:
    """Record (forward seconds, rows, tokens computed) of every forward ``engine`` runs."""
    run = engine.runner.run

    def wrapped(group, adapters):
        start = time.perf_counter()
        out = run(group, adapters)
        log.append((time.perf_counter() - start, sum(p.num_rows for p in group), sum(p.n_compute for p in group)))
        return out
    engine.runner.run = wrapped


def on_main_thread(engine: LLMEngine, prompts, names) -> None:
    for prompt, name in zip(prompts, names):
        engine.add_request(prompt, PARAMS, adapter=name)
    while engine.has_unfinished():
        engine.step()


def on_engine_thread(engine: LLMEngine, prompts, names, release: bool) -> None:
    async_engine.release_openmp_workers = release_openmp_workers if release else (lambda: False)
    runner = AsyncEngine(engine, max_waiting=100)

    async def one(prompt, name):
        async for _ in runner.generate(prompt, PARAMS, name, {}):
            pass

    async def all_of_them():
        await asyncio.gather(*(one(p, n) for p, n in zip(prompts, names)))
    try:
        asyncio.run(all_of_them())
    finally:
        runner.shutdown()
        async_engine.release_openmp_workers = release_openmp_workers


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    model_dir = setup("smollm2-135m-instruct", 2)
    rows = []
    for kind in ("base", "icarus"):
        engine = LLMEngine(model_dir, dtype="bfloat16", kv_cache_tokens=16 * 1600)
        prompts = workflow.hotpot_contexts(engine.tokenizer, 8, 1536)
        names = [None] * 8
        if kind == "icarus":
            _, paths = workflow.make_agents("icarus", 8, model_dir, engine.tokenizer, Path(tempfile.mkdtemp()))
            names = [engine.load_adapter(p) for p in paths]
        engine.warm_up(rows=(16 if kind == "icarus" else 8,), adapters=kind == "icarus")
        full = 16 if kind == "icarus" else 8
        for where in ("main thread", "engine thread, workers kept", "engine thread, workers ended"):
            log: list = []
            timed(engine, log)
            if where == "main thread":  # also (re)starts the main thread's OpenMP team
                on_main_thread(engine, prompts, names)
            else:
                on_engine_thread(engine, prompts, names, release=where.endswith("ended"))
            engine.runner.run = engine.runner.__class__.run.__get__(engine.runner)
            steps = [t for t, r, n in log if r == full and n == 8]
            rows.append({"model": kind, "where": where, "decode_steps": len(steps),
                         "median_ms": 1e3 * statistics.median(steps)})
            print(f"{kind:6s} {where:30s} {len(steps)} steps, median {rows[-1]['median_ms']:.1f} ms", flush=True)
    for row in rows:
        main_ms = next(r["median_ms"] for r in rows if r["model"] == row["model"] and r["where"] == "main thread")
        row["over_main_thread"] = row["median_ms"] / main_ms
    if args.out:
        out = Path(args.out)
        (out / "engine_thread.json").write_text(json.dumps(rows, indent=1) + "\n")
        lines = ["| model | where the step runs | decode steps | median forward | / main thread |", "|---|---|---|---|---|"]
        lines += [f"| {r['model']} | {r['where']} | {r['decode_steps']} | {r['median_ms']:.1f} ms | {r['over_main_thread']:.2f}x |"
                  for r in rows]
        (out / "engine_thread.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
