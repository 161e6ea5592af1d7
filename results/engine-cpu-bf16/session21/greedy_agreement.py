"""Greedy tokens of SmolLM2 (bfloat16, compiled step) with the projections in AVX512-BF16 dot
products against Inductor's GEMM template, each against the float32 eager engine and the bfloat16
eager one (``F.linear``).

``python results/engine-cpu-bf16/session21/greedy_agreement.py [TOKENS]``

The prompts are eight fixed sentences (``PROMPTS``). Prints,
per variant, the share of generated tokens equal to the float32 engine's up to the first
difference (the usual greedy-agreement figure), and the tokens identical between the two variants.
"""

import os
import sys
from pathlib import Path

from transformers import AutoTokenizer

from kvshare.serve import LLM, SamplingParams

PROMPTS = ["The history of the printing press begins", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.",
           "Q: A train travels 60 km in 45 minutes. What is its speed in km/h?\nA:",
           "Photosynthesis is the process by which", "The three laws of thermodynamics state that",
           "Once upon a time, in a village by the sea,", "To make a good cup of tea, you should",
           "The main differences between TCP and UDP are"]


def run(model: Path, dtype: str, compile: str, gemm: str, prompts, tokens: int) -> list[list[int]]:
    os.environ["KVSHARE_CPU_GEMM"] = gemm
    llm = LLM(model, [], dtype=dtype, compile=compile)
    outs = llm.generate(prompts, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
    return [o.token_ids for o in outs]


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Tokens equal up to each sequence's first difference, over all tokens."""
    same = 0
    for x, y in zip(a, b):
        n = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), len(x))
        same += n
    return same / sum(len(x) for x in a)


if __name__ == "__main__":
    tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 64
    model = Path.home() / ".cache/kvshare/models/smollm2-135m-instruct"
    tok = AutoTokenizer.from_pretrained(model)
    prompts = [tok.encode(p) for p in PROMPTS]
    ref = run(model, "float32", "off", "auto", prompts, tokens)
    vnni = run(model, "bfloat16", "on", "vnni", prompts, tokens)
    template = run(model, "bfloat16", "on", "inductor", prompts, tokens)
    eager = run(model, "bfloat16", "off", "auto", prompts, tokens)
    print(f"{len(prompts)} prompts x {tokens} greedy tokens")
    print(f"dot products vs float32 eager: {agreement(vnni, ref):.3f}")
    print(f"GEMM template vs float32 eager: {agreement(template, ref):.3f}")
    print(f"bfloat16 eager (F.linear) vs float32 eager: {agreement(eager, ref):.3f}")
    print(f"dot products vs GEMM template: {agreement(vnni, template):.3f}")
    print(f"dot products vs bfloat16 eager: {agreement(vnni, eager):.3f}")
    print(f"GEMM template vs bfloat16 eager: {agreement(template, eager):.3f}")
