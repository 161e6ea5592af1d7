"""Batch-1 decode of the int4 engine with its tied head in int8 groups (the default) against the
same engine with the head left bfloat16, alternately in one process, five rounds.

Runs at commit 0b39a2e, which had the int8-group head (reverted after this measurement).
``python results/engine-cpu-bf16/session22/q8_head_decode.py``: prints each round's tok/s
(64 tokens after a 32-token prompt, as ``kvshare bench engine`` takes batch-1 decode) and the
median ratio.
"""

from kvshare.eval.perf.common import engine_decode_rate, filler_prompt, setup
from kvshare.kernels.quant import Int4WeightOnlyLinear
from kvshare.serve import LLM


def engine(head_in_groups: bool) -> LLM:
    if not head_in_groups:  # the head the int4 backend had before: the bfloat16 embedding itself
        Int4WeightOnlyLinear.prepare_tied_head = staticmethod(lambda weight: weight)
    llm = LLM(setup("smollm2-135m-instruct", 2), [], dtype="bfloat16", kernels="int4,cpu", compile="on")
    llm.engine.warm_up((1,))
    return llm


if __name__ == "__main__":
    from kvshare.kernels import q8

    grouped = engine(True)
    plain = engine(False)
    assert isinstance(grouped.engine.runner.model.lm_head, q8.Q8Weight)
    assert not isinstance(plain.engine.runner.model.lm_head, q8.Q8Weight)
    prompt = filler_prompt(grouped.engine.tokenizer, 32)
    for llm in (grouped, plain):
        engine_decode_rate(llm, [prompt], 8)
    ratios = []
    for _ in range(5):
        a, b = engine_decode_rate(grouped, [prompt], 64), engine_decode_rate(plain, [prompt], 64)
        ratios.append(a / b)
        print(f"int8-group head {a:.1f} tok/s  bfloat16 head {b:.1f} tok/s  ratio {a / b:.2f}", flush=True)
    print(f"median ratio {sorted(ratios)[2]:.2f}")
