"""Batch-16 and batch-1 decode steps of the bfloat16 compiled step with its head in dot products
up to 16 rows (before this session) and up to ``cpu_linear.head_rows()`` rows (6 on AMX),
alternating in one engine, medians of 5 alternations of 24 steps.

``python results/engine-cpu-bf16/session30-spr/head_rows_engine.py`` (repo root, venv active).
"""

import time

from kvshare.kernels.cpu import linear as cpu_linear
from kvshare.serve import LLM, SamplingParams


def step_ms(llm: LLM, batch: int, steps: int = 24) -> float:
    engine = llm.engine
    for i in range(batch):
        engine.add_request(list(range(100 + i, 356 + i)), SamplingParams(max_tokens=steps + 2, ignore_eos=True))
    while any(s.num_computed < len(s.prompt) for s in engine.sequences.values()):
        engine.step()  # the prefills
    engine.step()
    start, n = time.perf_counter(), 0
    while engine.has_unfinished():
        engine.step()
        n += 1
    return (time.perf_counter() - start) / n * 1e3


if __name__ == "__main__":
    llm = LLM("smollm2-135m-instruct", dtype="bfloat16", kv_cache_tokens=16384)
    compiled = llm.engine.runner.compiled
    for batch in (16, 1):
        step_ms(llm, batch, 4)  # compiles the bucket
        times = {16: [], cpu_linear.head_rows(): []}
        for _ in range(5):
            for rows in times:
                compiled._head_rows = rows
                times[rows].append(step_ms(llm, batch))
        medians = {rows: sorted(t)[2] for rows, t in times.items()}
        print(f"batch {batch}: " + ", ".join(f"head in dot products up to {rows} rows {ms:.2f} ms"
                                              for rows, ms in medians.items()), flush=True)
