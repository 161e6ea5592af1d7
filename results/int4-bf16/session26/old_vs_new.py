"""Int4 quality with the quantiser before session 26 (zero rounded after the scale; q from the
unrounded-scale zero) and after it (zero rounded first, scale sized around it), side by side
against float32, in one run: perplexity, teacher-forced top-1 and greedy agreement, as
`kvshare bench quant` measures them.

    KVSHARE_DATA=../shared/data python results/int4-bf16/session26/old_vs_new.py results/int4-bf16/session26
"""

import json
import sys
from pathlib import Path

import torch

import kvshare.kernels.quant as quant
from kvshare.eval.perf import quant as bench
from kvshare.eval.perf.common import setup
from kvshare.serve import LLM


def old_quantize_int4(weight: torch.Tensor, group: int = quant.INT4_GROUP) -> quant.Int4Weight:
    """The quantiser as it was at 4bc3487 (kernels/quant.py)."""
    n_out, n_in = weight.shape
    w = weight.detach().to(torch.float32).reshape(n_out, n_in // group, group)
    low, high = w.amin(-1), w.amax(-1)
    scale = ((high - low) / 15).to(weight.dtype).float()
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    zero = (low + 8 * scale).to(weight.dtype).float()
    q = torch.round((w - (zero - 8 * scale)[..., None]) / scale[..., None]).clamp_(0, 15)
    packed = torch._convert_weight_to_int4pack_for_cpu(q.reshape(n_out, n_in).to(torch.int32), 1)
    scales_zeros = torch.stack([scale, zero], -1).transpose(0, 1).to(weight.dtype).contiguous()
    return quant.Int4Weight(packed, scales_zeros, group)


def main(out: Path) -> None:
    model_dir = setup("smollm2-135m-instruct", 2)
    reference = LLM(model_dir, kv_cache_tokens=8192, max_num_batched_tokens=512, dtype="float32", kernels="torch")
    new = LLM(model_dir, kv_cache_tokens=8192, max_num_batched_tokens=512, dtype="bfloat16", kernels="int4")
    current = quant.quantize_int4
    quant.quantize_int4 = old_quantize_int4
    try:
        old = LLM(model_dir, kv_cache_tokens=8192, max_num_batched_tokens=512, dtype="bfloat16", kernels="int4")
    finally:
        quant.quantize_int4 = current
    tokenizer = reference.engine.tokenizer
    questions, texts = bench._hotpotqa(20, 32, tokenizer)
    chats = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
             for q in questions]
    chats = [c if isinstance(c, list) else c["input_ids"] for c in chats]
    texts = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    ref = bench._greedy(reference, chats, 64)
    results = {"perplexity": {"float32": bench._perplexity(reference, texts)}, "greedy": {}}
    for name, llm in (("int4 before", old), ("int4 after", new)):
        agreement = bench._agreement(ref, bench._greedy(llm, chats, 64))
        agreement["teacher_forced_top1"] = bench._teacher_forced_top1(llm, chats, ref)
        results["greedy"][name] = agreement
        results["perplexity"][name] = bench._perplexity(llm, texts)
    out.mkdir(parents=True, exist_ok=True)
    (out / "old_vs_new.json").write_text(json.dumps(results, indent=1))
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
