"""llama.cpp's figures for ``kvshare bench engine``, run by the llama.cpp peer venv's python.

This file must not import kvshare (the peer venv does not have it). It loads the zoo's GGUF
(Q4_1 weights) through llama-cpp-python's bindings of llama.cpp's C API, takes the exact
prompt token ids the bench gave kvshare and Hugging Face (a JSON file), and prints one JSON
line on stdout (llama.cpp's own log goes to stderr). Its ``Llama`` class runs one sequence
and keeps a prefix cache, so the C API is used directly: one ``llama_decode`` per step over
every sequence, the KV memory cleared before each measurement, greedy argmax in numpy.

- decode tokens/s = batch x (N - 1) / time of N - 1 decode steps after the prompt: the
  prompt is evaluated and its first token picked untimed, then each step feeds every
  sequence its last greedy token (the prefill is outside the timer, not subtracted);
- batch 16: 16 sequences in one context (``n_seq_max`` 16), one token each per step;
- prefill tokens/s = prompt tokens / time of one ``llama_decode`` of the whole prompt into
  an emptied KV memory (llama.cpp splits it into ``n_ubatch`` micro-batches).

Each measurement runs once untimed first. ``--threads`` threads, for single tokens and batches.
Flash attention and micro-batch size are llama.cpp's defaults. Weights load without llama.cpp's
"extra" buffer types (``--no-repack``): on CPUs with AMX it repacks Q4_1 for its AMX matmul,
which segfaults on the first decode (llama.cpp issue 20824; seen on the reference machine). Its
other CPU repack layouts have no Q4_1 and leave the Q8_0 embedding (the tied LM head) as it is,
so nothing else changes: a build without AMX, repacking on, measured the same speed.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
import time


def _arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", required=True, help="the model's GGUF file")
    parser.add_argument("--prompts", required=True,
                        help='JSON: {"decode_b1": [[ids]], "decode_b16": [[ids], ...], "prefill": {"LEN": [ids]}}')
    parser.add_argument("--new-tokens", type=int, required=True)
    parser.add_argument("--threads", type=int, required=True)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = _arguments(argv)
    import llama_cpp as lc
    import numpy as np

    with open(args.prompts) as handle:
        prompts = json.load(handle)
    lc.llama_backend_init()
    started = time.perf_counter()
    model_params = lc.llama_model_default_params()
    model_params.n_gpu_layers = 0
    model_params.use_extra_bufts = False  # llama.cpp's --no-repack: see the module docstring
    model = lc.llama_model_load_from_file(args.gguf.encode(), model_params)
    if not model:
        raise SystemExit(f"llama.cpp could not load {args.gguf}")
    startup = time.perf_counter() - started
    n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
    desc = ctypes.create_string_buffer(256)
    lc.llama_model_desc(model, desc, len(desc))

    kv_type = lc.llama_context_default_params().type_k

    def context(n_ctx: int, n_seq: int, n_batch: int):
        params = lc.llama_context_default_params()  # flash attention: llama.cpp's default (auto)
        params.n_ctx, params.n_seq_max, params.n_batch = n_ctx, n_seq, n_batch
        params.n_threads = params.n_threads_batch = args.threads
        ctx = lc.llama_init_from_model(model, params)
        if not ctx:
            raise SystemExit(f"llama.cpp could not make a context of {n_ctx} tokens, {n_seq} sequences")
        return ctx

    def fill(batch, entries: list[tuple[int, int, int, bool]]) -> None:
        """Put (token, position, sequence, wants logits) entries into a llama_batch."""
        batch.n_tokens = len(entries)
        for i, (token, pos, seq, logits) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, pos, 1, logits
            batch.seq_id[i][0] = seq

    def decode(ctx, batch) -> None:
        if lc.llama_decode(ctx, batch) != 0:
            raise SystemExit(f"llama_decode failed on a batch of {batch.n_tokens} tokens")

    def greedy(ctx, index: int) -> int:
        return int(np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, index), shape=(n_vocab,)).argmax())

    def decode_rate(ids: list[list[int]]) -> float:
        """Tokens/s of N - 1 decode steps over these sequences together, prompts evaluated first."""
        need = max(map(len, ids)) + args.new_tokens + 1
        ctx = context(len(ids) * (need + 255) // 256 * 256, len(ids), max(256, sum(map(len, ids))))
        batch = lc.llama_batch_init(max(256, sum(map(len, ids))), 0, 1)
        try:
            def run() -> float:
                lc.llama_memory_clear(lc.llama_get_memory(ctx), True)
                entries = [(t, p, s, p == len(seq) - 1) for s, seq in enumerate(ids) for p, t in enumerate(seq)]
                fill(batch, entries)
                decode(ctx, batch)
                last = [greedy(ctx, i) for i, e in enumerate(entries) if e[3]]
                start = time.perf_counter()
                for step in range(args.new_tokens - 1):
                    fill(batch, [(t, len(seq) + step, s, True) for s, (t, seq) in enumerate(zip(last, ids))])
                    decode(ctx, batch)
                    last = [greedy(ctx, s) for s in range(len(ids))]
                return time.perf_counter() - start
            run()
            return len(ids) * (args.new_tokens - 1) / run()
        finally:
            lc.llama_batch_free(batch)
            lc.llama_free(ctx)

    results = {"engine": "llama.cpp", "version": lc.__version__, "model": desc.value.decode(),
               "weights": "Q4_1", "startup_s": startup, "threads": args.threads,
               "decode_b1": decode_rate(prompts["decode_b1"]),
               "decode_b16": decode_rate(prompts["decode_b16"])}
    longest = max([len(ids) for ids in prompts["prefill"].values()] + [1])
    ctx = context((longest + 255) // 256 * 256, 1, longest)
    batch = lc.llama_batch_init(longest, 0, 1)
    for length, ids in prompts["prefill"].items():
        fill(batch, [(t, p, 0, p == len(ids) - 1) for p, t in enumerate(ids)])
        times = []
        for _ in range(2):  # the first, untimed, pays this size's set-up
            lc.llama_memory_clear(lc.llama_get_memory(ctx), True)
            start = time.perf_counter()
            decode(ctx, batch)
            times.append(time.perf_counter() - start)
        results[f"prefill_{length}"] = len(ids) / times[-1]
    results.update(n_ubatch=lc.llama_n_ubatch(ctx), repack=False,
                   kv_cache_type=_GGML_TYPES.get(kv_type, str(kv_type)),
                   system_info=lc.llama_print_system_info().decode().strip())
    lc.llama_batch_free(batch)
    lc.llama_free(ctx)
    lc.llama_model_free(model)
    print(json.dumps(results), flush=True)
    sys.stdout.flush()


_GGML_TYPES = {0: "f32", 1: "f16", 8: "q8_0", 30: "bf16"}  # ggml_type values a KV cache takes


if __name__ == "__main__":
    main()
