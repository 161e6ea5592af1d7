"""``kvshare bench startup``: from process start to the first token, cold and warm, and what
the start costs in memory and disk.

A newcomer's first command is judged from a cold cache. Each start is a fresh process
(:mod:`.startup_probe`), the base alone and then with adapters, first over an empty compile
cache (cold) and again over the cache the cold start filled (warm), with the product's
defaults (``--compile auto``: graphs lowered in the background while the first requests run
eager). Reported per start: seconds to import, to load, to the first token and until every
graph the workload used was compiled; tokens a second of every agent decoding together before
and after; peak RSS against the weights and the KV pool; the compile cache's size on disk.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ...errors import KvshareError
from ...random_adapters import random_adapter
from .common import setup, write_report

PROMPT = "Summarise the history of the Roman empire in one paragraph."


def run_startup_bench(model: str = "smollm2-135m-instruct", adapters: int = 8, dtype: str = "float32",
                      threads: int = 2, decode_tokens: int = 32, kv_cache_tokens: int = 16384,
                      out_dir: str | Path | None = None) -> dict:
    """Cold and warm starts of the base and of the base with ``adapters`` random LoRA adapters."""
    model_dir = setup(model, threads)
    runs = {}
    with tempfile.TemporaryDirectory(prefix="kvshare-startup-") as scratch:
        folders = [str(random_adapter("lora", model_dir, Path(scratch) / "adapters", f"agent-{i}", seed=i))
                   for i in range(adapters)]
        for label, chosen in (("base", []), (f"{adapters} adapters", folders)):
            cache = Path(scratch) / f"compile-{len(chosen)}"  # empty: the cold start fills it
            for phase in ("cold", "warm"):
                spec = {"model": str(model_dir), "adapters": chosen, "dtype": dtype, "threads": threads,
                        "decode_tokens": decode_tokens, "kv_cache_tokens": kv_cache_tokens, "prompt": PROMPT}
                runs[f"{label}, {phase}"] = {**_start(spec, cache, Path(scratch)), "cache_mb": _mb(cache)}
    results = {"model": model, "dtype": dtype, "threads": threads, "adapters": adapters,
               "decode_tokens": decode_tokens, "runs": runs}
    if out_dir:
        write_report(results, out_dir, "startup_bench", markdown)
    return results


def _start(spec: dict, cache: Path, scratch: Path) -> dict:
    """One fresh process over the compile cache ``cache``; its figures."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache), "OMP_NUM_THREADS": str(spec["threads"])}
    env.pop("KVSHARE_COMPILE_BACKGROUND", None)  # the product's default, not the benchmarks' foreground compiles
    spec_file = scratch / "spec.json"
    spec_file.write_text(json.dumps({**spec, "t0": time.time()}))
    done = subprocess.run([sys.executable, "-m", "kvshare.eval.perf.startup_probe", str(spec_file)],
                          capture_output=True, text=True, env=env)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise KvshareError(f"a start failed (exit {done.returncode}): {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(lines[-1])


def _mb(folder: Path) -> float:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) / 2**20 if folder.exists() else 0.0


def markdown(results: dict) -> str:
    rows = ["| start | to first token (s) | load (s) | all graphs compiled (s) | tok/s before | tok/s after "
            "| peak RSS (MB) | weights + KV pool (MB) | compile cache (MB) |",
            "|---|---|---|---|---|---|---|---|---|"]
    for name, r in results["runs"].items():
        rows.append(f"| {name} | {r['first_token_s']:.1f} | {r['loaded_s']:.1f} | {r['compiled_s']:.1f} "
                    f"| {r['first_rate_tok_s']:.1f} | {r['steady_rate_tok_s']:.1f} | {r['peak_rss_mb']:.0f} "
                    f"| {r['weights_mb'] + r['kv_pool_mb']:.0f} | {r['cache_mb']:.0f} |")
    return (f"# Start-up: {results['model']}, {results['dtype']}, {results['threads']} threads\n\n"
            "Each start a fresh process, seconds from its launch; `--compile auto` (the default). Before/after: "
            f"tokens a second of the base and every adapter decoding {results['decode_tokens']} tokens together, "
            "while the graphs compile and once they have.\n\n" + "\n".join(rows) + "\n")
