"""ICaRus in vLLM: a second stream per ICaRus token that reads the base's K/V and writes none.

An ICaRus adapter's queries attend over keys and values the frozen base computes from its own
hidden states, so a step carries two streams. The main stream is vLLM's Llama as it is; an
ICaRus request's tokens get no adapter in it (:mod:`.token_map`), so it writes the base's K/V
into vLLM's cache, shared by the base and every ICaRus agent. The second stream runs, layer by
layer after the main one, the base weights plus the request's adapter delta (computed here from
vLLM's own stacked LoRA weights), and calls the layer's attention with no key or value: it
reads the cache, which already holds this step's base K/V, and writes nothing. The logits of an
ICaRus token come from the second stream.

The model class replaces vLLM's ``LlamaForCausalLM`` (Llama-family bases); with no ICaRus token
in a step it is vLLM's forward, unchanged. An ICaRus adapter on another architecture is refused
when it loads.
"""

from __future__ import annotations

import torch

ARCHITECTURE = "LlamaForCausalLM"


class IcarusRows:
    """This step's ICaRus tokens in the worker: per scheduled token, its adapter's LoRA slot
    (-1 for tokens of other requests). Set by :mod:`.token_map` before each forward."""

    def __init__(self) -> None:
        self.slots: torch.Tensor | None = None

    def set(self, ids: list[int], index_to_id: list[int | None]) -> None:
        if not any(ids):
            self.slots = None
            return
        slot_of = {lora_id: slot for slot, lora_id in enumerate(index_to_id) if lora_id is not None}
        self.slots = torch.tensor([slot_of[i] if i else -1 for i in ids], dtype=torch.long)


ROWS = IcarusRows()


def slot_groups(slots: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """Each ICaRus slot of the step with a mask of its rows: found once per step, used by every
    adapted projection of every layer."""
    return [(slot, slots == slot) for slot in torch.unique(slots[slots >= 0]).tolist()]


def delta(layer, x: torch.Tensor, groups: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
    """The LoRA delta of ``layer`` (a vLLM LoRA-wrapped linear) for the rows of each slot's group
    with that slot's adapter (no delta elsewhere), from vLLM's stacked weights (scale folded into B)."""
    out = x.new_zeros(x.shape[0], sum(layer.output_slices))
    offset = 0
    for a, b, width in zip(layer.lora_a_stacked, layer.lora_b_stacked, layer.output_slices):
        for slot, rows in groups:
            out[rows, offset:offset + width] = (x[rows] @ a[slot, 0].T.to(x.dtype)) @ b[slot, 0].T.to(x.dtype)
        offset += width
    return out


def adapted(layer, x: torch.Tensor, groups) -> torch.Tensor:
    """``layer`` on base weights plus the ICaRus rows' deltas."""
    return layer.base_layer(x)[0] + delta(layer, x, groups)


def second_stream_layer(layer, positions, hidden, residual, groups):
    """One decoder layer of the second stream (vLLM's ``LlamaDecoderLayer.forward``, with the
    adapter deltas and an attention call that reads the cache only)."""
    if residual is None:
        residual, hidden = hidden, layer.input_layernorm(hidden)
    else:
        hidden, residual = layer.input_layernorm(hidden, residual)
    attention = layer.self_attn
    query = adapted(attention.qkv_proj, hidden, groups)[:, :attention.q_size].contiguous()
    query, _ = attention.rotary_emb(positions, query, None)
    hidden = adapted(attention.o_proj, attention.attn(query, None, None), groups)
    hidden, residual = layer.post_attention_layernorm(hidden, residual)
    mlp = layer.mlp
    hidden = adapted(mlp.down_proj, mlp.act_fn(adapted(mlp.gate_up_proj, hidden, groups)), groups)
    return hidden, residual


def dual_stream_forward(model, input_ids, positions, slots) -> torch.Tensor:
    """``LlamaModel.forward`` for a step with ICaRus tokens: per layer, the main stream (which
    writes the base's K/V), then the second; each token's final hidden state from its stream."""
    groups = slot_groups(slots)
    hidden = model.embed_input_ids(input_ids)
    residual = None
    second, second_residual = hidden, None
    for layer in model.layers[model.start_layer:model.end_layer]:
        hidden, residual = layer(positions, hidden, residual)
        second, second_residual = second_stream_layer(layer, positions, second, second_residual, groups)
    icarus_rows = (slots >= 0).unsqueeze(-1)
    hidden, residual = torch.where(icarus_rows, second, hidden), torch.where(icarus_rows, second_residual, residual)
    hidden, _ = model.norm(hidden, residual)
    return hidden


def model_class():
    """vLLM's ``LlamaForCausalLM`` with the second stream (imported inside vLLM only)."""
    from vllm.distributed import get_pp_group
    from vllm.model_executor.models.llama import LlamaForCausalLM

    class IcarusLlamaForCausalLM(LlamaForCausalLM):
        kvshare_icarus = True

        def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
            slots = ROWS.slots
            if slots is None or inputs_embeds is not None or get_pp_group().world_size != 1:
                return super().forward(input_ids, positions, intermediate_tensors, inputs_embeds)
            padded = slots.new_full((positions.shape[0],), -1)  # rows vLLM pads a step with: no adapter
            padded[: slots.shape[0]] = slots[: positions.shape[0]]
            return dual_stream_forward(self.model, input_ids, positions, padded.to(positions.device))

    return IcarusLlamaForCausalLM


def _refuse_icarus_without_streams(load):
    def load_adapter(self, lora_request):
        from .kinds import is_icarus

        if is_icarus(lora_request.lora_path) and not getattr(self._adapter_manager.model, "kvshare_icarus", False):
            raise ValueError(f"{lora_request.lora_path} is an ICaRus adapter: kvshare's vLLM plugin serves those on "
                             f"{ARCHITECTURE} bases only (its keys and values come from a second stream)")
        return load(self, lora_request)

    load_adapter.kvshare_patched = True
    return load_adapter


def install() -> None:
    from vllm import ModelRegistry
    from vllm.lora.worker_manager import WorkerLoRAManager

    ModelRegistry.register_model(ARCHITECTURE, "kvshare.serve.vllm_plugin.icarus_model:IcarusLlamaForCausalLM")
    if not getattr(WorkerLoRAManager._load_adapter, "kvshare_patched", False):
        WorkerLoRAManager._load_adapter = _refuse_icarus_without_streams(WorkerLoRAManager._load_adapter)
