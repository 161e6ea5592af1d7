"""One start of the engine, in a fresh process, as ``kvshare bench startup`` times it.

Run as ``python -m kvshare.eval.perf.startup_probe SPEC.json``; prints one JSON line of
figures. Times are seconds since the parent's clock reading just before it started this
process (``t0`` in the spec), so they include Python's and torch's imports, as a user's first
command does. With ``compile auto`` the first requests run eager while the graphs they need
are lowered in the background; ``compiled_s`` is when the last of them was ready.
"""

from __future__ import annotations

import json
import resource
import sys
import time


def main(spec_path: str) -> None:
    spec = json.loads(open(spec_path).read())
    t0 = spec["t0"]
    import torch

    from kvshare.kernels import cpu
    from kvshare.serve import LLMEngine
    from kvshare.serve.exec.background_compile import compile_worker

    torch.set_num_threads(spec["threads"])
    imported = time.time() - t0
    kernels_on_disk = cpu.built_on_disk()  # else built during this start, in the background
    engine = LLMEngine(spec["model"], spec["adapters"], dtype=spec["dtype"], kv_cache_tokens=spec["kv_cache_tokens"])
    loaded = time.time() - t0
    names = [None, *(a.name for a in engine.adapters())]
    prompt = engine.tokenizer.encode(spec["prompt"], add_special_tokens=False)
    first = _decode(engine, [prompt], [names[0]], 1)  # one request, one token: the first answer
    first_token = time.time() - t0
    cold_rate = _rate(engine, prompt, names, spec["decode_tokens"])  # every agent decoding: what is compiled meanwhile
    compile_worker().wait_idle()
    compiled = time.time() - t0
    step = engine.compiled_step
    steady_rate = _rate(engine, prompt, names, spec["decode_tokens"])
    print(json.dumps({
        "imported_s": imported, "loaded_s": loaded, "first_token_s": first_token, "compiled_s": compiled,
        "kernels_on_disk_at_start": kernels_on_disk, "first_rate_tok_s": cold_rate, "steady_rate_tok_s": steady_rate, "first_tokens": first,
        "graphs": sorted(map(list, step.traced)) if step is not None else [],
        "graph_seconds": [seconds for _, seconds in compile_worker().done],
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "weights_mb": _weights_bytes(engine.model) / 2**20,
        "kv_pool_mb": engine.num_kv_blocks * engine.block_shape.block_bytes / 2**20,
    }), flush=True)


def _weights_bytes(model) -> int:
    """The model's weight tensors in memory, each counted once (a tied head is the embedding)."""
    import torch

    tensors = {t.data_ptr(): t for t in (model.embed, model.lm_head, *(v for layer in model.layers
                                                                         for v in layer.values()))
               if isinstance(t, torch.Tensor)}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _decode(engine, prompts: list[list[int]], names: list, tokens: int) -> list[list[int]]:
    from kvshare.serve import SamplingParams

    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    ids = [engine.add_request(p, params, adapter=n) for p, n in zip(prompts, names)]
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    return [done[i] for i in ids]


def _rate(engine, prompt: list[int], names: list, tokens: int) -> float:
    """Generated tokens a second, every agent (the base and each adapter) decoding together."""
    start = time.perf_counter()
    _decode(engine, [prompt] * len(names), names, tokens)
    return len(names) * tokens / (time.perf_counter() - start)


if __name__ == "__main__":
    main(sys.argv[1])
