"""Prefill of 1024 tokens on SmolLM2-135M: kvshare (bfloat16, auto kernels) against HF float32
with all logits (the old measure) and with the last position's only (the fixed one); 3 rounds,
each measuring the three in turn, medians of each figure and of the per-round ratios."""
import statistics, time, torch
from transformers import AutoModelForCausalLM
from kvshare.eval.perf.common import setup, filler_prompt
from kvshare.eval.perf.engine import _engine_prefill_rate, _hf_prefill_rate
from kvshare.models import load_tokenizer
from kvshare.serve import LLM

model_dir = setup("smollm2-135m-instruct", 2)
prompt = filler_prompt(load_tokenizer(model_dir), 1024)
hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
llm = LLM(model_dir, kv_cache_tokens=4096, max_num_batched_tokens=1024, dtype="bfloat16")

def hf_all_logits(prompt):
    with torch.no_grad():
        hf(torch.tensor([prompt]))
        start = time.perf_counter()
        hf(torch.tensor([prompt]))
        return len(prompt) / (time.perf_counter() - start)

rows = []
for _ in range(3):
    k = _engine_prefill_rate(llm, prompt)
    old = hf_all_logits(prompt)
    new = _hf_prefill_rate(hf, prompt)
    rows.append((k, old, new))
    print(f"kvshare {k:.1f} tok/s | HF all logits {old:.1f} | HF last logits {new:.1f} | "
          f"ratios {k / old:.2f}x / {k / new:.2f}x", flush=True)
med = lambda xs: statistics.median(xs)
print(f"medians: kvshare {med([r[0] for r in rows]):.1f}, HF all {med([r[1] for r in rows]):.1f}, "
      f"HF last {med([r[2] for r in rows]):.1f}; kvshare/HF: {med([r[0] / r[1] for r in rows]):.2f}x (old measure), "
      f"{med([r[0] / r[2] for r in rows]):.2f}x (fixed)")
