"""Batch-1 decode tok/s of the int4 engine as ``kvshare bench engine`` takes it, three times in
one process. ``python drift.py int4,cpu VARIANT``: VARIANT ``plain`` (default engine settings),
``cfg`` (the bench's pool and token budget), ``hf,cfg`` (also transformers' float32 model loaded
beside it, as in the bench). Run in seven processes one after another (drift.txt): the variants
did not matter, the minute did."""
import sys, time, torch
from pathlib import Path
from kvshare.serve import LLM, SamplingParams
from kvshare.eval.perf.common import filler_prompt, engine_decode_rate, setup
model = setup("smollm2-135m-instruct", 2)
kernels = sys.argv[1]
variant = sys.argv[2]
if "hf" in variant:
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
kw = dict(kv_cache_tokens=4096 + 16 * (256 + 64) + 2048, max_num_batched_tokens=4096) if "cfg" in variant else {}
llm = LLM(model, [], dtype="bfloat16", compile="on", kernels=kernels, **kw)
llm.engine.warm_up((1, 16))
short = filler_prompt(llm.engine.tokenizer, 32)
engine_decode_rate(llm, [short], 4)
llm.engine.reset_prefix_cache()
for _ in range(3):
    print(variant, f"{engine_decode_rate(llm, [short], 64):.1f} tok/s", flush=True)
