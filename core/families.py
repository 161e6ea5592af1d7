"""Supported model families: the one table of them (models, engine, tests read it here).

All are Llama-style decoders (RMSNorm, RoPE, grouped-query attention, SwiGLU MLP); they
differ in biases on q/k/v (Qwen2; read from the checkpoint when present), a per-head RMSNorm
on q and k (Qwen3; likewise), and their RoPE class, which is taken from transformers so
cos/sin are bit-identical to the reference.
"""

from __future__ import annotations

import importlib

# model_type -> dotted path of the transformers RoPE module of that family
FAMILIES: dict[str, str] = {
    "llama": "transformers.models.llama.modeling_llama.LlamaRotaryEmbedding",
    "mistral": "transformers.models.mistral.modeling_mistral.MistralRotaryEmbedding",
    "qwen2": "transformers.models.qwen2.modeling_qwen2.Qwen2RotaryEmbedding",
    "qwen3": "transformers.models.qwen3.modeling_qwen3.Qwen3RotaryEmbedding",
}


def rotary_for(model_type: str, config):
    module, _, name = FAMILIES[model_type].rpartition(".")
    return getattr(importlib.import_module(module), name)(config=config)
