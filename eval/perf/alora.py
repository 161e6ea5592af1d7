"""``kvshare bench alora``: the aLoRA pipeline against conventional LoRA, by prompt length.

Pipeline per prompt: the base answers a prompt x (16 tokens, y); an adapter evaluates
x + y (+ its invocation) with 16 tokens (z); the base continues after x + y + z. An aLoRA
evaluator reuses the base's KV for x + y; a conventional LoRA evaluator must prefill all of
it. Also the variant where 5 adapters evaluate x + y in parallel. Reports the evaluation
step's time to first token, prefill (= TTFT), decode, end-to-end and hit rate, and the whole
pipeline's time, as JSON and a markdown table. Adapters are random.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from tqdm import tqdm

from ...random_adapters import random_adapter
from ...serve.engine.llm_engine import LLMEngine
from .common import filler_prompt, run_requests as _run, setup, write_report

TARGETS = ("q_proj", "k_proj", "v_proj")


def run_alora_bench(model: str = "smollm2-135m-instruct", lengths: tuple[int, ...] = (256, 1024, 2048, 4096, 7680),
                    evaluators: int = 5, new_tokens: int = 16, dtype: str = "float32", threads: int = 2,
                    out_dir: str | Path | None = None) -> dict:
    model_dir = setup(model, threads)
    rows = []
    bar = tqdm(total=2 * len(lengths), desc="bench alora", unit="point")
    with tempfile.TemporaryDirectory(prefix="kvshare-alora-") as tmp:
        for mode in ("alora", "lora"):
            engine = LLMEngine(model_dir, dtype=dtype, max_num_batched_tokens=2048,
                               kv_cache_tokens=(evaluators + 2) * (max(lengths) + 4 * new_tokens + 64))
            tok = engine.tokenizer
            names, invocations = [], []
            for i in range(evaluators):
                invocation = f"<|im_start|>judge{i}<|im_end|>"
                path = random_adapter(mode, model_dir, tmp, f"{mode}-{i}", seed=i, rank=32, targets=TARGETS,
                                      invocation=invocation, tokenizer=tok)
                names.append(engine.load_adapter(path))
                invocations.append(tok.encode(invocation, add_special_tokens=False) if mode == "alora" else [])
            engine.warm_up_all()  # a compiled CPU step compiles each bucket on first use: not inside a timing
            for length in lengths:
                engine.reset_prefix_cache()  # also zeroes the hit and eviction counters
                x = filler_prompt(tok, length)
                (answer,), t_answer = _run(engine, [(x, None)], new_tokens)
                xy = x + answer.token_ids
                (judge,), t_judge = _run(engine, [(xy + invocations[0], names[0])], new_tokens)
                z = invocations[0] + judge.token_ids
                (_,), t_continue = _run(engine, [(xy + z, None)], new_tokens)
                parallel, t_parallel = _run(engine, [(xy + invocations[i], names[i]) for i in range(evaluators)],
                                            new_tokens)
                m = judge.metrics
                rows.append({
                    "mode": mode, "prompt_tokens": length,
                    "eval_ttft_s": m["time_to_first_token"], "eval_prefill_s": m["time_to_first_token"],
                    "eval_decode_s": m["e2e_time"] - m["time_to_first_token"], "eval_e2e_s": m["e2e_time"],
                    "eval_prompt_tokens_cached": m["prompt_tokens_cached"],
                    "eval_hit_rate": m["prompt_tokens_cached"] / m["prompt_tokens"],
                    "pipeline_s": t_answer + t_judge + t_continue,
                    f"parallel_{evaluators}_ttft_s_max": max(o.metrics["time_to_first_token"] for o in parallel),
                    f"parallel_{evaluators}_e2e_s": t_parallel,
                })
                bar.update()
    bar.close()
    results = {"model": str(model), "dtype": dtype, "threads": threads, "new_tokens": new_tokens,
               "evaluators": evaluators, "adapters": "random (rank 32, q/k/v); speed does not depend on values",
               "rows": rows}
    if out_dir:
        write_report(results, out_dir, "alora_bench", markdown)
    return results


def markdown(results: dict) -> str:
    n = results["evaluators"]
    by = {(r["mode"], r["prompt_tokens"]): r for r in results["rows"]}
    lines = [f"| prompt tokens | eval TTFT aLoRA s | eval TTFT LoRA s | TTFT speedup | eval decode aLoRA / LoRA s | "
             f"eval e2e speedup | hit rate aLoRA / LoRA | pipeline speedup | {n} parallel evaluators e2e speedup |",
             "|---|---|---|---|---|---|---|---|---|"]
    for length in sorted({r["prompt_tokens"] for r in results["rows"]}):
        a, b = by.get(("alora", length)), by.get(("lora", length))
        if not a or not b:
            continue
        lines.append(
            f"| {length} | {a['eval_ttft_s']:.3f} | {b['eval_ttft_s']:.3f} | {b['eval_ttft_s'] / a['eval_ttft_s']:.1f}x | "
            f"{a['eval_decode_s']:.2f} / {b['eval_decode_s']:.2f} | {b['eval_e2e_s'] / a['eval_e2e_s']:.1f}x | "
            f"{a['eval_hit_rate']:.2f} / {b['eval_hit_rate']:.2f} | {b['pipeline_s'] / a['pipeline_s']:.2f}x | "
            f"{b[f'parallel_{n}_e2e_s'] / a[f'parallel_{n}_e2e_s']:.1f}x |")
    return "\n".join(lines) + "\n"
