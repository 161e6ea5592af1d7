"""``kvshare bench engine``: the engine against Hugging Face transformers, measured side by side.

Figures (SmolLM2-135M-Instruct by default, CPU threads as given): batch-1 and batch-16 decode
tokens/s, 1k and 4k-token prefill tokens/s, the time of an ICaRus paired decode step over a
base decode step, and the KV bytes N ICaRus agents hold over one shared context versus one
agent (and versus N conventional LoRA agents). Absolute times on a shared CPU are noisy;
compare the ratios, which come from one run.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

from ...random_adapters import random_adapter
from ...serve.engine import LLM
from ...serve.sampling import SamplingParams
from .common import engine_decode_rate, filler_prompt as _prompt, setup, write_report as _write


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
                     device: str = "cpu", kernels: str = "torch") -> dict:
    from transformers import AutoModelForCausalLM

    model_dir = setup(model, threads)
    # the baseline is transformers as users run it by default: float32 (BRIEF.md's 11.8 tok/s)
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).to(device).eval()
    lengths = (128, 256) if quick else (1024, 4096)
    llm = LLM(model_dir, kv_cache_tokens=max(lengths) + 16 * (256 + new_tokens) + 2048,
              max_num_batched_tokens=max(lengths), dtype=dtype, device=device, kernels=kernels)
    tokenizer = llm.engine.tokenizer
    results: dict = {"model": str(model), "dtype": dtype, "threads": threads, "new_tokens": new_tokens,
                     "device": device, "kernels": kernels}
    steps = tqdm(total=6, desc="bench engine", unit="figure")

    short = _prompt(tokenizer, 32)
    results["decode_b1"] = {"kvshare": engine_decode_rate(llm, [short], new_tokens),
                            "hf": _hf_decode_rate(hf, [short], new_tokens)}
    steps.update()
    batch = [_prompt(tokenizer, 32 + i) for i in range(16)]
    batch = [p[-32:] for p in batch]  # equal lengths: HF needs no padding
    results["decode_b16"] = {"kvshare": engine_decode_rate(llm, batch, new_tokens),
                             "hf": _hf_decode_rate(hf, batch, new_tokens)}
    steps.update()
    for length in lengths:
        ours, theirs = _prefill_rates(llm, hf, _prompt(tokenizer, length))
        results[f"prefill_{length}"] = {"kvshare": ours, "hf": theirs}
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
    steps.close()
    if out_dir:
        write_report(results, Path(out_dir))
    return results


def markdown(results: dict) -> str:
    lines = [f"| figure | kvshare ({results['dtype']}) | HF transformers (float32) | ratio |",
             "|---|---|---|---|"]
    for key, label in [("decode_b1", "decode tok/s, batch 1"), ("decode_b16", "decode tok/s, batch 16")] + [
            (k, f"prefill tok/s, {k.split('_')[1]} tokens") for k in results if k.startswith("prefill_")]:
        r = results[key]
        lines.append(f"| {label} | {r['kvshare']:.1f} | {r['hf']:.1f} | {r['kvshare'] / r['hf']:.2f}x |")
    s = results["icarus_step_ratio"]
    lines.append(f"| ICaRus paired decode step / base step | {s['icarus_step_s'] * 1e3:.1f} ms | "
                 f"{s['base_step_s'] * 1e3:.1f} ms (base) | {s['ratio']:.2f}x |")
    kv = results["kv_bytes"]
    for n in (2, 4, 8):
        for suffix, what in (("", "context"), ("_16_generated", "context + 16 generated tokens each")):
            one = kv[f"one_agent_bytes{suffix}"]
            lines.append(f"| KV bytes, {n} agents / 1 agent ({kv['context_tokens']}-token {what}) | "
                         f"ICaRus {kv[f'icarus_{n}_bytes{suffix}'] / one:.2f}x | "
                         f"LoRA {kv[f'lora_{n}_bytes{suffix}'] / one:.2f}x | |")
    return "\n".join(lines) + "\n"


def write_report(results: dict, out_dir: Path) -> None:
    _write(results, out_dir, "engine_bench", markdown)
