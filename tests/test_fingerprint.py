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


def _sharded_copy(model_dir, out):
    """``model_dir``'s tensors in two shards whose order is not the names' order (layer 1's
    tensors in the first file), with the index transformers writes."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(model_dir, out, ignore=shutil.ignore_patterns("model.safetensors", CACHE_FILE))
    tensors = load_file(model_dir / "model.safetensors")
    first = {k: v for k, v in tensors.items() if ".layers.1." in k}
    second = {k: v for k, v in tensors.items() if k not in first}
    names = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
    for name, part in zip(names, (first, second)):
        save_file(part, out / name, metadata={"format": "pt"})
    weight_map = {k: names[0] if k in first else names[1] for k in tensors}
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return out


def test_the_same_tensors_in_other_shards_keep_it(tiny_llama, tmp_path):
    """Re-sharding a base (another max_shard_size) changes no tensor, so no fingerprint: its
    adapters keep loading and its prefix keys stay the same. Before, tensors were hashed shard
    by shard; that digest stays valid for manifests written then (:func:`matches_base`)."""
    from kvshare.fingerprint import legacy_base_fingerprint, matches_base

    sharded = _sharded_copy(tiny_llama, tmp_path / "sharded")
    assert compute_fingerprints(sharded) == compute_fingerprints(tiny_llama)
    legacy = legacy_base_fingerprint(sharded)
    assert legacy != fingerprints(sharded).base  # layer 1 hashed first: the old digest differs
    assert legacy_base_fingerprint(tiny_llama) == fingerprints(tiny_llama).base  # one file: no change
    assert matches_base(sharded, legacy) and matches_base(sharded, fingerprints(sharded).base)
    assert not matches_base(sharded, "sha256:" + "0" * 64) and not matches_base(tiny_llama, legacy)


def test_a_version_1_cache_of_a_single_file_model_still_serves(tiny_llama, monkeypatch):
    """Its digest did not change (one file: shard order is name order), so a 7B model in one
    file is not hashed again after the cache's version moved; a sharded one is."""
    import kvshare.fingerprint as fp

    prints = fingerprints(tiny_llama)
    cache = json.loads((tiny_llama / CACHE_FILE).read_text())
    (tiny_llama / CACHE_FILE).write_text(json.dumps({**cache, "version": 1}))
    monkeypatch.setattr(fp, "compute_fingerprints", lambda model_dir: pytest.fail("hashed again"))
    assert fingerprints(tiny_llama) == prints


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


def test_a_folder_with_both_one_file_and_an_index_is_read_as_transformers_reads_it(tiny_llama, tmp_path):
    """A folder saved over again may keep a stale index and shards beside model.safetensors:
    transformers loads model.safetensors, and so do the fingerprint and the engine."""
    before = compute_fingerprints(tiny_llama)
    _sharded_copy(tiny_llama, tmp_path / "sharded")
    other = AutoModelForCausalLM.from_pretrained(tiny_llama)
    with torch.no_grad():
        next(other.parameters()).add_(1.0)
    other.save_pretrained(tmp_path / "other", max_shard_size="20KB")
    for stale in (tmp_path / "other").glob("model-*.safetensors"):
        shutil.copy(stale, tiny_llama / stale.name)
    shutil.copy(tmp_path / "other" / "model.safetensors.index.json", tiny_llama)
    assert compute_fingerprints(tiny_llama) == before


@pytest.mark.parametrize("cache", [b"\xff\xfe", b'{"version": 2, "files": "FILES", "base": null, "tokenizer": null}'])
def test_a_damaged_cache_is_recomputed(tiny_llama, cache):
    from kvshare.fingerprint import _file_stats

    right = compute_fingerprints(tiny_llama)
    (tiny_llama / CACHE_FILE).write_bytes(cache.replace(b'"FILES"', json.dumps(_file_stats(tiny_llama)).encode()))
    assert fingerprints(tiny_llama) == right


def test_damaged_weights_are_a_clear_error(tiny_llama, cli):
    from conftest import assert_one_line_error

    (tiny_llama / "model.safetensors").write_bytes(b"\x00garbage" * 50)
    assert_one_line_error(cli("models", "fingerprint", tiny_llama), "not a valid safetensors")
