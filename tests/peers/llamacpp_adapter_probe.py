"""Run adapter GGUFs in llama.cpp for tests/test_llamacpp_adapters.py (the peer venv's python).

This file must not import kvshare or torch (the peer venv has neither). It drives llama.cpp's
C API through llama-cpp-python: for each case, the KV memory is cleared, the prompt's first
``activate_at`` tokens are decoded with no adapter (aLoRA: the base computes them, as a
cache shared with the base would hold them), the rest with the adapter at scale 1, then
``new_tokens`` greedy tokens with the adapter. K/V are kept in float32 and flash attention is
off: llama.cpp's defaults (float16 K/V, its CPU flash attention in float16) move SmolLM2's logits
by about 0.05, which would hide an adapter's error; without them the base is within 1e-4. The logits of every prompt position and the
greedy tokens are saved to an ``.npz``; llama.cpp's log goes to stderr.

Cases JSON: ``[{"name", "adapter": path or null, "tokens": [ids], "activate_at": int, "new_tokens": int}]``.
"""

from __future__ import annotations

import argparse
import ctypes
import json


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", required=True)
    parser.add_argument("--cases", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    import llama_cpp as lc
    import numpy as np

    with open(args.cases) as handle:
        cases = json.load(handle)
    lc.llama_backend_init()
    model_params = lc.llama_model_default_params()
    model_params.use_extra_bufts = False  # no CPU repacking: see eval/perf/llamacpp_engine_probe.py
    model = lc.llama_model_load_from_file(args.gguf.encode(), model_params)
    if not model:
        raise SystemExit(f"llama.cpp could not load {args.gguf}")
    n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
    params = lc.llama_context_default_params()
    params.n_ctx = params.n_batch = 512
    params.n_threads = params.n_threads_batch = args.threads
    params.type_k = params.type_v = lc.GGML_TYPE_F32  # llama.cpp keeps K/V in float16 by default
    params.flash_attn_type = lc.LLAMA_FLASH_ATTN_TYPE_DISABLED
    ctx = lc.llama_init_from_model(model, params)
    batch = lc.llama_batch_init(512, 0, 1)
    adapters = {}

    def use(path: str | None) -> None:
        if path is None:
            lc.llama_set_adapters_lora(ctx, None, 0, None)
            return
        if path not in adapters:
            adapters[path] = lc.llama_adapter_lora_init(model, path.encode())
            if not adapters[path]:
                raise SystemExit(f"llama.cpp could not load the adapter {path}")
        lc.llama_set_adapters_lora(ctx, (lc.llama_adapter_lora_p_ctypes * 1)(adapters[path]), 1,
                                  (ctypes.c_float * 1)(1.0))

    def decode(tokens: list[int], start: int) -> list:
        batch.n_tokens = len(tokens)
        for i, token in enumerate(tokens):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, start + i, 1, True
            batch.seq_id[i][0] = 0
        if lc.llama_decode(ctx, batch) != 0:
            raise SystemExit("llama_decode failed")
        return [np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, i), shape=(n_vocab,)).copy()
                for i in range(len(tokens))]

    saved, summary = {}, {}
    for case in cases:
        lc.llama_memory_clear(lc.llama_get_memory(ctx), True)
        tokens, split = case["tokens"], case["activate_at"]
        use(None)
        logits = decode(tokens[:split], 0) if split else []
        use(case["adapter"])
        logits += decode(tokens[split:], split)
        generated, last = [], logits[-1]
        for _ in range(case["new_tokens"]):
            generated.append(int(np.argmax(last)))
            last = decode([generated[-1]], len(tokens) + len(generated) - 1)[0]
        saved[f"{case['name']}.logits"] = np.stack(logits).astype(np.float32)
        saved[f"{case['name']}.generated"] = np.array(generated, dtype=np.int64)
        summary[case["name"]] = generated
    np.savez(args.out, **saved)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
