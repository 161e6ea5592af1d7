"""Supported model families: the one file to touch to add one.

All are Llama-style decoders (RMSNorm, RoPE, grouped-query attention, SwiGLU MLP); they
differ only in biases on q/k/v, a per-head RMSNorm on q and k (Qwen3), and their RoPE class,
which is taken from transformers so cos/sin are bit-identical to the reference.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Family:
    rotary_class: str  # dotted path of the transformers RoPE module
    qkv_bias: Callable[[object], bool]
    qk_norm: bool = False


FAMILIES: dict[str, Family] = {
    "llama": Family("transformers.models.llama.modeling_llama.LlamaRotaryEmbedding",
                    lambda c: bool(getattr(c, "attention_bias", False))),
    "mistral": Family("transformers.models.mistral.modeling_mistral.MistralRotaryEmbedding",
                      lambda c: False),
    "qwen2": Family("transformers.models.qwen2.modeling_qwen2.Qwen2RotaryEmbedding", lambda c: True),
    "qwen3": Family("transformers.models.qwen3.modeling_qwen3.Qwen3RotaryEmbedding",
                    lambda c: bool(getattr(c, "attention_bias", False)), qk_norm=True),
}


def rotary_for(model_type: str, config):
    module, _, name = FAMILIES[model_type].rotary_class.rpartition(".")
    return getattr(importlib.import_module(module), name)(config=config)
