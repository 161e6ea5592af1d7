"""A step of 8 decoding ICaRus pairs beside a short prompt chunk, with the compiled step's
largest bucket at 16 (the chunk runs eager, apart from the graph's decode rows) and at 128
(the whole step through one graph).

    python results/compiled-buckets/mixed_step.py [--out results/compiled-buckets]

SmolLM2-135M in bfloat16, 2 threads: 8 requests of 1,536 prompt tokens decode, each with its
own ICaRus adapter; six times a new call continues a cached 1,536-token context with 88 new
tokens (a ReAct turn's observation and header, as in ``kvshare bench workflow``). Reports the
median time of the step that holds the chunk.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from kvshare.eval.perf import workflow
from kvshare.eval.perf.common import setup
from kvshare.serve import LLMEngine, SamplingParams


def mixed_steps(model_dir: Path, max_rows: int) -> dict:
    engine = LLMEngine(model_dir, dtype="bfloat16", max_num_batched_tokens=1024, kv_cache_tokens=40000,
                       compile_max_rows=max_rows)
    contexts = workflow.hotpot_contexts(engine.tokenizer, 9, 1536)
    _, paths = workflow.make_agents("icarus", 8, model_dir, engine.tokenizer, Path(tempfile.mkdtemp()))
    names = [engine.load_adapter(p) for p in paths]
    engine.warm_up(rows=tuple(b for b in (16, 128) if b <= max_rows), adapters=True)
    engine.add_request(contexts[8], SamplingParams(max_tokens=1))  # the context every new call continues
    while engine.has_unfinished():
        engine.step()
    for context, name in zip(contexts, names):
        engine.add_request(context, SamplingParams(max_tokens=200, ignore_eos=True), adapter=name)
    for _ in range(12):  # every prompt in: 8 pairs decoding
        engine.step()
    forwards, times = [], []
    run = engine.runner.run
    engine.runner.run = lambda group, adapters: forwards.append(sum(p.num_rows for p in group)) or run(group, adapters)
    for k in range(6):
        new = list(range(1000 + 100 * k, 1088 + 100 * k))
        engine.add_request(contexts[8] + new, SamplingParams(max_tokens=1), adapter=names[k % 8])
        forwards.clear()
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
        step_forwards = list(forwards)  # this step's only, not the decode steps after it
        for _ in range(2):
            engine.step()
    return {"compile_max_rows": max_rows, "forwards_rows": step_forwards, "median_ms": 1e3 * statistics.median(times),
            "times_ms": [round(1e3 * t, 1) for t in times]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    args = parser.parse_args()
    model_dir = setup("smollm2-135m-instruct", 2)
    rows = []
    for max_rows in (16, 128):
        rows.append(mixed_steps(model_dir, max_rows))
        print(json.dumps(rows[-1]), flush=True)
    ratio = rows[0]["median_ms"] / rows[1]["median_ms"]
    print(f"bucket 16 / bucket 128: {ratio:.2f}x")
    if args.out:
        out = Path(args.out)
        (out / "mixed_step.json").write_text(json.dumps({"runs": rows, "ratio_16_over_128": ratio}, indent=1) + "\n")
        lines = ["| --compile-max-rows | forwards of the step (rows) | median step | six steps (ms) |", "|---|---|---|---|"]
        lines += [f"| {r['compile_max_rows']} | {' + '.join(map(str, r['forwards_rows']))} | {r['median_ms']:.1f} ms | "
                  f"{', '.join(map(str, r['times_ms']))} |" for r in rows]
        lines += ["", f"Bucket 16 over bucket 128: {ratio:.2f}x."]
        (out / "mixed_step.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
