"""The worker's per-token adapter map for the kinds that share the base's K/V.

vLLM builds each step's per-token adapter map by repeating a request's adapter over its
scheduled tokens (``InputBatch.make_lora_inputs``). The runner's ``set_active_loras`` is
wrapped: a token before its request's activation start (:func:`.kinds.activation_start`:
aLoRA's invocation; never, for ICaRus) gets no adapter, so the model's main stream computes
the base's K/V for it. An ICaRus request's tokens also go to :data:`.icarus.ROWS` with their
adapter's slot: the model's second stream applies the adapter to them and reads those K/V.
"""

from __future__ import annotations

import numpy as np

from . import icarus
from .kinds import is_icarus, request_activation_start


def mask_before_activation(runner, input_batch, num_scheduled: np.ndarray, num_sampled: np.ndarray,
                           prompt_map: tuple[int, ...], token_map: tuple[int, ...]) -> tuple[tuple, tuple]:
    """``prompt_map``/``token_map`` with no adapter wherever a request's token (or its sampled
    position) lies before the request's activation start: the tokens whose K/V are the base's."""
    tokens, prompts = list(token_map), list(prompt_map)
    token_at = sampled_at = 0
    for i, req_id in enumerate(input_batch.req_ids[: len(num_scheduled)]):
        scheduled, sampled = int(num_scheduled[i]), int(num_sampled[i])
        start = request_activation_start(runner.requests[req_id])
        if start is not None:
            first = int(input_batch.num_computed_tokens_cpu[i])
            for j in range(scheduled):
                if first + j < start:
                    tokens[token_at + j] = 0
            last = first + scheduled - 1
            for j in range(sampled):
                if last - (sampled - 1 - j) < start:
                    prompts[sampled_at + j] = 0
        token_at += scheduled
        sampled_at += sampled
    return tuple(prompts), tuple(tokens)


def icarus_ids(runner, input_batch, num_scheduled: np.ndarray, token_map: tuple[int, ...]) -> list[int]:
    """Per scheduled token, the adapter id of an ICaRus request's token (0 elsewhere)."""
    ids = [0] * len(token_map)
    at = 0
    for i, req_id in enumerate(input_batch.req_ids[: len(num_scheduled)]):
        lora = runner.requests[req_id].lora_request
        if lora is not None and is_icarus(lora.lora_path):
            ids[at:at + int(num_scheduled[i])] = [lora.lora_int_id] * int(num_scheduled[i])
        at += int(num_scheduled[i])
    return ids


def _set_active_loras(self, input_batch, num_scheduled_tokens, num_sampled_tokens=None, *args, **kwargs):
    if num_sampled_tokens is None:
        num_sampled_tokens = np.ones_like(num_scheduled_tokens, dtype=np.int32)
    prompt_map, token_map, requests = input_batch.make_lora_inputs(num_scheduled_tokens, num_sampled_tokens)
    ids = icarus_ids(self, input_batch, num_scheduled_tokens, token_map)
    prompt_map, token_map = mask_before_activation(self, input_batch, num_scheduled_tokens, num_sampled_tokens,
                                                   prompt_map, token_map)
    result = self._set_active_loras(prompt_map, token_map, requests, *args, **kwargs)
    icarus.ROWS.set(ids, self.lora_manager._adapter_manager.lora_index_to_id)
    return result


def _without_alora_refusal(validate):
    def validate_features(self) -> list[str]:
        return [message for message in validate(self) if "Activated LoRA" not in message]

    validate_features.kvshare_patched = True
    return validate_features


def install() -> None:
    from vllm.lora.peft_helper import PEFTHelper
    from vllm.v1.worker.lora_model_runner_mixin import LoRAModelRunnerMixin

    if getattr(PEFTHelper._validate_features, "kvshare_patched", False):
        return
    PEFTHelper._validate_features = _without_alora_refusal(PEFTHelper._validate_features)
    _set_active_loras.kvshare_patched = True
    LoRAModelRunnerMixin.set_active_loras = _set_active_loras
