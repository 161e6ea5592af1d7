"""Process start-up of a compiled SmolLM2 engine, twice: the first process lowers every graph
and writes Inductor's graph cache, the second loads them (kvshare.serve.exec.graph_cache).

    python results/compile-cache/startup.py [--out results/compile-cache]

Each run is a fresh process: the base in bfloat16 with 8 ICaRus adapters, ``warm_up`` of every
default bucket (1-16 rows) without and with adapters, then 8 greedy requests (one per
adapter) whose tokens the two runs must share. Both use a copy of ``$KVSHARE_HOME/compile``
without its graph entries (``fxgraph/``): Inductor's kernels and autotuning choices are
cached as a user's earlier runs left them, and only the graphs are new to the first process.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvshare.paths import kvshare_home

CHILD = r"""
import json, resource, sys, tempfile, time
from pathlib import Path
from torch._dynamo.utils import counters
from kvshare.eval.perf import workflow
from kvshare.eval.perf.common import setup
from kvshare.serve import LLMEngine, SamplingParams

model_dir = setup("smollm2-135m-instruct", 2)
start = time.perf_counter()
engine = LLMEngine(model_dir, dtype="bfloat16", kv_cache_tokens=8 * 512)
_, paths = workflow.make_agents("icarus", 8, model_dir, engine.tokenizer, Path(sys.argv[1]))
names = [engine.load_adapter(p) for p in paths]
loaded = time.perf_counter()
engine.warm_up(adapters=False)
engine.warm_up(adapters=True)
compiled = time.perf_counter()
prompts = workflow.hotpot_contexts(engine.tokenizer, 8, 256)
ids = [engine.add_request(p, SamplingParams(max_tokens=16, ignore_eos=True), adapter=n) for p, n in zip(prompts, names)]
done = {}
while engine.has_unfinished():
    for out in engine.step():
        if out.finished:
            done[out.request_id] = out.token_ids
print(json.dumps({"load_s": loaded - start, "warm_up_s": compiled - loaded,
                  "graphs": len(engine.runner.compiled.traced),
                  "cache_hits": counters["inductor"]["fxgraph_cache_hit"],
                  "cache_misses": counters["inductor"]["fxgraph_cache_miss"],
                  "cache_bypasses": counters["inductor"]["fxgraph_cache_bypass"],
                  "max_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6,
                  "tokens": [done[i] for i in ids]}))
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp) / "compile"
        shutil.copytree(kvshare_home() / "compile", cache, ignore=shutil.ignore_patterns("fxgraph"))
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache)}
        for i, name in enumerate(("first process", "second process")):
            start = time.perf_counter()
            adapters = Path(tmp) / f"adapters-{i}"  # the same seeds: the same adapters
            done = subprocess.run([sys.executable, "-c", CHILD, str(adapters)], capture_output=True, text=True,
                                  env=env)
            if done.returncode:
                sys.exit(done.stderr[-3000:])
            run = json.loads(done.stdout.strip().splitlines()[-1])
            run.update(run=name, process_s=time.perf_counter() - start)
            runs.append(run)
            print(f"{name}: warm-up {run['warm_up_s']:.1f} s of {run['process_s']:.1f} s, {run['graphs']} graphs, "
                  f"cache hits {run['cache_hits']} misses {run['cache_misses']} bypasses {run['cache_bypasses']}, "
                  f"max RSS {run['max_rss_gb']:.2f} GB", flush=True)
    same = runs[0]["tokens"] == runs[1]["tokens"]
    ratio = runs[0]["warm_up_s"] / runs[1]["warm_up_s"]
    print(f"warm-up first / second: {ratio:.1f}x; same greedy tokens: {same}")
    if args.out:
        out = Path(args.out)
        for run in runs:
            run.pop("tokens")
        (out / "startup.json").write_text(json.dumps({"runs": runs, "warm_up_ratio": ratio, "same_tokens": same},
                                                     indent=2) + "\n")
        rows = [f"| {r['run']} | {r['warm_up_s']:.1f} | {r['process_s']:.1f} | {r['graphs']} | {r['cache_hits']} | "
                f"{r['cache_misses']} | {r['max_rss_gb']:.2f} |" for r in runs]
        (out / "startup.md").write_text(
            "| run | warm-up s | process s | graphs | cache hits | cache misses | max RSS GB |\n"
            "|---|---|---|---|---|---|---|\n" + "\n".join(rows) +
            f"\n\nWarm-up, first / second process: {ratio:.1f}x. Same greedy tokens: {same}.\n")


if __name__ == "__main__":
    main()
