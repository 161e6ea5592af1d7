"""Outputs and sampling: the incremental detokeniser equals a whole decode, stop strings are
found across token boundaries, and the batched sampler keeps each row's own semantics."""

from __future__ import annotations

import random

import pytest
import torch

from kvshare.errors import KvshareError
from kvshare.serve import LLM
from kvshare.serve.engine.output import IncrementalDetokenizer
from kvshare.serve.exec.sampler import logprobs_batch, restrict, sample_batch
from kvshare.serve.sampling_params import SamplingParams

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


def test_text_is_decoded_after_the_prompts_last_tokens_as_vllm_does(tokenizer):
    """A SentencePiece tokenizer drops the leading space of a text's first token: decoding the
    output after the prompt's last tokens keeps it (" world", as vLLM returns); a byte-level
    tokenizer's text is its whole decode either way."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    pieces = Tokenizer(models.WordLevel({"<unk>": 0, "▁hello": 1, "▁world": 2, "!": 3}, unk_token="<unk>"))
    pieces.pre_tokenizer = pre_tokenizers.Metaspace()
    pieces.decoder = decoders.Metaspace()
    sentencepiece = PreTrainedTokenizerFast(tokenizer_object=pieces, unk_token="<unk>")
    assert sentencepiece.decode([2, 3]) == "world!"  # alone: no leading space
    detok = IncrementalDetokenizer(sentencepiece, [1])
    for n in (1, 2):
        detok.update([2, 3][:n])
    assert detok.text == " world!"
    prompt = tokenizer.encode("The answer is", add_special_tokens=False)
    output = tokenizer.encode(" forty-two, said the 😀 machine", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, prompt)
    for n in range(1, len(output) + 1):
        detok.update(output[:n])
    detok.flush(output)
    assert detok.text == tokenizer.decode(output, skip_special_tokens=True)


def test_stop_strings_match_across_tokens_and_cut_the_text(base, tokenizer):
    llm = LLM(base, kv_cache_tokens=1024, block_size=4)
    prompt = prompts_for(tokenizer, 1)[0]
    free = llm.generate([prompt], SamplingParams(max_tokens=24, ignore_eos=True))[0]
    assert len(free.text) > 6
    stop = free.text[3:6]  # three characters that likely span tokens
    cut = llm.generate([prompt], SamplingParams(max_tokens=24, ignore_eos=True, stop=[stop]))[0]
    assert cut.finish_reason == "stop" and cut.text == free.text[:free.text.find(stop)]
    assert cut.stop_reason == stop and free.stop_reason is None  # vLLM's field: the string that matched


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


def _transformers_scores(row: torch.Tensor, history: list[int], params: SamplingParams) -> torch.Tensor:
    """One row's scores after transformers' own processors, in generate()'s order."""
    from transformers.generation.logits_process import (MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                                                         TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

    ids, scores = torch.tensor([history]), row[None].clone()
    processors = [RepetitionPenaltyLogitsProcessor(params.repetition_penalty)]
    if not params.greedy:
        processors.append(TemperatureLogitsWarper(params.temperature))
        if params.top_k:
            processors.append(TopKLogitsWarper(params.top_k))
        if params.top_p < 1:
            processors.append(TopPLogitsWarper(params.top_p))
        if params.min_p:
            processors.append(MinPLogitsWarper(params.min_p))
    for processor in processors:
        scores = processor(ids, scores)
    return scores[0]


def test_min_p_top_k_and_repetition_penalty_equal_transformers_processors():
    """On fixed logits, the distribution each row samples from (and each greedy pick) is what
    transformers' RepetitionPenalty, Temperature, TopK, TopP and MinP processors give; a
    seeded draw is the draw from that distribution."""
    from kvshare.serve.exec.sampler import sampling_scores

    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 40, generator=gen) * 3
    histories = [[1, 2, 3, 3, 39], [0, 5], [7], [2, 4, 6, 8, 10, 12], [11, 12], [30, 31, 32]]
    params = [SamplingParams(temperature=0.9, repetition_penalty=1.7),
              SamplingParams(temperature=1.3, min_p=0.2),
              SamplingParams(temperature=0.7, top_k=6, min_p=0.05, repetition_penalty=0.8),
              SamplingParams(temperature=1.0, top_k=10, top_p=0.7, min_p=0.1, repetition_penalty=1.3),
              SamplingParams(temperature=1.0, min_p=1.0),  # only the likeliest token (and ties) stays
              SamplingParams(temperature=0.5, top_k=3, repetition_penalty=2.0)]
    ours = torch.softmax(sampling_scores(logits, params, histories), -1)
    for row, (p, history) in enumerate(zip(params, histories)):
        want = torch.softmax(_transformers_scores(logits[row], history, p), -1)
        torch.testing.assert_close(ours[row], want)
    # repetition penalty changes the greedy pick exactly as transformers' processor does
    favourite = int(logits[0].argmax())
    greedy = [SamplingParams(repetition_penalty=3.0), SamplingParams(repetition_penalty=1.0)]
    picks = sample_batch(logits[:2], greedy, [None, None], [[favourite], None])
    assert picks[0] == int(_transformers_scores(logits[0], [favourite], greedy[0]).argmax()) != favourite
    assert picks[1] == int(logits[1].argmax())
    # a seeded row draws from exactly that distribution
    for row, (p, history) in enumerate(zip(params, histories)):
        seeded = SamplingParams(**{**vars(p), "seed": 5})
        got = sample_batch(logits[row:row + 1], [seeded], [torch.Generator().manual_seed(5)], [history])
        want = torch.softmax(_transformers_scores(logits[row], history, p), -1)
        assert got == [int(torch.multinomial(want, 1, generator=torch.Generator().manual_seed(5)))]


def test_min_p_and_repetition_penalty_are_validated_and_reach_the_engine(base, tokenizer):
    with pytest.raises(KvshareError, match="min_p"):
        SamplingParams(min_p=1.5)
    for penalty in (0, 1e-50, 1e300, float("nan")):  # 1e-50 rounds to 0 in the logits: NaN probabilities
        with pytest.raises(KvshareError, match="repetition_penalty"):
            SamplingParams(repetition_penalty=penalty)
    llm = LLM(base, kv_cache_tokens=1024, block_size=4)
    prompt = prompts_for(tokenizer, 1)[0]
    plain = llm.generate([prompt], SamplingParams(max_tokens=16, ignore_eos=True))[0]
    strong = llm.generate([prompt], SamplingParams(max_tokens=16, ignore_eos=True, repetition_penalty=1e6))[0]
    seen = set(prompt)
    for token in strong.token_ids:  # a huge penalty makes every greedy pick a token not seen before
        assert token not in seen
        seen.add(token)
    assert strong.token_ids != plain.token_ids


def test_min_tokens_and_allowed_token_ids_restrict_the_draw():
    """vLLM's logits processors: a row short of its min_tokens cannot draw an end-of-sequence
    (unless it ignores them) or stop token id; a row with allowed_token_ids draws among them only.
    Rows without either are left alone."""
    logits = torch.zeros(4, 10)
    logits[:, 7] = 5.0  # everyone's greedy pick: 7
    params = [SamplingParams(min_tokens=2, stop_token_ids=[3]), SamplingParams(min_tokens=2),
              SamplingParams(min_tokens=2, ignore_eos=True), SamplingParams(allowed_token_ids=[1, 2, 11])]
    eos = frozenset({7})
    assert sample_batch(logits, params, [None] * 4, generated=[1, 2, 0, 0], eos_token_ids=eos) == [
        0, 7, 7, 1]  # 7 (eos) barred for row 0 only; row 3 among 1, 2 (11 is past this vocabulary)
    scores = restrict(logits, params, [0, 0, 0, 0], eos)
    assert torch.isinf(scores[0, [3, 7]]).all() and torch.isfinite(scores[0, :3]).all()
    assert torch.isfinite(scores[2]).all()  # ignore_eos: the eos stays drawable
    assert torch.isfinite(scores[3, [1, 2]]).all() and torch.isinf(scores[3]).sum() == 8
    assert torch.equal(restrict(logits, [SamplingParams()] * 4, [0] * 4, eos), logits)
    sampled = sample_batch(torch.randn(64, 10), [SamplingParams(temperature=1.0, allowed_token_ids=[4, 9])] * 64,
                           [None] * 64)
    assert set(sampled) <= {4, 9}
    for bad in (dict(min_tokens=5, max_tokens=4), dict(min_tokens=-1), dict(allowed_token_ids=[]),
                dict(allowed_token_ids=[-1])):
        with pytest.raises(KvshareError, match="min_tokens|allowed_token_ids"):
            SamplingParams(**bad)


def test_min_tokens_hold_off_every_stop_in_the_engine(base, tokenizer):
    """The greedy output's first token as a stop token ends a request at once; with min_tokens 3
    that token is never drawn before the third and no stop string cuts the text before it (vLLM's
    rule). allowed_token_ids past the vocabulary are refused."""
    llm = LLM(base, kv_cache_tokens=1024, block_size=4)
    prompt = prompts_for(tokenizer, 1)[0]
    free = llm.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    first = free.token_ids[0]
    stopped = llm.generate([prompt], SamplingParams(max_tokens=8, stop_token_ids=[first]))[0]
    assert stopped.token_ids == [first] and stopped.finish_reason == "stop" and stopped.stop_reason == first
    held = llm.generate([prompt], SamplingParams(max_tokens=8, stop_token_ids=[first], min_tokens=3))[0]
    assert len(held.token_ids) >= 3 and first not in held.token_ids[:3]
    stop = [free.text[:2]]  # matched by the first token or two
    assert len(llm.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True, stop=stop))[0].token_ids) <= 2
    text = llm.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True, stop=stop, min_tokens=6))[0]
    assert len(text.token_ids) >= 6 and text.token_ids == free.token_ids[:len(text.token_ids)]
    allowed = llm.generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True, allowed_token_ids=[5, 6]))[0]
    assert set(allowed.token_ids) <= {5, 6}
    with pytest.raises(KvshareError, match="allowed_token_ids"):
        llm.generate([prompt], SamplingParams(allowed_token_ids=[llm.engine.vocab_size]))
