"""Outputs and sampling: the incremental detokeniser equals a whole decode, stop strings are
found across token boundaries, and the batched sampler keeps each row's own semantics."""

from __future__ import annotations

import random

import pytest
import torch

from kvshare.errors import KvshareError
from kvshare.serve import LLM
from kvshare.serve.output import IncrementalDetokenizer
from kvshare.serve.sampler import logprobs_batch, sample_batch
from kvshare.serve.sampling import SamplingParams

from test_engine import base, prompts_for, tokenizer  # noqa: F401


def test_incremental_text_equals_a_whole_decode(tokenizer):
    rng = random.Random(0)
    specials = tokenizer.all_special_ids
    for _ in range(30):  # random ids, special tokens and split UTF-8 bytes included
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randint(1, 40))] + [rng.choice(specials)]
        detok = IncrementalDetokenizer(tokenizer)
        for n in range(1, len(ids) + 1):
            detok.update(ids[:n])
            assert tokenizer.decode(ids[:n], skip_special_tokens=True).startswith(detok.text)
        detok.flush(ids)
        assert detok.text == tokenizer.decode(ids, skip_special_tokens=True)
    emoji = tokenizer.encode("ok 😀 ok", add_special_tokens=False)  # multi-byte: several tokens
    detok = IncrementalDetokenizer(tokenizer)
    for n in range(1, len(emoji) + 1):
        detok.update(emoji[:n])
    assert detok.text == "ok 😀 ok"  # complete once the last byte of the emoji arrived


def test_stop_strings_match_across_tokens_and_cut_the_text(base, tokenizer):
    llm = LLM(base, kv_cache_tokens=1024, block_size=4)
    prompt = prompts_for(tokenizer, 1)[0]
    free = llm.generate([prompt], SamplingParams(max_tokens=24, ignore_eos=True))[0]
    assert len(free.text) > 6
    stop = free.text[3:6]  # three characters that likely span tokens
    cut = llm.generate([prompt], SamplingParams(max_tokens=24, ignore_eos=True, stop=[stop]))[0]
    assert cut.finish_reason == "stop" and cut.text == free.text[:free.text.find(stop)]


def test_batched_sampler_keeps_each_rows_semantics():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 50, generator=gen)
    params = [SamplingParams(), SamplingParams(temperature=0.8, top_k=1), SamplingParams(temperature=1.0, seed=3),
              SamplingParams(temperature=1.0, top_p=1e-6), SamplingParams(temperature=0.7, top_k=5, seed=4)]
    gens = [None, None, torch.Generator().manual_seed(3), None, torch.Generator().manual_seed(4)]
    tokens = sample_batch(logits, params, gens)
    best = logits.argmax(-1).tolist()
    assert tokens[0] == best[0] and tokens[1] == best[1] and tokens[3] == best[3]  # greedy, top-1, tiny top-p
    assert tokens[4] in torch.topk(logits[4], 5).indices.tolist()
    # a seeded row draws the same token alone as in any batch
    alone = sample_batch(logits[2:3], params[2:3], [torch.Generator().manual_seed(3)])
    assert alone == [tokens[2]]


def test_logprobs_batch_equals_log_softmax():
    logits = torch.randn(3, 20)
    records = logprobs_batch(logits, [1, 2, 3], [0, 2, 4])
    logp = torch.log_softmax(logits, -1)
    for row, record in enumerate(records):
        assert record["logprob"] == pytest.approx(float(logp[row, row + 1]))
        assert len(record["top"]) == [0, 2, 4][row]
        for token, value in record["top"].items():
            assert value == pytest.approx(float(logp[row, token]))


def test_device_option(base):
    llm = LLM(base, kv_cache_tokens=256, block_size=4, device="cpu")
    assert llm.engine.runner.kv_cache.device.type == "cpu"
    if not torch.cuda.is_available():
        with pytest.raises(KvshareError, match="no CUDA GPU"):
            LLM(base, kv_cache_tokens=256, device="cuda")
    with pytest.raises(KvshareError, match="unknown engine setting"):
        LLM(base, kv_cache_tokens=256, kv_cach_tokens=3)
