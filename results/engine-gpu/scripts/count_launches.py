"""How many kernels a CUDA graph of a decode step records: a base step against an ICaRus pair
step (one sequence, its base and adapter rows), with the graph's LoRA as BGMV kernels and in
the gather form it had before (``serve/lora_slots.lora_delta``, added into the output slice).

Runs on CPU: :class:`GraphedStep` with ``capture=False`` executes what a graph would record,
through Triton's interpreter, under :func:`kvshare.kernels.triton.launch_count.count_launches`
(torch ops that launch a kernel on a GPU, plus Triton launches). A GPU
step of a small model is about as long as its kernel count times a few microseconds
(results/engine-gpu/README.md), so the ratio is the pair step's expected cost; the real one
needs a GPU (graphs.sh).

    python results/engine-gpu/scripts/count_launches.py [model] [icarus-adapter]
"""

import os
import sys
import tempfile

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

import kvshare.kernels.triton.bgmv as bgmv  # noqa: E402
from kvshare.kernels.triton.launch_count import count_launches  # noqa: E402
from kvshare.models import resolve_model_dir  # noqa: E402
from kvshare.random_adapters import random_adapter  # noqa: E402
from kvshare.serve import LLM  # noqa: E402
from kvshare.serve.exec.cuda_graphs import GraphedStep  # noqa: E402
from kvshare.serve.exec.lora_slots import lora_delta  # noqa: E402


def gather_form(y, x, a, b_t, index, scale):
    """The graph's LoRA before the BGMV kernels, ``out[:, cols] += lora_delta(...)`` on the
    projection's output: Python adds in place, then assigns the slice back (a copy)."""
    y.copy_(y + lora_delta(x, a, b_t, index, scale))


def count(step, kv, adapted):
    with torch.no_grad(), count_launches() as counts:
        step._decode(kv, 2, adapted, 2 if adapted else 1)
    return sum(counts.values())


def main():
    model = str(resolve_model_dir(sys.argv[1] if len(sys.argv) > 1 else "smollm2-135m-instruct"))
    with tempfile.TemporaryDirectory() as tmp:
        adapter = sys.argv[2] if len(sys.argv) > 2 else random_adapter("icarus", model, tmp, "icarus", rank=16)
        llm = LLM(model, [adapter], kv_cache_tokens=1024, block_size=16, kernels="triton", compile="off")
        engine = llm.engine
        step = GraphedStep(engine.runner.model, 16, 16, capture=False)
        step.warm_up(engine.runner.kv_cache, (2,), adapted=True, adapters=engine._adapters)
        print(f"model {model}; adapted projections {list(step.lora.parts)}, stack rank {step.lora.rank}")
        base = count(step, engine.runner.kv_cache, False)
        print(f"base step (1 row):                 {base} kernels")
        real, real_parts = bgmv.bgmv_lora_add, bgmv.bgmv_lora_add_parts
        forms = (("bgmv, a launch per fused projection", real, real_parts),  # session 27
                 ("bgmv, a launch per part", real, bgmv._each_part),  # session 25
                 ("gather", gather_form, bgmv._each_part))  # session 24
        for form, add, add_parts in forms:
            bgmv.bgmv_lora_add, bgmv.bgmv_lora_add_parts = add, add_parts
            pair = count(step, engine.runner.kv_cache, True)
            print(f"ICaRus pair step (2 rows), {form:35}: {pair} kernels = {pair / base:.2f}x the base step")
        bgmv.bgmv_lora_add, bgmv.bgmv_lora_add_parts = real, real_parts


if __name__ == "__main__":
    main()
