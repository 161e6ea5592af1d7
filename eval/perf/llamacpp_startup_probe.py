"""One llama.cpp start for ``kvshare bench startup``, run by the llama.cpp peer venv's python.

This file must not import kvshare (the peer venv does not have it). It loads the GGUF through
llama-cpp-python's bindings of llama.cpp's C API (as :mod:`.llamacpp_engine_probe` does, weights
without the "extra" repacked buffers), evaluates the prompt and picks the first token greedily,
and prints one JSON line: seconds since ``--t0`` (the parent's clock just before it launched this
process, so Python's and llama.cpp's imports count) to the model loaded and to the first token.
"""

from __future__ import annotations

import argparse
import json
import resource
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", required=True)
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--t0", type=float, required=True)
    args = parser.parse_args()
    import llama_cpp as lc
    import numpy as np

    lc.llama_backend_init()
    params = lc.llama_model_default_params()
    params.n_gpu_layers = 0
    params.use_extra_bufts = False  # llama.cpp's --no-repack (see llamacpp_engine_probe)
    model = lc.llama_model_load_from_file(args.gguf.encode(), params)
    if not model:
        raise SystemExit(f"llama.cpp could not load {args.gguf}")
    loaded = time.time() - args.t0
    vocab = lc.llama_model_get_vocab(model)
    text = args.prompt.encode()
    ids = (lc.llama_token * (len(text) + 8))()
    count = lc.llama_tokenize(vocab, text, len(text), ids, len(ids), True, False)
    context_params = lc.llama_context_default_params()
    context_params.n_ctx, context_params.n_threads, context_params.n_threads_batch = 512, args.threads, args.threads
    context = lc.llama_init_from_model(model, context_params)
    if lc.llama_decode(context, lc.llama_batch_get_one(ids, count)) != 0:
        raise SystemExit("llama_decode failed")
    logits = np.ctypeslib.as_array(lc.llama_get_logits_ith(context, -1), shape=(lc.llama_vocab_n_tokens(vocab),))
    first = int(logits.argmax())
    print(json.dumps({"loaded_s": loaded, "first_token_s": time.time() - args.t0, "first_tokens": [[first]],
                      "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}), flush=True)
    lc.llama_free(context)
    lc.llama_model_free(model)


if __name__ == "__main__":
    main()
