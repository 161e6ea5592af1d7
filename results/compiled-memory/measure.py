"""Memory and decode speed of the float32 compiled CPU step, per bucket, for each
``KVSHARE_CPU_GEMM``: ``inductor`` (Inductor's GEMM template everywhere, what ``auto`` means in
float32: the template's packed copies, alike in every graph, kept once; ``inductor-before``: as
before that, each graph and each cache entry its own copies, ATen's GEMM in the autotuning) and ``onednn`` (one oneDNN-packed copy of each
weight shared by every graph).

``python results/compiled-memory/measure.py [--rounds N] [--out DIR]``: for each variant in turn
(alternating over rounds), a fresh process over an empty Inductor cache loads SmolLM2-135M in
float32, and for batches of 1, 2, 4, 8 and 16 requests compiles the bucket (a first generate),
then times 48 greedy tokens a request. Prints tokens a second and RSS after each bucket, and
the peak; writes ``measure.json`` with the provenance.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VARIANTS = {name: {"KVSHARE_CPU_GEMM": name} for name in ("inductor", "onednn")}
# as kvshare compiled before (this script only): each graph and cache entry its own packed
# copies, nothing trimmed after a compile, and ATen's GEMM in the autotuning beside the template
VARIANTS["inductor-before"] = {"KVSHARE_CPU_GEMM": "inductor", "MEASURE_BEFORE": "1"}
BATCHES = (1, 2, 4, 8, 16)
TOKENS = 48


def one_process() -> dict:
    import psutil

    from kvshare.serve import LLM, SamplingParams

    if os.environ.get("MEASURE_BEFORE"):  # as kvshare compiled before: each graph its copies, ATen in the running
        import kvshare.serve.exec.compiled as compiled

        compiled.share_constants = lambda modules: 0
        compiled.return_freed_memory = lambda: None
        compiled.gemm_options = lambda model: {}
        import kvshare.serve.exec.graph_cache as graph_cache

        graph_cache.stored_entry_constants = lambda constants: constants  # each entry its own copy

    llm = LLM("smollm2-135m-instruct", compile="on", dtype="float32", kv_cache_tokens=4096)
    process = psutil.Process()
    figures = {"rss_loaded_mb": process.memory_info().rss / 2**20}
    prompt = llm.engine.tokenizer.encode("Summarise the history of the Roman empire in one paragraph.",
                                         add_special_tokens=False)
    params = SamplingParams(max_tokens=TOKENS, ignore_eos=True)
    for batch in BATCHES:
        llm.generate([prompt] * batch, params)  # compiles the bucket
        start = time.perf_counter()
        llm.generate([prompt] * batch, params)
        figures[f"b{batch}_tok_s"] = batch * TOKENS / (time.perf_counter() - start)
        figures[f"b{batch}_rss_mb"] = process.memory_info().rss / 2**20
    figures["shared_mb"] = llm.engine.runner.compiled.shared_bytes / 2**20
    from kvshare.eval.perf.common import folder_mb

    figures["compile_cache_mb"] = folder_mb(Path(os.environ["TORCHINDUCTOR_CACHE_DIR"]))
    figures["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent)
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    args = parser.parse_args()
    from kvshare.provenance import provenance

    runs = {name: [] for name in args.variants}
    for _ in range(args.rounds):
        for name in args.variants:
            env = VARIANTS[name]
            with tempfile.TemporaryDirectory(prefix="kvshare-mem-") as cache:
                done = subprocess.run([sys.executable, __file__, "--one"], capture_output=True, text=True,
                                      env={**os.environ, **env, "TORCHINDUCTOR_CACHE_DIR": cache,
                                           "KVSHARE_COMPILE": "on"})
            if done.returncode != 0:
                raise SystemExit(f"{name}: {done.stderr.strip().splitlines()[-1:]}")
            runs[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(name, json.dumps({k: round(v, 1) for k, v in runs[name][-1].items()}), flush=True)
    report = {"runs": runs, "provenance": provenance(["python", "results/compiled-memory/measure.py", *sys.argv[1:]])}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"measure-{'-'.join(args.variants)}.json").write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    if sys.argv[1:] == ["--one"]:
        print(json.dumps(one_process()))
    else:
        main()
