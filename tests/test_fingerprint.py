"""Base fingerprints: stable across re-saves, different for any different checkpoint."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvshare.fingerprint import CACHE_FILE, compute_fingerprints, fingerprints


def test_format_and_cache(tiny_llama):
    prints = fingerprints(tiny_llama)
    assert prints.base.startswith("sha256:") and len(prints.base) == 71
    cache = json.loads((tiny_llama / CACHE_FILE).read_text())
    assert cache["base"] == prints.base
    assert fingerprints(tiny_llama) == prints


def test_same_checkpoint_saved_again_keeps_it(tiny_llama, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    again = tmp_path / "resaved"
    model.save_pretrained(again)
    tokenizer.save_pretrained(again)
    assert compute_fingerprints(again) == compute_fingerprints(tiny_llama)


def test_different_checkpoints_never_share_one(tiny_models):
    folders = [tiny_models("llama"), tiny_models("llama", seed=1), tiny_models("llama", tied=False),
               tiny_models("mistral"), tiny_models("qwen2"), tiny_models("qwen3")]
    bases = {fingerprints(f).base for f in folders}
    assert len(bases) == len(folders)


def test_one_changed_weight_changes_it_and_invalidates_the_cache(tiny_llama):
    before = fingerprints(tiny_llama).base
    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[0, 0] += 1e-3
    model.save_pretrained(tiny_llama)
    assert fingerprints(tiny_llama).base != before


def test_tokenizer_vocabulary_is_part_of_it(tiny_llama, tmp_path):
    other = shutil.copytree(tiny_llama, tmp_path / "other-vocab")
    tokenizer = AutoTokenizer.from_pretrained(other)
    tokenizer.add_tokens(["<|tool|>"], special_tokens=True)
    tokenizer.save_pretrained(other)
    a, b = compute_fingerprints(tiny_llama), compute_fingerprints(other)
    assert a.base != b.base
    assert a.tokenizer != b.tokenizer


def test_architecture_is_part_of_it(tiny_llama, tmp_path):
    other = shutil.copytree(tiny_llama, tmp_path / "other-rope")
    config = json.loads((other / "config.json").read_text())
    config["rope_parameters"]["rope_theta"] = 1234.0
    (other / "config.json").write_text(json.dumps(config))
    assert compute_fingerprints(other).base != compute_fingerprints(tiny_llama).base
    assert compute_fingerprints(other).tokenizer == compute_fingerprints(tiny_llama).tokenizer


@pytest.mark.parametrize("index", [{"weight_map": ["model.safetensors"]}, ["weight_map"],
                                   {"weight_map": {"w": "../elsewhere/model.safetensors"}}, {"weight_map": {}}])
def test_a_malformed_shard_index_is_a_clear_error(tmp_path, index):
    from kvshare.errors import KvshareError
    from kvshare.safetensors_io import model_weight_files

    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(KvshareError, match="weight_map|JSON object"):
        model_weight_files(tmp_path)
