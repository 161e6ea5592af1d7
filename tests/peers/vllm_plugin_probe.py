"""Run kvshare's vLLM plugin inside vLLM for tests/test_vllm_plugin.py (the peer venv's python).

kvshare is on ``PYTHONPATH`` as an unpacked wheel, so vLLM finds the plugin through its
``vllm.general_plugins`` entry point in every process it starts. This file imports vLLM only,
under ``if __name__ == "__main__"`` (vLLM's CPU build spawns its engine core, which re-imports
the main module). Each scenario starts from an empty prefix cache and runs its steps in order,
each step one ``generate`` call over its requests (greedy); the greedy tokens and vLLM's own
count of each request's cached prompt tokens (``num_cached_tokens``) go to ``--out``.

Scenarios JSON: ``{"name": [[{"prompt": [ids], "adapter": name or null}, ...], ...]}``.
"""

from __future__ import annotations

import argparse
import json


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--adapter", action="append", default=[], metavar="NAME=DIR")
    parser.add_argument("--scenarios", required=True)
    parser.add_argument("--new-tokens", type=int, required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    adapters = {name: LoRARequest(name, i + 1, path)
                for i, (name, path) in enumerate(item.split("=", 1) for item in args.adapter)}
    llm = LLM(model=args.model, dtype="float32", enable_lora=True, max_loras=len(adapters), max_lora_rank=8,
              enable_prefix_caching=True, enforce_eager=True, block_size=32, max_model_len=512, seed=0)
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    with open(args.scenarios) as handle:
        scenarios = json.load(handle)
    results = {}
    for name, steps in scenarios.items():
        llm.reset_prefix_cache()
        results[name] = []
        for step in steps:
            outputs = llm.generate([{"prompt_token_ids": r["prompt"]} for r in step], params, use_tqdm=False,
                                   lora_request=[adapters.get(r["adapter"]) for r in step])
            results[name].append([{"tokens": list(o.outputs[0].token_ids), "cached": o.num_cached_tokens}
                                  for o in outputs])
    import kvshare.serve.vllm_plugin as plugin

    results["plugin_registered"] = plugin._registered
    with open(args.out, "w") as handle:
        json.dump(results, handle)


if __name__ == "__main__":
    main()
