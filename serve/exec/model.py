"""The engine's model: a Llama-family decoder over a flat batch of rows and a paged KV cache.

Written for the engine rather than reusing transformers' modules because a batch here is a
flat list of rows from many sequences, each row with its own position, adapter and KV
destination (or none: ICaRus adapter rows read the cache but never write it), which
transformers' batch-by-time layout cannot express. Numerics follow transformers' Llama code
(RMSNorm in float32, RoPE from transformers' own classes) so greedy outputs match it.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from ...errors import KvshareError
from ...kernels import Kernels
from ...kernels.pointwise import TorchPointwise
from ...safetensors_io import load_tensors, model_weight_files
from ...families import FAMILIES, rotary_for
from ...models import refuse_what_the_engine_lacks
from .batch import Batch
from ..cache.layer_stream import LayerStream


class Model:
    """Weights of a Llama-family base, loaded from safetensors, and its forward pass."""

    def __init__(self, model_dir: Path, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", kernels: Kernels | None = None):
        from transformers import AutoConfig

        self.config = AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
        c = self.config
        if c.model_type not in FAMILIES:
            raise KvshareError(f"model family {c.model_type!r} is not supported by the engine")
        self.dtype = dtype
        self.n_layers = c.num_hidden_layers
        self.n_q = c.num_attention_heads
        self.n_kv = c.num_key_value_heads
        self.head_dim = getattr(c, "head_dim", None) or c.hidden_size // self.n_q
        self.eps = c.rms_norm_eps
        self.scale = self.head_dim ** -0.5
        w: dict[str, torch.Tensor] = {}
        for file in model_weight_files(model_dir):
            w.update(load_tensors(file))
        refuse_what_the_engine_lacks(c, w)
        # copies, even where the file holds this dtype: a tensor loaded as it is maps the file,
        # and the whole mapping stayed resident (the q/k/v and gate/up pages too, read once for
        # the fused copies below): SmolLM2 float32 held 513 MB of file pages beside 266 MB fused
        w = {k: v.to(device=device, dtype=dtype, copy=True) for k, v in w.items()}
        self.embed = w["model.embed_tokens.weight"]
        self.kernels = kernels = kernels or Kernels()
        prepare = kernels.linear.prepare  # e.g. packed once for oneDNN
        tied = c.tie_word_embeddings or "lm_head.weight" not in w
        lm_head = self.embed if tied else w["lm_head.weight"]
        # a quantising backend leaves a tied head in float: the embedding stays float for the
        # lookup, so an int8 copy would add memory rather than save it
        self.lm_head = lm_head if tied and getattr(kernels.linear, "quantized", False) else prepare(lm_head)
        self.final_norm = w["model.norm.weight"]
        self.rotary = rotary_for(c.model_type, c).to(device)
        # q/k/v and gate/up are fused into one matmul each (one read of x, fewer calls);
        # LoRA deltas are added to each projection's slice of the output.
        self.layers = []
        for i in range(self.n_layers):
            a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
            biases = [w.get(f"{a}{n}.bias") for n in ("q_proj", "k_proj", "v_proj")]
            self.layers.append({
                "input_norm": w[f"model.layers.{i}.input_layernorm.weight"],
                "post_norm": w[f"model.layers.{i}.post_attention_layernorm.weight"],
                "qkv": prepare(torch.cat([w[f"{a}{n}.weight"] for n in ("q_proj", "k_proj", "v_proj")])),
                "qkv_bias": torch.cat(biases) if all(b is not None for b in biases) else None,
                "o": prepare(w[f"{a}o_proj.weight"]),
                "gate_up": prepare(torch.cat([w[f"{m}gate_proj.weight"], w[f"{m}up_proj.weight"]])),
                "down": prepare(w[f"{m}down_proj.weight"]),
                "q_norm": w.get(f"{a}q_norm.weight"),
                "k_norm": w.get(f"{a}k_norm.weight"),
            })
        self.q_size, self.kv_size = self.n_q * self.head_dim, self.n_kv * self.head_dim
        self.hidden_capture: list[torch.Tensor] | None = None  # set to a list: each layer's output at the logit rows
        self.inter = w["model.layers.0.mlp.down_proj.weight"].shape[1]
        hidden = c.hidden_size
        # the fused matmuls and the projections (with output sizes) each one holds
        self.fused = {"qkv": (("q_proj", self.q_size), ("k_proj", self.kv_size), ("v_proj", self.kv_size)),
                      "o": (("o_proj", hidden),), "gate_up": (("gate_proj", self.inter), ("up_proj", self.inter)),
                      "down": (("down_proj", hidden),)}

    @torch.no_grad()
    def forward(self, batch: Batch, kv_cache: torch.Tensor, lora, residual_cache: torch.Tensor | None = None,
                residual_stack=None) -> torch.Tensor:
        """Run the batch's rows through the model, writing KV where asked; return float32
        logits of its logit rows.

        ``kv_cache`` is block-major, (blocks, layers, 2, block_size, kv_heads, head_dim), or a
        :class:`LayerStream` over such memory that hands out one layer at a time; ``lora(layer,
        parts)`` gives each adapter slot's (A, B, scale) for a fused projection, or None.
        ForkKV rows (``batch.forkkv``) keep their k/v LoRA apart: ``residual_stack(layer,
        kv_size)`` gives the ForkKV adapters' stacked weights and ``residual_cache`` (2,
        layers, blocks, block_size, r) holds each token's x A_k, x A_v.
        """
        meta, groups, kernels = batch.attention, batch.lora_groups, self.kernels
        fork = batch.forkkv
        stream = kv_cache if isinstance(kv_cache, LayerStream) else None
        if stream is not None:  # one layer of KV at a time, in a local buffer
            meta = stream.begin(meta)
        try:
            h = F.embedding(batch.tokens, self.embed)
            cos, sin = self.rope(h, meta.positions)
            if fork is not None:  # RoPE of every key position the residual keys need
                positions = torch.arange(fork.max_context, device=h.device)[None]
                rope_cos, rope_sin = (t[0] for t in self.rotary(h, positions))

            def project(i: int, fused: str, x: torch.Tensor, weight, bias=None) -> torch.Tensor:
                """A fused projection of rows ``x`` plus each row's LoRA delta (added in place)."""
                y = kernels.linear.apply(x, weight, bias)
                return kernels.gathered_lora(x, y, groups, lora(i, self.fused[fused]), inplace=True) if groups else y

            def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
                if stream is not None:
                    k_cache, v_cache = stream.layer(i)
                else:
                    k_cache, v_cache = kv_cache[:, i, 0], kv_cache[:, i, 1]  # this layer's K and V of every block
                kernels.write_kv(k_cache, v_cache, k, v, meta.slot_mapping, meta.write_rows)
                if fork is None:
                    a = kernels.paged_attention(q, k_cache, v_cache, meta, self.scale)
                else:
                    a = self._forkkv_attention(i, q, x, k_cache, v_cache, residual_cache,
                                               residual_stack(i, self.config.hidden_size, self.kv_size),
                                               fork, rope_cos, rope_sin)
                if stream is not None:
                    stream.done_with(i)  # the next layer loads while this one's MLP runs
                return a

            capture = None
            if self.hidden_capture is not None:
                capture = lambda h: self.hidden_capture.append(h[batch.logit_rows].float())  # noqa: E731
            h = self.decoder(h, cos, sin, self.layers, project, attend, capture, kernels.pointwise)
            logits = self.head(kernels.pointwise.rms_norm(h[batch.logit_rows], self.final_norm, self.eps))
        finally:  # also when the step fails: its blocks are freed (and may be lent) right after
            if stream is not None:
                stream.finish()  # the last layer's write-back ran beside the head
        return logits

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Float32 logits of final-normed hidden states, through the linear backend."""
        return self.kernels.linear.apply(h, self.lm_head).float()

    def rope(self, h: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE's cos and sin for each row's position, shaped (rows, 1, head_dim)."""
        cos, sin = self.rotary(h, positions[None])
        return cos[0][:, None, :], sin[0][:, None, :]

    def decoder(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layers: list[dict], project,
                attend, capture=None, ops=TorchPointwise) -> torch.Tensor:
        """The decoder layers over rows ``h``: norms, fused projections, RoPE, MLP. The caller
        supplies the parts that touch the step's structure: ``attend(i, q, k, v, x)`` (write
        KV, attend) and ``project(i, fused, x, weight, bias)`` (a fused projection with the
        rows' LoRA deltas), so the eager forward and the compiled CPU step (:mod:`.compiled`)
        run the same math; ``ops`` its pointwise parts (the compiled steps trace the reference,
        which Inductor fuses; the eager step takes its kernels' choice)."""
        n = h.shape[0]
        x = ops.rms_norm(h, layers[0]["input_norm"], self.eps) if layers else h
        for i, L in enumerate(layers):
            q, k, v = torch.split(project(i, "qkv", x, L["qkv"], L["qkv_bias"]),
                                  [self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = q.reshape(n, self.n_q, self.head_dim)
            k = k.reshape(n, self.n_kv, self.head_dim)
            v = v.reshape(n, self.n_kv, self.head_dim)
            if L["q_norm"] is not None:
                q = ops.rms_norm(q, L["q_norm"], self.eps)
                k = ops.rms_norm(k, L["k_norm"], self.eps)
            q, k = ops.rope(q, k, cos, sin)
            a = attend(i, q, k, v, x).reshape(n, self.q_size)
            h, x = ops.add_rms_norm(h, project(i, "o", a, L["o"]), L["post_norm"], self.eps)
            down = project(i, "down", ops.silu_mul(project(i, "gate_up", x, L["gate_up"]), self.inter), L["down"])
            if i + 1 < len(layers):  # the residual add and the next layer's input norm in one pass
                h, x = ops.add_rms_norm(h, down, layers[i + 1]["input_norm"], self.eps)
            else:
                h = h + down
            if capture is not None:
                capture(h)
        return h

    def _forkkv_attention(self, i: int, q: torch.Tensor, x: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, residual_cache: torch.Tensor, stack, fork, rope_cos: torch.Tensor,
                          rope_sin: torch.Tensor) -> torch.Tensor:
        """Attention of one layer when ForkKV rows share the step: exact rows over the pool as
        usual; ForkKV rows first store their x A_k, x A_v (only where the residual is not
        cached), then attend over base part + residual (K rebuilt per key, B_v once)."""
        start, kernels = fork.first, self.kernels
        xf = x[start:]
        r_k = xf.new_zeros(xf.shape[0], stack.a_k.shape[1])
        r_v = torch.zeros_like(r_k)
        for index, rows in fork.groups:
            part = xf.index_select(0, rows)
            r_k.index_copy_(0, rows, part @ stack.a_k[index].T)
            r_v.index_copy_(0, rows, part @ stack.a_v[index].T)
        # a residual slot is one "head" of width r, so the KV-write kernel stores it as it is
        kernels.write_kv(residual_cache[0, i].unsqueeze(2), residual_cache[1, i].unsqueeze(2), r_k[:, None],
                         r_v[:, None], fork.res_slots, fork.res_write_rows)
        out = []
        if fork.exact is not None:
            out.append(kernels.paged_attention(q[:start], k_cache, v_cache, fork.exact, self.scale))
        out.append(kernels.residual_attention(q[start:], k_cache, v_cache, residual_cache[0, i],
                                              residual_cache[1, i], stack.b_k, stack.b_v, stack.scales,
                                              rope_cos, rope_sin, fork.meta, fork.residual, self.scale))
        return torch.cat(out) if len(out) > 1 else out[0]


