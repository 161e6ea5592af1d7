"""The vLLM plugin's rules on vLLM-shaped stand-ins (no vLLM here; inside vLLM:
tests/test_vllm_plugin.py). Each rule is checked where it must act and where it must not."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kvshare.serve.vllm_plugin import block_hashes, cpu_lora, icarus, kinds
from kvshare.serve.vllm_plugin import token_map as worker_map

INVOCATION = [7, 8, 9]


def adapter(tmp_path, name, invocation=None):
    folder = tmp_path / name
    folder.mkdir()
    config = {"peft_type": "LORA", "r": 4, **({"alora_invocation_tokens": invocation} if invocation else {})}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return str(folder)


def test_activation_start_is_peft_rule_read_from_the_folder(tmp_path):
    judge, plain = adapter(tmp_path, "judge", INVOCATION), adapter(tmp_path, "plain")
    assert kinds.activation_start([1, 7, 8, 9, 2, 7, 8, 9, 3], judge) == 5  # the last occurrence
    assert kinds.activation_start([1, 2, 3], judge) == kinds.NEVER  # absent: the adapter adapts nothing
    assert kinds.activation_start([1, 7, 8, 9], plain) is None
    assert kinds.activation_start([1, 7, 8, 9], "/not/a/real/path") is None  # vLLM's warm-up adapters
    planner = tmp_path / "planner"
    planner.mkdir()
    (planner / "kvshare.json").write_text(json.dumps({"kind": "icarus"}))
    assert kinds.activation_start([1, 7, 8, 9], str(planner)) == kinds.NEVER  # ICaRus: K/V always the base's


def test_alora_tokens_before_the_invocation_get_no_adapter(tmp_path):
    judge, plain = adapter(tmp_path, "judge", INVOCATION), adapter(tmp_path, "plain")
    prompt = [1, 2, 3, 4, 5, 7, 8, 9]  # invocation at 5
    runner = SimpleNamespace(requests={
        "a": SimpleNamespace(prompt_token_ids=prompt, lora_request=SimpleNamespace(lora_path=judge)),
        "l": SimpleNamespace(prompt_token_ids=prompt, lora_request=SimpleNamespace(lora_path=plain)),
        "b": SimpleNamespace(prompt_token_ids=prompt, lora_request=None)})
    batch = SimpleNamespace(req_ids=["a", "l", "b"], num_computed_tokens_cpu=np.array([2, 0, 0]))
    scheduled, sampled = np.array([4, 2, 1]), np.array([1, 1, 1])
    prompt_map, token_map = worker_map.mask_before_activation(runner, batch, scheduled, sampled, (1, 2, 0),
                                                         (1, 1, 1, 1, 2, 2, 0))
    assert token_map == (0, 0, 0, 1, 2, 2, 0)  # aLoRA positions 2, 3, 4 run on the base; 5 on the adapter
    assert prompt_map == (1, 2, 0)
    batch.num_computed_tokens_cpu = np.array([0, 0, 0])
    prompt_map, token_map = worker_map.mask_before_activation(runner, batch, np.array([3, 2, 1]), sampled, (1, 2, 0),
                                                         (1, 1, 1, 2, 2, 0))
    assert token_map == (0, 0, 0, 2, 2, 0) and prompt_map == (0, 2, 0)  # a chunk wholly before it


def test_only_alora_blocks_before_the_invocation_lose_the_adapter_key(tmp_path):
    judge, plain = adapter(tmp_path, "judge", INVOCATION), adapter(tmp_path, "plain")

    def vllms(request, start, end, mm):
        lora = request.lora_request
        keys = ([("lora", lora.lora_name, lora.lora_path)] if lora else []) + ([("cache_salt", "s")] if start == 0 else [])
        return (tuple(keys) or None), mm

    keys = block_hashes._sharing_extra_keys(vllms)
    prompt = [0] * 8 + INVOCATION + [1]  # invocation at 8
    alora_request = SimpleNamespace(prompt_token_ids=prompt, lora_request=SimpleNamespace(lora_name="judge", lora_path=judge))
    assert keys(alora_request, 0, 4, 0) == ((("cache_salt", "s"),), 0)
    assert keys(alora_request, 4, 8, 0) == (None, 0)  # ends at the invocation: the base's block
    assert keys(alora_request, 8, 12, 0) == ((("lora", "judge", judge),), 0)
    lora = SimpleNamespace(prompt_token_ids=prompt, lora_request=SimpleNamespace(lora_name="plain", lora_path=plain))
    assert keys(lora, 4, 8, 0) == ((("lora", "plain", plain),), 0)
    base = SimpleNamespace(prompt_token_ids=prompt, lora_request=None)
    assert keys(base, 4, 8, 0) == (None, 0)


def test_tokens_without_an_adapter_get_no_delta_from_the_last_slot():
    def vllms_shrink(inputs, lora_a, output, indices, scaling=1.0):  # vLLM 0.32's CPU kernel, as written
        output[:, :lora_a.shape[1]] = scaling * torch.einsum("bi, boi -> bo", inputs, lora_a[indices])

    inputs, lora_a = torch.randn(3, 6), torch.randn(2, 4, 6)
    indices = torch.tensor([1, -1, 0])
    output = torch.zeros(3, 4)
    vllms_shrink(inputs, lora_a, output, indices)
    assert output[1].abs().sum() > 0  # the bug: -1 read slot 1
    fixed = torch.zeros(3, 4)
    cpu_lora._zero_unadapted(vllms_shrink)(inputs, lora_a, fixed, indices)
    assert torch.equal(fixed[1], torch.zeros(4)) and torch.equal(fixed[[0, 2]], output[[0, 2]])


def test_icarus_rows_name_each_tokens_slot_and_the_delta_is_lora_on_those_rows_only():
    rows = icarus.IcarusRows()
    rows.set([0, 3, 3, 5, 0], [None, 5, 3])
    assert rows.slots.tolist() == [-1, 2, 2, 1, -1]
    rows.set([0, 0], [None, 5])
    assert rows.slots is None  # no ICaRus token: vLLM's own forward
    torch.manual_seed(0)
    a = (torch.randn(3, 1, 2, 6), torch.randn(3, 1, 2, 6))
    b = (torch.randn(3, 1, 4, 2), torch.randn(3, 1, 3, 2))
    layer = SimpleNamespace(lora_a_stacked=a, lora_b_stacked=b, output_slices=(4, 3))
    x, slots = torch.randn(4, 6), torch.tensor([2, -1, 1, 2])
    got = icarus.delta(layer, x, icarus.slot_groups(slots))
    for row, slot in enumerate(slots.tolist()):
        want = torch.zeros(7) if slot < 0 else torch.cat([b[s][slot, 0] @ (a[s][slot, 0] @ x[row]) for s in (0, 1)])
        assert torch.allclose(got[row], want, atol=1e-5)


def test_an_icarus_adapter_is_refused_by_a_model_without_the_second_stream(tmp_path):
    planner = tmp_path / "planner"
    planner.mkdir()
    (planner / "kvshare.json").write_text(json.dumps({"kind": "icarus"}))
    loaded = []
    load = icarus._refuse_icarus_without_streams(lambda self, request: loaded.append(request))
    request = SimpleNamespace(lora_path=str(planner))
    plain_model = SimpleNamespace(_adapter_manager=SimpleNamespace(model=SimpleNamespace()))
    with pytest.raises(ValueError, match="ICaRus adapter"):
        load(plain_model, request)
    load(SimpleNamespace(_adapter_manager=SimpleNamespace(model=SimpleNamespace(kvshare_icarus=True))), request)
    assert loaded == [request]
