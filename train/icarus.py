"""ICaRus training forward: the frozen base is the encoder, the adapted model the decoder.

The base ("logical encoder") turns the sequence into every layer's keys and values (after
RoPE) without gradients. The adapted model ("logical decoder") runs over the same sequence,
but every attention layer uses the encoder's keys and values in place of its own. Only the
decoder's LoRA weights learn, and at serving time every agent can read one shared cache.

No modeling code is forked: a registered transformers attention function swaps in the
encoder's K/V, which reach it as the ``icarus_kv`` keyword that transformers threads from
the model's forward down to each attention call. Any Llama-family model works.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.integrations.sdpa_attention import sdpa_attention_forward

ATTENTION_NAME = "kvshare_icarus"
KV = list[tuple[torch.Tensor, torch.Tensor]]


def _icarus_attention(module, query, key, value, attention_mask, icarus_kv: KV | None = None,
                      **kwargs):
    """SDPA attention whose key/value are the encoder's when ``icarus_kv`` is given."""
    if icarus_kv is not None:
        key, value = icarus_kv[module.layer_idx]
        key, value = key.to(query.dtype), value.to(query.dtype)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register(ATTENTION_NAME, _icarus_attention)
# transformers builds attention masks only for implementations with a mask function: without
# one it passed None and SDPA ran causal only, attending to padding (left padding would leak)
AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)


def enable_icarus_attention(model) -> None:
    """Route a (PEFT-wrapped or plain) transformers model's attention through ICaRus."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base.set_attn_implementation(ATTENTION_NAME)


@contextmanager
def _without_checkpointing(model):
    """Switch gradient checkpointing off for a gradient-free pass: a checkpointed layer in
    training mode drops its cache (transformers sets ``past_key_values=None``), and the
    encoder pass exists to fill one. Nothing is recomputed there anyway (no backward)."""
    layers = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False) is True]
    for layer in layers:
        layer.gradient_checkpointing = False
    try:
        yield
    finally:
        for layer in layers:
            layer.gradient_checkpointing = True


@torch.no_grad()
def encode_base_kv(peft_model, input_ids: torch.Tensor,
                   attention_mask: torch.Tensor | None = None) -> KV:
    """Every layer's (key, value) from the frozen base: the adapter is switched off. Only the
    cache is read: one position's logits are computed, not the whole vocabulary's at every
    position (thrown away)."""
    base = peft_model.get_base_model()
    with peft_model.disable_adapter(), _without_checkpointing(base):
        out = base(input_ids=input_ids, attention_mask=attention_mask, use_cache=True, logits_to_keep=1)
    return [(layer.keys, layer.values) for layer in out.past_key_values.layers]


def icarus_forward(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                   labels: torch.Tensor | None = None, peft_model=None, **loss_kwargs):
    """Decoder forward over the encoder's K/V; returns the transformers output (loss, logits).

    ``model`` may be a DDP-wrapped PeftModel; ``peft_model`` is then the unwrapped one,
    used for the gradient-free encoder pass. ``loss_kwargs`` go to the model (e.g.
    ``num_items_in_batch``).
    """
    peft_model = peft_model if peft_model is not None else model
    kv = encode_base_kv(peft_model, input_ids, attention_mask)
    return model(input_ids=input_ids, attention_mask=attention_mask, labels=labels,
                 icarus_kv=kv, use_cache=False, **loss_kwargs)
