"""A bf16 engine or training run on a CPU without bf16 instructions warns (it would run
several times slower than float32); float32, or a CPU with bf16, stays silent."""

from __future__ import annotations

import json
import warnings

import pytest

import kvshare.hardware as hardware
from kvshare.serve import LLMEngine


@pytest.mark.parametrize("fast", [False, True])
def test_bf16_engine_warns_only_where_bf16_is_slow(tiny_models, monkeypatch, fast):
    monkeypatch.setattr(hardware, "cpu_has_fast_bf16", lambda: fast)
    base = tiny_models("llama")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        LLMEngine(base, kv_cache_tokens=256, dtype="bfloat16")
        LLMEngine(base, kv_cache_tokens=256, dtype="float32")
    slow = [w for w in caught if "no bfloat16 instructions" in str(w.message)]
    assert len(slow) == (0 if fast else 1)


@pytest.mark.parametrize("fast", [False, True])
def test_auto_mixed_precision_trains_in_bf16_only_where_bf16_is_fast(tmp_path, tiny_models, monkeypatch, fast):
    from test_trainer import toy_recipe

    from kvshare.train.recipe import load_recipe
    from kvshare.train.trainer import train

    monkeypatch.setattr(hardware, "cpu_has_fast_bf16", lambda: fast)
    data = tmp_path / "toy.jsonl"
    data.write_text("".join(json.dumps({"q": f"{a} plus 1?", "a": f"{a + 1}."}) + "\n" for a in range(16)))
    path = toy_recipe(tmp_path, tiny_models("llama"), data, "lora", max_steps=2, mixed_precision="auto")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        summary = train(load_recipe(path), recipe_path=str(path))
    assert summary["finished"] and summary["mixed_precision"] == ("bf16" if fast else "no")
    assert not [w for w in caught if "no bfloat16 instructions" in str(w.message)]  # auto never picks the slow path
