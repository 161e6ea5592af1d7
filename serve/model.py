"""The engine's model: a Llama-family decoder over a flat batch of rows and a paged KV cache.

Written for the engine rather than reusing transformers' modules because a batch here is a
flat list of rows from many sequences, each row with its own position, adapter and KV
destination (or none: ICaRus adapter rows read the cache but never write it), which
transformers' batch-by-time layout cannot express. Numerics follow transformers' Llama code
(RMSNorm in float32, RoPE from transformers' own classes) so greedy outputs match it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ..errors import KvshareError
from ..kernels import op
from ..kernels.attention import attention_plan
from ..safetensors_io import load_tensors, model_weight_files
from .families import FAMILIES, rotary_for

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class Rows:
    """One forward pass: every row is one token of one sequence in one stream."""

    tokens: torch.Tensor  # (R,) token ids
    positions: torch.Tensor  # (R,) positions in their sequences
    adapter_slots: torch.Tensor  # (R,) adapter slot per row, -1 = base weights
    write_slots: torch.Tensor  # (R,) KV cache slot to write, -1 = read only
    row_seq: list[int]  # (R,) sequence index; a sequence's rows are contiguous
    block_tables: list[list[int]]  # per sequence index
    logit_rows: torch.Tensor  # rows whose next-token logits are wanted


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Model:
    """Weights of a Llama-family base, loaded from safetensors, and its forward pass."""

    def __init__(self, model_dir: Path, dtype: torch.dtype = torch.float32):
        from transformers import AutoConfig

        self.config = AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
        c = self.config
        if c.model_type not in FAMILIES:
            raise KvshareError(f"model family {c.model_type!r} is not supported by the engine")
        self.family = FAMILIES[c.model_type]
        self.dtype = dtype
        self.n_layers = c.num_hidden_layers
        self.n_q = c.num_attention_heads
        self.n_kv = c.num_key_value_heads
        self.head_dim = getattr(c, "head_dim", None) or c.hidden_size // self.n_q
        self.eps = c.rms_norm_eps
        self.scale = self.head_dim ** -0.5
        weights: dict[str, torch.Tensor] = {}
        for file in model_weight_files(model_dir):
            weights.update(load_tensors(file))
        self.w = {k: v.to(dtype) for k, v in weights.items()}
        if "lm_head.weight" not in self.w or c.tie_word_embeddings:
            self.w["lm_head.weight"] = self.w["model.embed_tokens.weight"]
        self.rotary = rotary_for(c.model_type, c)
        self.has_bias = self.family.qkv_bias(c)

    def layer_weight(self, layer: int, name: str) -> torch.Tensor:
        group = "self_attn" if name in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm") else "mlp"
        return self.w[f"model.layers.{layer}.{group}.{name}.weight"]

    def _bias(self, layer: int, name: str) -> torch.Tensor | None:
        return self.w.get(f"model.layers.{layer}.self_attn.{name}.bias")

    @torch.no_grad()
    def forward(self, rows: Rows, kv_cache: torch.Tensor, lora) -> torch.Tensor:
        """Run the rows through the model, writing KV where asked; return logits of logit_rows.

        ``kv_cache`` is (2, layers, blocks, block_size, kv_heads, head_dim); ``lora(layer,
        name)`` gives each adapter slot's (A, B, scale) for a projection, or None.
        """
        attention, write_kv, gathered = op("paged_attention"), op("write_kv"), op("gathered_lora")
        slots = rows.adapter_slots
        h = F.embedding(rows.tokens, self.w["model.embed_tokens.weight"])
        cos, sin = self.rotary(h, rows.positions[None])
        cos, sin = cos[0][:, None, :], sin[0][:, None, :]  # (R, 1, d)
        n = h.shape[0]
        plan = attention_plan(rows.row_seq, rows.positions, rows.block_tables, kv_cache.shape[3])

        def proj(layer: int, name: str, x: torch.Tensor) -> torch.Tensor:
            y = F.linear(x, self.layer_weight(layer, name),
                         self._bias(layer, name) if self.has_bias and name in ("q_proj", "k_proj", "v_proj") else None)
            return gathered(x, y, slots, lora(layer, name))

        for i in range(self.n_layers):
            p = f"model.layers.{i}."
            x = _rms_norm(h, self.w[p + "input_layernorm.weight"], self.eps)
            q = proj(i, "q_proj", x).view(n, self.n_q, self.head_dim)
            k = proj(i, "k_proj", x).view(n, self.n_kv, self.head_dim)
            v = proj(i, "v_proj", x).view(n, self.n_kv, self.head_dim)
            if self.family.qk_norm:
                q = _rms_norm(q, self.layer_weight(i, "q_norm"), self.eps)
                k = _rms_norm(k, self.layer_weight(i, "k_norm"), self.eps)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            write_kv(kv_cache[0, i], kv_cache[1, i], k, v, rows.write_slots)
            a = attention(q, kv_cache[0, i], kv_cache[1, i], plan, self.scale)
            h = h + proj(i, "o_proj", a.reshape(n, self.n_q * self.head_dim))
            x = _rms_norm(h, self.w[p + "post_attention_layernorm.weight"], self.eps)
            h = h + proj(i, "down_proj", F.silu(proj(i, "gate_proj", x)) * proj(i, "up_proj", x))
        h = _rms_norm(h[rows.logit_rows], self.w["model.norm.weight"], self.eps)
        return F.linear(h, self.w["lm_head.weight"]).float()
