"""A 1,536-token prefill through the eager bfloat16 engine, prompt chunks in the kernel's
AVX512-BF16 path against SDPA, alternating in one process.

    python results/cpu-attention/session20/prefill.py > results/cpu-attention/session20/prefill.txt

SmolLM2, 2 threads, HotpotQA contexts of issue 17's workflow (cut to 1,536 tokens), 1,024 rows
per step (two steps: 1,024 rows, then 512 after them), prefix cache reset before each prompt.
"""
import statistics
import time

from kvshare.eval.perf.common import setup
from kvshare.eval.perf.workflow import hotpot_contexts
from kvshare.kernels import cpu
from kvshare.serve.engine.llm_engine import LLMEngine
from kvshare.serve.sampling_params import SamplingParams

if __name__ == "__main__":
    engine = LLMEngine(setup("smollm2-135m-instruct", 2), dtype="bfloat16", kv_cache_tokens=4096, compile="off",
                       max_num_batched_tokens=1024)
    contexts = hotpot_contexts(engine.tokenizer, 4, 1536)
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    ext = cpu.extension()
    times = {"kernel": [], "sdpa": []}
    for round_ in range(4):
        for name in ("kernel", "sdpa"):
            ext.paged_attention_set_dpbf16(name == "kernel")
            engine.reset_prefix_cache()
            engine.add_request(contexts[round_], params)
            start = time.perf_counter()
            while engine.has_unfinished():
                engine.step()
            if round_:  # the first round warms both up
                times[name].append(time.perf_counter() - start)
    ext.paged_attention_set_dpbf16(True)
    for name, values in times.items():
        print(f"{name}: median {1000 * statistics.median(values):.0f} ms ({', '.join(f'{1000 * v:.0f}' for v in values)})")
    print(f"sdpa / kernel: {statistics.median(times['sdpa']) / statistics.median(times['kernel']):.2f}x "
          f"(chunk path {ext.paged_attention_chunk_path()!r})")
