"""An independent ICaRus forward written as an explicit per-layer loop.

It shares no code path with :mod:`kvshare.train.icarus` (no attention interface, no cache
object, no SDPA): two residual streams run side by side, the base's ("encoder") and the
adapter's ("decoder"); at every layer the keys and values are computed from the encoder
stream with the base weights only, and both streams attend over them with a hand-written
softmax. Tests compare the training forward and (later) the serving engine against it.
"""

from __future__ import annotations

import math

import torch


def _base(linear):
    """The frozen projection under a PEFT LoRA layer (or the layer itself)."""
    return getattr(linear, "base_layer", linear)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _heads(x: torch.Tensor, n_heads: int, head_dim: int, norm=None) -> torch.Tensor:
    """(b, t, heads*d) -> (b, heads, t, d), with Qwen3's per-head RMSNorm when given."""
    b, t, _ = x.shape
    x = x.view(b, t, n_heads, head_dim)
    if norm is not None:
        x = norm(x)
    return x.transpose(1, 2)


def _attend(q, k, v, key_mask: torch.Tensor | None) -> torch.Tensor:
    """Causal attention with grouped KV heads, written out: softmax(q k^T / sqrt(d)) v."""
    n_q, n_kv, t, d = q.shape[1], k.shape[1], q.shape[2], q.shape[3]
    group = n_q // n_kv
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(d)
    allowed = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    if key_mask is not None:
        allowed = allowed & key_mask[:, None, None, :].bool()
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(v.dtype)
    probs = torch.nan_to_num(probs)  # fully masked rows (padding queries) give zeros
    return probs @ v


@torch.no_grad()
def icarus_reference_logits(peft_model, input_ids: torch.Tensor,
                            attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Decoder logits of an ICaRus model (PEFT LoRA on a Llama-family base), by hand."""
    model = peft_model.get_base_model() if hasattr(peft_model, "get_base_model") else peft_model
    config = model.config
    n_q, n_kv = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // n_q
    body = model.model

    hidden = body.embed_tokens(input_ids)
    positions = torch.arange(input_ids.shape[1], device=input_ids.device)[None].expand_as(input_ids)
    cos, sin = body.rotary_emb(hidden, positions)
    cos, sin = cos[:, None], sin[:, None]

    def rope(x):
        return x * cos + _rotate_half(x) * sin

    enc, dec = hidden, hidden
    for layer in body.layers:
        attn = layer.self_attn
        x_enc, x_dec = layer.input_layernorm(enc), layer.input_layernorm(dec)
        q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)  # Qwen3
        k = rope(_heads(_base(attn.k_proj)(x_enc), n_kv, head_dim, k_norm))
        v = _heads(_base(attn.v_proj)(x_enc), n_kv, head_dim)
        q_enc = rope(_heads(_base(attn.q_proj)(x_enc), n_q, head_dim, q_norm))
        q_dec = rope(_heads(attn.q_proj(x_dec), n_q, head_dim, q_norm))

        def merge(x):
            return x.transpose(1, 2).reshape(x.shape[0], x.shape[2], n_q * head_dim)

        enc = enc + _base(attn.o_proj)(merge(_attend(q_enc, k, v, attention_mask)))
        dec = dec + attn.o_proj(merge(_attend(q_dec, k, v, attention_mask)))

        mlp = layer.mlp
        y_enc = layer.post_attention_layernorm(enc)
        enc = enc + _base(mlp.down_proj)(mlp.act_fn(_base(mlp.gate_proj)(y_enc)) * _base(mlp.up_proj)(y_enc))
        y_dec = layer.post_attention_layernorm(dec)
        dec = dec + mlp.down_proj(mlp.act_fn(mlp.gate_proj(y_dec)) * mlp.up_proj(y_dec))
    return model.lm_head(body.norm(dec))
