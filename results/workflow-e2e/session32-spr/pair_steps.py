"""Decode step time of N base sequences against N ICaRus sequences (each its own random adapter)
over 1.7k-token contexts, bfloat16, buckets up to 128 rows: what an 8-workflow ReAct point's
decode steps cost. Base and ICaRus steps alternate three times per N (medians).

    python results/workflow-e2e/session32-spr/pair_steps.py 1,4,8,16
"""
import statistics
import sys
import tempfile
import time

import torch
from transformers import AutoTokenizer

from kvshare.eval.perf.common import filler_prompt
from kvshare.models import resolve_model_dir
from kvshare.random_adapters import random_adapter
from kvshare.serve.engine.llm_engine import LLM
from kvshare.serve.sampling_params import SamplingParams

CONTEXT = 1700


def step_time(engine, prompts, adapters, steps=24):
    """The median decode step of these sequences together, their prefill done first."""
    for prompt, adapter in zip(prompts, adapters):
        engine.add_request(prompt, SamplingParams(max_tokens=steps + 2, ignore_eos=True), adapter=adapter)
    while engine._scheduler.waiting or any(s.num_computed < len(s.prompt) for s in engine._scheduler.running):
        engine.step()
    engine.step()
    times = []
    while engine.has_unfinished():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


if __name__ == "__main__":
    counts = [int(n) for n in sys.argv[1].split(",")]
    torch.set_num_threads(2)
    model_dir = resolve_model_dir("smollm2-135m-instruct")
    text = filler_prompt(AutoTokenizer.from_pretrained(str(model_dir)), CONTEXT)
    with tempfile.TemporaryDirectory() as tmp:
        llm = LLM(model_dir, kv_cache_tokens=(CONTEXT + 64) * 2 * max(counts) + 4096, dtype="bfloat16",
                  compile_max_rows=128)
        engine = llm.engine
        names = [engine.load_adapter(random_adapter("icarus", model_dir, tmp, f"a{i}", seed=i))
                 for i in range(max(counts))]
        engine.warm_up_all((1, 2, 4, 8, 16, 32))
        prompts = [[(i * 7 + j) % 5000 + 100 for j in range(8)] + text for i in range(max(counts))]
        for n in counts:
            step_time(engine, prompts[:n], names[:n], 4)
            step_time(engine, prompts[:n], [None] * n, 4)
            base, pair = [], []
            for _ in range(3):
                base.append(step_time(engine, prompts[:n], [None] * n))
                pair.append(step_time(engine, prompts[:n], names[:n]))
            ratio = statistics.median(p / b for b, p in zip(base, pair))
            print(f"N={n}: base {1000 * statistics.median(base):.1f} ms  icarus {1000 * statistics.median(pair):.1f} ms"
                  f"  ratio {ratio:.2f}", flush=True)
