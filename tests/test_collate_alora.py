"""Collation (response-only loss, aLoRA invocation placement) and aLoRA's exactness rule."""

from __future__ import annotations

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvshare.testing import make_peft_adapter
from kvshare.train.collate import IGNORE, collate, invocation_ids, tokenize_all, tokenize_example
from kvshare.train.data import Example

INVOCATION = "<|invoke|>check<|end_invoke|>"
EXAMPLE = Example("toy/0", "What is 12 plus 30?", "12 plus 30 is 42.")


@pytest.fixture(scope="module")
def tokenizer(tiny_models):
    return AutoTokenizer.from_pretrained(tiny_models("llama"))


def test_loss_covers_exactly_the_response(tokenizer):
    item = tokenize_example(EXAMPLE, tokenizer)
    response = tokenizer.encode(EXAMPLE.response, add_special_tokens=False) + [tokenizer.eos_token_id]
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": EXAMPLE.prompt}],
                                           add_generation_prompt=True, tokenize=True,
                                           return_dict=True)["input_ids"]
    assert item.input_ids == list(prompt) + response
    assert [t for t in item.labels if t != IGNORE] == response
    assert item.labels[: len(prompt)] == [IGNORE] * len(prompt)


def test_alora_puts_the_invocation_between_prompt_and_response(tokenizer):
    inv = invocation_ids(tokenizer, INVOCATION)
    item = tokenize_example(EXAMPLE, tokenizer, invocation=inv)
    response = tokenizer.encode(EXAMPLE.response, add_special_tokens=False) + [tokenizer.eos_token_id]
    start = len(item.input_ids) - len(response) - len(inv)
    assert item.input_ids[start: start + len(inv)] == inv
    assert [t for t in item.labels if t != IGNORE] == response
    assert all(t == IGNORE for t in item.labels[: start + len(inv)])


def test_invocation_without_special_edges_warns(tokenizer):
    with pytest.warns(UserWarning, match="special tokens"):
        invocation_ids(tokenizer, "check this")


def test_too_long_examples_are_dropped_and_counted(tokenizer):
    long = Example("toy/1", "word " * 200, "short")
    kept, stats = tokenize_all([EXAMPLE, long], tokenizer, max_length=64)
    assert len(kept) == 1 and stats.dropped_too_long == 1 and stats.dropped_ids == ["toy/1"]


def test_collate_pads_right_and_masks_padding(tokenizer):
    items = [tokenize_example(EXAMPLE, tokenizer),
             tokenize_example(Example("t/2", "Hi", "Yes."), tokenizer)]
    batch = collate(items, tokenizer.pad_token_id)
    n = len(items[1].input_ids)
    assert batch["attention_mask"][1].tolist() == [1] * n + [0] * (batch["input_ids"].shape[1] - n)
    assert (batch["labels"][1, n:] == IGNORE).all()


def test_alora_hidden_states_before_the_invocation_equal_the_base(tiny_models, tokenizer, tmp_path):
    base_dir = tiny_models("llama")
    inv = invocation_ids(tokenizer, INVOCATION)
    adapter = make_peft_adapter(base_dir, tmp_path / "alora", target_modules=["q_proj", "k_proj", "v_proj"],
                                invocation_tokens=inv)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), adapter)
    base = AutoModelForCausalLM.from_pretrained(base_dir)
    item = tokenize_example(EXAMPLE, tokenizer, invocation=inv)
    ids = torch.tensor([item.input_ids])
    start = next(i for i in range(len(item.input_ids)) if item.input_ids[i: i + len(inv)] == inv)
    with torch.no_grad():
        ours = model(input_ids=ids, output_hidden_states=True).hidden_states
        theirs = base(input_ids=ids, output_hidden_states=True).hidden_states
    for layer, (a, b) in enumerate(zip(ours, theirs)):
        assert torch.equal(a[:, :start], b[:, :start]), layer
    assert not torch.allclose(ours[-1][:, start:], theirs[-1][:, start:])


def test_alora_trains_from_the_prompts_invocation_when_the_response_holds_one_too(tiny_models, tokenizer, tmp_path):
    """Serving switches the adapter on at the invocation the prompt ends with; training does
    too, though PEFT alone would take the last one (here inside the response)."""
    base_dir = tiny_models("llama")
    inv = invocation_ids(tokenizer, INVOCATION)
    adapter = make_peft_adapter(base_dir, tmp_path / "alora", target_modules=["q_proj", "k_proj", "v_proj"],
                                invocation_tokens=inv)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), adapter)
    echo = Example("toy/2", "Say the magic words.", f"Here: {INVOCATION} done.")
    items = [tokenize_example(echo, tokenizer, invocation=inv), tokenize_example(EXAMPLE, tokenizer, invocation=inv)]
    batch = collate(items, tokenizer.pad_token_id)
    width = batch["input_ids"].shape[1]
    assert [width - o for o in batch["alora_offsets"].tolist()] == [item.invocation_start for item in items]
    start = items[0].invocation_start
    assert items[0].input_ids[start:start + len(inv)] == inv
    ids = batch["input_ids"][:1]
    with torch.no_grad():
        ours = model(input_ids=ids, alora_offsets=[width - start]).logits
        pefts = model(input_ids=ids).logits  # PEFT's own offset: the response's invocation
        with model.disable_adapter():
            base = model(input_ids=ids).logits
    assert torch.equal(ours[:, :start], base[:, :start])
    assert not torch.allclose(ours[:, start:start + len(inv) + 2], base[:, start:start + len(inv) + 2])
    assert not torch.allclose(ours, pefts)
