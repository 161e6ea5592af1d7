"""Tiny model factory and the project's loader: real folders, supported families only."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvshare.errors import KvshareError
from kvshare.models import load_model, resolve_model_dir
from kvshare.testing import TINY_FAMILIES

from conftest import assert_one_line_error


@pytest.mark.parametrize("family", TINY_FAMILIES)
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_tiny_models_load_through_the_real_path(tiny_models, family, tied):
    folder = tiny_models(family, tied=tied)
    model, tokenizer = load_model(folder)
    config = model.config
    assert config.model_type == family
    assert config.num_key_value_heads < config.num_attention_heads  # grouped-query attention
    assert config.tie_word_embeddings is tied
    assert (model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()) is tied
    names = {n for n, _ in model.named_parameters()}
    assert any("q_norm" in n for n in names) is (family == "qwen3")
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is 12 plus 30?"}],
                                        add_generation_prompt=True, return_tensors="pt",
                                        return_dict=True)["input_ids"]
    assert ids[0, 0].item() == tokenizer.convert_tokens_to_ids("<|im_start|>")
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], len(tokenizer))
    assert torch.isfinite(logits).all()


def test_same_seed_same_weights_other_seed_other_weights(tiny_models):
    a = AutoModelForCausalLM.from_pretrained(tiny_models("llama", seed=0))
    b = AutoModelForCausalLM.from_pretrained(tiny_models("llama", seed=1))
    assert not torch.equal(a.model.embed_tokens.weight, b.model.embed_tokens.weight)


def test_unsupported_family_is_refused(tiny_llama):
    config = json.loads((tiny_llama / "config.json").read_text())
    config["model_type"] = "gpt2"
    (tiny_llama / "config.json").write_text(json.dumps(config))
    with pytest.raises(KvshareError, match="not supported"):
        resolve_model_dir(tiny_llama)


def test_pickle_only_model_is_refused_without_unpickling(tiny_llama, cli):
    (tiny_llama / "model.safetensors").unlink()
    (tiny_llama / "pytorch_model.bin").write_bytes(b"this would be a pickle")
    assert_one_line_error(cli("models", "path", tiny_llama), "pickle", "pytorch_model.bin")


def test_unknown_model_name(cli, isolated_home):
    assert_one_line_error(cli("models", "path", "no-such-model"), "unknown model")


def test_zoo_name_not_pulled_says_how(cli, isolated_home):
    assert_one_line_error(cli("models", "path", "smollm2-135m-instruct"),
                          "kvshare models pull smollm2-135m-instruct")


def test_models_path_accepts_a_local_folder(cli, tiny_models):
    folder = tiny_models("qwen3")
    result = cli("models", "path", folder)
    assert result.code == 0
    assert result.out.strip() == str(folder)


def test_malformed_config_json(tiny_llama, cli):
    (tiny_llama / "config.json").write_text("{not json")
    assert_one_line_error(cli("models", "path", tiny_llama), "malformed JSON")
