"""``kvshare bench quant``: weight-only int8 and int4 (``--kernels int8``, ``--kernels int4``) against the float engine, in one run.

Quality on the real model: greedy agreement with the float32 (torch reference) engine over
chat prompts built from held-out HotpotQA questions (identical tokens, prompts identical to
the end, first-divergence positions, and the int8 engine's top-1 along the float32
continuation, teacher-forced, which a single early flip cannot drag down), and perplexity on
held-out HotpotQA paragraphs scored through the engine (``prompt_logprobs``). The oneDNN
backend (float32, different rounding only) is measured beside it as the yardstick of what
float noise alone does to greedy text. Speed: decode batch 1 and 16 and prefill tokens/s of
each backend side by side, the bytes of the weights, and one projection's kernel timings
(``F.linear``, ``torch._weight_int8pack_mm``, dequantise-and-matmul) in float32 and bfloat16.
"""

from __future__ import annotations

import json
import math
import platform
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from ...errors import KvshareError
from ...kernels import backends
from ...kernels.quant import quantize_per_channel, weight_bytes
from ...serve.engine.llm_engine import LLM
from ...serve.sampling_params import SamplingParams
from ...splits import require_data_dir
from .common import engine_decode_rate, filler_prompt, setup, write_report as _write

PARTS = ("qkv", "o", "gate_up", "down")


def _hotpotqa(n_questions: int, n_paragraphs: int, tokenizer, min_tokens: int = 48) -> tuple[list[str], list[str]]:
    """The first questions of the held-out HotpotQA split, and paragraphs (of at least
    ``min_tokens`` tokens) from the records after them."""
    path = require_data_dir() / "hotpotqa" / "dev_hard_500.jsonl"
    records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    questions = [r["question"] for r in records[:n_questions]]
    paragraphs = []
    for record in records[n_questions:]:
        for _, sentences in record["context"]:
            text = "".join(sentences).strip()
            if len(tokenizer.encode(text, add_special_tokens=False)) >= min_tokens:
                paragraphs.append(text)
            if len(paragraphs) == n_paragraphs:
                return questions, paragraphs
    return questions, paragraphs


def _weight_bytes(llm: LLM) -> int:
    """Bytes of the embedding, the head (when it is not the embedding) and the projections."""
    model = llm.engine.model
    total = weight_bytes(model.embed)
    if model.lm_head is not model.embed:
        total += weight_bytes(model.lm_head)
    return total + sum(weight_bytes(layer[p]) for layer in model.layers for p in PARTS)


def _greedy(llm: LLM, prompts: list[list[int]], new: int) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=new, ignore_eos=True))]


def _agreement(reference: list[list[int]], other: list[list[int]]) -> dict:
    firsts = [next((i for i, (a, b) in enumerate(zip(r, o)) if a != b), len(r)) for r, o in zip(reference, other)]
    same = sum(a == b for r, o in zip(reference, other) for a, b in zip(r, o))
    return {"identical_tokens": same / sum(len(r) for r in reference),
            "identical_prompts": sum(f == len(r) for f, r in zip(firsts, reference)) / len(reference),
            "first_divergence": firsts}


def _teacher_forced_top1(llm: LLM, prompts: list[list[int]], continuations: list[list[int]]) -> float:
    """How often the engine's argmax is the reference's next token, along the reference's text."""
    outs = llm.generate([p + c for p, c in zip(prompts, continuations)], SamplingParams(max_tokens=1, prompt_logprobs=1))
    hits = total = 0
    for prompt, cont, out in zip(prompts, continuations, outs):
        for entry, token in zip(out.prompt_logprobs[len(prompt):], cont):
            hits += max(entry["top"], key=entry["top"].get) == token
            total += 1
    return hits / total


def _perplexity(llm: LLM, texts: list[list[int]]) -> float:
    outs = llm.generate(texts, SamplingParams(max_tokens=1, prompt_logprobs=0))
    logprobs = [e["logprob"] for out in outs for e in out.prompt_logprobs[1:]]
    return math.exp(-sum(logprobs) / len(logprobs))


def _prefill_rate(llm: LLM, prompt: list[int]) -> float:
    llm.engine.reset_prefix_cache()  # measure compute, not the cache
    start = time.perf_counter()
    llm.generate([prompt], SamplingParams(max_tokens=1))
    return len(prompt) / (time.perf_counter() - start)


def _kernel_timings(weight: torch.Tensor, rows: tuple[int, ...], budget_s: float = 0.3) -> list[dict]:
    """Microseconds per call of one projection: float ``F.linear``, the packed int8 kernel and
    dequantise-and-matmul, for float32 and bfloat16 activations."""
    def per_call(fn) -> float:
        fn()
        calls, start = 0, time.perf_counter()
        while calls < 3 or time.perf_counter() - start < budget_s:
            fn()
            calls += 1
        return (time.perf_counter() - start) / calls * 1e6

    out = []
    for dtype in (torch.float32, torch.bfloat16):
        w = weight.to(dtype)
        qw = quantize_per_channel(w)
        for n in rows:
            x = torch.randn(n, w.shape[1], dtype=dtype)
            row = {"dtype": str(dtype).removeprefix("torch."), "rows": n,
                   "float_us": per_call(lambda: F.linear(x, w)),
                   "dequantise_us": per_call(lambda: F.linear(x, qw.q.to(dtype)) * qw.scale)}
            if hasattr(torch, "_weight_int8pack_mm"):
                row["int8pack_us"] = per_call(lambda: torch._weight_int8pack_mm(x, qw.q, qw.scale))
            row["int8_backend_uses"] = "int8pack" if qw.packed_kernel else "dequantise"
            out.append(row)
    return out


def _cpu_flags() -> list[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return sorted(f for f in flags if f.startswith(("avx", "amx", "fma")))


def run_quant_bench(model: str = "smollm2-135m-instruct", dtype: str = "float32", threads: int = 2,
                    prompts: int = 20, new_tokens: int = 64, paragraphs: int = 32,
                    prefill_tokens: int = 512, out_dir: str | Path | None = None) -> dict:
    for name, value in (("prompts", prompts), ("new_tokens", new_tokens), ("paragraphs", paragraphs),
                        ("prefill_tokens", prefill_tokens)):
        if value < 1:
            raise KvshareError(f"{name.replace('_', '-')} must be at least 1")
    model_dir = setup(model, threads)
    # quality is always measured against float32: in another dtype a float32 engine joins as the reference
    reference = "torch" if dtype == "float32" else "float32"
    kinds = (["float32"] if reference == "float32" else []) + ["torch", "int8", "int4"] + (
        ["onednn"] if "onednn" in backends("linear") and dtype == "float32" else [])
    kv = max(prefill_tokens, 256) + 16 * (64 + new_tokens) + prompts * (160 + new_tokens) + 1024
    engines = {k: LLM(model_dir, kv_cache_tokens=kv, max_num_batched_tokens=max(prefill_tokens, 512),
                      dtype="float32" if k == "float32" else dtype, kernels="torch" if k == "float32" else k)
               for k in kinds}
    tokenizer = engines["torch"].engine.tokenizer
    questions, texts = _hotpotqa(prompts, paragraphs, tokenizer)
    chats = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
             for q in questions]
    chats = [c if isinstance(c, list) else c["input_ids"] for c in chats]
    texts = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    if not texts:
        raise KvshareError("no HotpotQA paragraph long enough to score after the greedy questions")
    results: dict = {"model": str(model), "dtype": dtype, "threads": threads, "backends": kinds, "reference": reference,
                     "torch_version": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                     "cpu_flags": _cpu_flags(), "machine": platform.processor() or platform.machine(),
                     "prompts": len(chats), "new_tokens": new_tokens,
                     "perplexity_paragraphs": len(texts), "perplexity_tokens": sum(len(t) - 1 for t in texts)}
    steps = tqdm(total=5, desc="bench quant", unit="figure")

    ref = _greedy(engines[reference], chats, new_tokens)
    results["greedy"] = {}
    for kind in (k for k in kinds if k != reference):
        agreement = _agreement(ref, _greedy(engines[kind], chats, new_tokens))
        agreement["teacher_forced_top1"] = _teacher_forced_top1(engines[kind], chats, ref)
        results["greedy"][kind] = agreement
    steps.update()
    results["perplexity"] = {k: _perplexity(engines[k], texts) for k in kinds}
    steps.update()
    results["weight_bytes"] = {k: _weight_bytes(engines[k]) for k in kinds if k in ("float32", "torch", "int8", "int4")}
    speed = {k: {} for k in kinds}
    short = filler_prompt(tokenizer, 32)
    batch = [filler_prompt(tokenizer, 32 + i)[-32:] for i in range(16)]
    long = filler_prompt(tokenizer, prefill_tokens)
    for kind in kinds:  # before the clock: each timed step size compiled (where the step is), each shape run once
        engines[kind].engine.warm_up((1, 16))
        engine_decode_rate(engines[kind], [short], 4)
        engine_decode_rate(engines[kind], batch, 4)
        _prefill_rate(engines[kind], long)
    for kind in kinds:
        speed[kind]["decode_b1"] = engine_decode_rate(engines[kind], [short], new_tokens)
    for kind in kinds:
        speed[kind]["decode_b16"] = engine_decode_rate(engines[kind], batch, max(8, new_tokens // 2))
    steps.update()
    for kind in kinds:
        speed[kind][f"prefill_{prefill_tokens}"] = _prefill_rate(engines[kind], long)
    results["speed"] = speed
    steps.update()
    gate_up = engines["torch"].engine.model.layers[0]["gate_up"]
    results["kernel_timings"] = {"shape": list(gate_up.shape),
                                 "rows": _kernel_timings(gate_up.float(), (1, 16, 128))}
    steps.update()
    steps.close()
    if out_dir:
        _write(results, out_dir, "quant_bench", markdown)
    return results


def markdown(results: dict) -> str:
    kinds = results["backends"]
    ref = results.get("reference", "torch")
    others = [k for k in kinds if k != ref]
    speed, ppl = results["speed"], results["perplexity"]
    head = f"| figure | {' | '.join(_label(k, results['dtype']) for k in kinds)} |"
    lines = [f"{results['model']}, {results['threads']} threads, torch {results['torch_version']}, "
             f"CPU capability {results['cpu_capability']}", "", head, "|---" * (len(kinds) + 1) + "|"]
    def row(label, values):
        lines.append(f"| {label} | {' | '.join(values)} |")
    for key in speed[kinds[0]]:
        name = {"decode_b1": "decode tok/s, batch 1", "decode_b16": "decode tok/s, batch 16"}.get(
            key, f"prefill tok/s, {key.split('_')[1]} tokens")
        base = speed[ref][key]
        row(name, [f"{speed[k][key]:.1f}" + ("" if k == ref else f" ({speed[k][key] / base:.2f}x)") for k in kinds])
    w = results["weight_bytes"]
    row("weight MiB (embedding + head + projections)",
        [f"{w[k] / 2**20:.0f}" + ("" if k == ref else f" ({w[k] / w[ref]:.2f}x)") if k in w else "as torch"
         for k in kinds])
    row(f"perplexity, {results['perplexity_paragraphs']} HotpotQA paragraphs ({results['perplexity_tokens']} tokens)",
        [f"{ppl[k]:.3f}" for k in kinds])
    g = results["greedy"]
    n, new = results["prompts"], results["new_tokens"]
    def quality(label, cell):
        row(label, ["(reference)" if k == ref else cell(g[k]) for k in kinds])
    quality(f"greedy vs float32 torch: identical tokens ({n} prompts x {new})", lambda q: f"{q['identical_tokens']:.1%}")
    quality("greedy: prompts identical to the end", lambda q: f"{q['identical_prompts']:.0%}")
    quality("greedy: first divergence, median position (of diverging prompts)",
            lambda q: _median_divergence(q["first_divergence"], new))
    quality("teacher-forced top-1 = float32 greedy token", lambda q: f"{q['teacher_forced_top1']:.1%}")
    k = results["kernel_timings"]
    lines += ["", f"One projection ({k['shape'][0]}x{k['shape'][1]}, the gate/up matmul), microseconds per call:", "",
              "| activations | rows | F.linear (float) | _weight_int8pack_mm | dequantise + F.linear | int8 backend uses |",
              "|---|---|---|---|---|---|"]
    for r in k["rows"]:
        lines.append(f"| {r['dtype']} | {r['rows']} | {r['float_us']:.0f} | {r.get('int8pack_us', float('nan')):.0f} | "
                     f"{r['dequantise_us']:.0f} | {r['int8_backend_uses']} |")
    return "\n".join(lines) + "\n"


def _label(kind: str, dtype: str) -> str:
    return {"float32": "torch (float32, the reference)", "torch": f"torch ({dtype})",
            "int8": f"int8 weights ({dtype} activations)",
            "int4": f"int4 weights, groups of 32 ({dtype} activations)",
            "onednn": f"onednn ({dtype})"}.get(kind, kind)


def _median_divergence(firsts: list[int], new: int) -> str:
    diverged = sorted(f for f in firsts if f < new)
    return f"{diverged[len(diverged) // 2]} ({len(diverged)} diverged)" if diverged else "none diverged"
