"""The main job in one command: get the reference model with no hub and make it answer."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from . import zoo
from .models import load_model


def run_demo(model: str = "smollm2-135m-instruct", prompt: str = "Hello!",
             max_new_tokens: int = 48) -> str:
    """Pull the model if it is a zoo name not yet pulled, then answer ``prompt`` greedily."""
    if model in zoo.ZOO and not Path(model).is_dir():
        zoo.pull(model, log=lambda msg: print(msg, file=sys.stderr))
    llm, tokenizer = load_model(model)
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt",
        return_dict=True,
    )["input_ids"]
    start = time.perf_counter()
    with torch.no_grad():
        out = llm.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                           pad_token_id=tokenizer.pad_token_id)
    seconds = time.perf_counter() - start
    new = out[0, ids.shape[1]:]
    answer = tokenizer.decode(new, skip_special_tokens=True).strip()
    print(f"user: {prompt}")
    print(f"assistant: {answer}")
    print(f"({len(new)} tokens in {seconds:.2f} s, {len(new) / seconds:.1f} tok/s)", file=sys.stderr)
    return answer
