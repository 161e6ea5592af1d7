"""16 ICaRus agents branching off one shared 1.7k-token context (a map step of 16 agents): the
wall time from sending their calls (32 tokens each; the context already in the prefix cache) to
the last token, with the compiled step holding 8 adapters (``max_loras=8``: the second 8 agents'
calls wait for the first 8 to end, their adapters then swapped into the slots), 16 (one step of
16 pairs) and the eager step (what every step holding an adapter past the 8th loaded ran before
this session). bfloat16, 2 threads, buckets up to 128 rows; medians of 3.

    python results/workflow-e2e/session32-spr/many_agents.py
"""
import gc
import tempfile
import time

import torch
from transformers import AutoTokenizer

from kvshare.eval.perf.common import filler_prompt
from kvshare.models import resolve_model_dir
from kvshare.random_adapters import random_adapter
from kvshare.serve.engine.llm_engine import LLM
from kvshare.serve.exec.graph_cache import release_compiled_graphs
from kvshare.serve.sampling_params import SamplingParams

AGENTS, CONTEXT, NEW = 16, 1700, 32


def team_call(engine, prompts, adapters) -> float:
    """Seconds from sending every agent's call to the last one's end."""
    start = time.perf_counter()
    for prompt, adapter in zip(prompts, adapters):
        engine.add_request(prompt, SamplingParams(max_tokens=NEW, ignore_eos=True), adapter=adapter)
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - start


if __name__ == "__main__":
    torch.set_num_threads(2)
    model_dir = resolve_model_dir("smollm2-135m-instruct")
    context = filler_prompt(AutoTokenizer.from_pretrained(str(model_dir)), CONTEXT)
    prompts = [context + [(i * 7 + j) % 5000 + 100 for j in range(8)] for i in range(AGENTS)]
    names = [f"a{i}" for i in range(AGENTS)]
    with tempfile.TemporaryDirectory() as tmp:
        paths = [random_adapter("icarus", model_dir, tmp, name, seed=i) for i, name in enumerate(names)]
        for label, settings in (("compiled, max_loras 8", dict(compile="auto", max_loras=8)),
                                ("compiled, max_loras 16", dict(compile="auto", max_loras=16)),
                                ("eager", dict(compile="off"))):
            llm = LLM(model_dir, paths, kv_cache_tokens=(CONTEXT + 64) * 4 + 4096, dtype="bfloat16",
                      compile_max_rows=128, **settings)
            llm.engine.warm_up_all((8, 16, 32))
            team_call(llm.engine, prompts, names)  # warm-up; the shared context is cached from here on
            times = sorted(team_call(llm.engine, prompts, names) for _ in range(3))
            print(f"{label}: {times[1]:.2f} s for {AGENTS} x {NEW} tokens ({AGENTS * NEW / times[1]:.1f} tok/s)",
                  flush=True)
            del llm
            release_compiled_graphs()
            gc.collect()
