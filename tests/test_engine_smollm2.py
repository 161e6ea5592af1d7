"""The engine on the real reference model: exact against transformers and the ICaRus reference."""

from __future__ import annotations

import pytest
from peft import PeftModel
from transformers import AutoModelForCausalLM

from kvshare.export import export_adapter
from kvshare.serve import LLM, SamplingParams
from kvshare.testing import ICARUS_TARGETS, make_peft_adapter

from test_engine import hf_greedy, icarus_greedy

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def llm(smollm2_dir):
    return LLM(smollm2_dir, kv_cache_tokens=4096, block_size=16)


@pytest.fixture(scope="module")
def chat_prompt(llm):
    return llm.engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Name three uses of a paperclip."}], add_generation_prompt=True,
        tokenize=True, return_dict=True)["input_ids"]


def test_base_greedy_equals_transformers_for_64_tokens(llm, smollm2_dir, chat_prompt):
    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir).eval()
    out = llm.generate([chat_prompt], SamplingParams(max_tokens=64, ignore_eos=True))[0]
    assert out.token_ids == hf_greedy(hf, chat_prompt, 64)
    warm = llm.generate([chat_prompt], SamplingParams(max_tokens=64, ignore_eos=True))[0]
    assert warm.metrics["prompt_tokens_cached"] > 0 and warm.token_ids == out.token_ids


def test_icarus_adapter_equals_the_training_reference(llm, smollm2_dir, chat_prompt, tmp_path):
    ckpt = make_peft_adapter(smollm2_dir, tmp_path / "ckpt", target_modules=ICARUS_TARGETS, rank=8,
                             seed=7)
    adapter = export_adapter(ckpt, kind="icarus", base=smollm2_dir, out=tmp_path / "icarus")
    name = llm.engine.load_adapter(adapter)
    base = llm.generate([chat_prompt], SamplingParams(max_tokens=24, ignore_eos=True))[0]
    out = llm.generate([chat_prompt], SamplingParams(max_tokens=24, ignore_eos=True), adapter=name)[0]
    reference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(smollm2_dir), adapter).eval()
    assert out.token_ids == icarus_greedy(reference, chat_prompt, 24)
    assert out.token_ids != base.token_ids  # the adapter changes the answer
    assert out.metrics["prompt_tokens_cached"] > 0  # it reused the base's prompt blocks
