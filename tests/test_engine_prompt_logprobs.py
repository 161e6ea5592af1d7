"""Prompt scoring (``SamplingParams.prompt_logprobs``, what lm-eval's loglikelihood needs):
every prompt token's log-probability equals transformers / PEFT / the ICaRus reference, cold,
warm from the prefix cache, and in small prefill chunks."""

from __future__ import annotations

import pytest
import torch

from kvshare.serve import LLM, SamplingParams
from kvshare.train.icarus_reference import icarus_reference_logits

from test_engine import adapters, base, invocation, peft_model, prompts_for, tokenizer  # noqa: F401

SCORE = SamplingParams(max_tokens=1, prompt_logprobs=2)


def reference_logits(base, adapters, name, prompt) -> torch.Tensor:
    """Next-token logits at every prompt position but the last, from the reference."""
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([prompt])
    with torch.no_grad():
        if name is None:
            logits = AutoModelForCausalLM.from_pretrained(base)(ids).logits
        elif name.startswith("icarus"):
            logits = icarus_reference_logits(peft_model(base, adapters[name]), ids)
        else:
            logits = peft_model(base, adapters[name])(ids).logits
    return logits[0, :-1].float()


def reference_logprobs(base, adapters, name, prompt):
    """log p(prompt[t] | prompt[:t]) for t >= 1 from the reference implementation."""
    logp = torch.log_softmax(reference_logits(base, adapters, name, prompt), dim=-1)
    return logp.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]


def engine_logprobs(out):
    assert out.prompt_logprobs[0] is None
    assert [e["token"] for e in out.prompt_logprobs[1:]] == out.prompt_token_ids[1:]
    return torch.tensor([e["logprob"] for e in out.prompt_logprobs[1:]])


@pytest.mark.parametrize("name", [None, "lora-a", "alora-a", "icarus-a"])
def test_prompt_logprobs_equal_the_reference_cold_warm_and_chunked(base, adapters, tokenizer, invocation, name):
    head, tail = prompts_for(tokenizer, 2)
    prompt = head + invocation + tail if name == "alora-a" else head + tail
    expected = reference_logprobs(base, adapters, name, prompt)
    for chunk in (4096, 5):  # one prefill, then prefill in chunks of 5 tokens
        llm = LLM(base, list(adapters.values()), kv_cache_tokens=4096, block_size=4,
                  max_num_batched_tokens=chunk)
        cold = llm.generate([prompt], SCORE, adapter=name)[0]
        warm = llm.generate([prompt], SCORE, adapter=name)[0]
        assert warm.metrics["prompt_tokens_cached"] > 0  # the second pass really read the cache
        torch.testing.assert_close(engine_logprobs(cold), expected, atol=1e-4, rtol=0)
        torch.testing.assert_close(engine_logprobs(warm), expected, atol=1e-4, rtol=0)
        best = [max(e["top"], key=e["top"].get) for e in cold.prompt_logprobs[1:]]
        assert len(cold.prompt_logprobs[1]["top"]) == 2
        # the top alternatives are the reference's argmax (what lm-eval's is_greedy needs)
        assert best == reference_logits(base, adapters, name, prompt).argmax(-1).tolist()


def test_scoring_an_icarus_prompt_reuses_the_base_kv(base, adapters, tokenizer):
    prompt = prompts_for(tokenizer, 1)[0] * 2
    llm = LLM(base, list(adapters.values()), kv_cache_tokens=4096, block_size=4)
    llm.generate([prompt], SamplingParams(max_tokens=1))  # the base computes the prompt
    out = llm.generate([prompt], SCORE, adapter="icarus-b")[0]
    assert out.metrics["prompt_tokens_cached"] == len(prompt) // 4 * 4
    torch.testing.assert_close(engine_logprobs(out), reference_logprobs(base, adapters, "icarus-b", prompt),
                               atol=1e-4, rtol=0)


def test_scoring_and_generating_requests_batch_together(base, adapters, tokenizer):
    a, b = prompts_for(tokenizer, 2)
    llm = LLM(base, list(adapters.values()), kv_cache_tokens=4096, block_size=4)
    alone = llm.generate([b], SamplingParams(max_tokens=6, ignore_eos=True), adapter="lora-b")[0].token_ids
    llm = LLM(base, list(adapters.values()), kv_cache_tokens=4096, block_size=4)
    engine = llm.engine
    score_id = engine.add_request(a, SCORE, adapter="icarus-a")
    gen_id = engine.add_request(b, SamplingParams(max_tokens=6, ignore_eos=True), adapter="lora-b")
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert done[gen_id].token_ids == alone and done[gen_id].prompt_logprobs is None
    torch.testing.assert_close(engine_logprobs(done[score_id]), reference_logprobs(base, adapters, "icarus-a", a),
                               atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", ["icarus-a", "lora-a"])
def test_scoring_steps_keep_to_the_token_budget(base, adapters, tokenizer, name, monkeypatch):
    """ICaRus scoring costs two rows per prompt token (base row + read-only adapter row):
    chunks shrink so that no step runs more rows than max_num_batched_tokens, and the scores
    are unchanged."""
    prompt = sum(prompts_for(tokenizer, 3), [])
    budget = 8
    llm = LLM(base, list(adapters.values()), kv_cache_tokens=4096, block_size=4, max_num_batched_tokens=budget)
    sizes = []
    forward = llm.engine.model.forward
    monkeypatch.setattr(llm.engine.model, "forward", lambda batch, *a: sizes.append(len(batch.tokens)) or forward(batch, *a))
    out = llm.generate([prompt], SCORE, adapter=name)[0]
    assert max(sizes) <= budget
    if name == "icarus-a":  # two rows per scored token, so at least twice the steps of plain prefill
        assert len(sizes) >= 2 * (len(prompt) - 1) // budget
    torch.testing.assert_close(engine_logprobs(out), reference_logprobs(base, adapters, name, prompt), atol=1e-4, rtol=0)
