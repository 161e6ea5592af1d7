"""No single request hurts the others: what one request may ask of the server is bounded (vLLM's
behaviour is the floor), its work stays off the event loop, and bad text is a 4xx."""

from __future__ import annotations

import argparse
import asyncio
import time

import httpx
import pytest
from fastapi.testclient import TestClient

from kvshare.serve import LLMEngine, SamplingParams
from kvshare.serve.config import ServerLimits, add_server_arguments, server_limits_from_args
from kvshare.serve.http.server import create_app

from test_engine import adapters, base, invocation, tokenizer  # noqa: F401
from test_server import KEY, running_server, server  # noqa: F401

AUTH = {"Authorization": f"Bearer {KEY}"}


def _post(server, path: str, body: dict | bytes, timeout: float = 60) -> httpx.Response:
    if isinstance(body, bytes):
        return httpx.post(server["url"] + path, content=body, timeout=timeout,
                          headers={**AUTH, "content-type": "application/json"})
    return httpx.post(server["url"] + path, headers=AUTH, json=body, timeout=timeout)


def _wait_idle(engine: LLMEngine, timeout: float) -> float:
    """Seconds until ``engine`` runs nothing and holds no block; fails past ``timeout``."""
    start = time.perf_counter()
    while engine.has_unfinished() or engine.stats()["blocks_in_use"]:
        assert time.perf_counter() - start < timeout, engine.stats()
        time.sleep(0.01)
    return time.perf_counter() - start


# allowed_token_ids -------------------------------------------------------------------------------

def test_allowed_token_ids_are_at_most_the_vocabulary_and_in_it(server):
    """A list longer than the vocabulary (4 MB of ids with n=4 stalled every other request for
    a minute) or with an id outside it is a 400; repeated ids are one."""
    vocab = server["engine"].vocab_size
    body = {"model": "tiny-base", "prompt": "a", "max_tokens": 3, "ignore_eos": True}
    for ids, words in (([5] * (vocab + 1), f"at most the vocabulary size {vocab}"),
                       ([5, vocab], "outside the vocabulary")):
        r = _post(server, "/v1/completions", {**body, "allowed_token_ids": ids, "n": 4})
        assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
        assert r.json()["error"]["param"] == "allowed_token_ids"
    r = _post(server, "/v1/completions", {**body, "allowed_token_ids": [9, 9, 9]})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == server["engine"].tokenizer.decode([9] * 3)


class _CountedIds(list):
    """A list that counts the loops over it."""

    loops = 0

    def __iter__(self):
        self.loops += 1
        return super().__iter__()


def test_the_allowed_token_mask_is_built_when_the_request_is_added_not_every_step(base):
    params = SamplingParams(max_tokens=12, ignore_eos=True, allowed_token_ids=[5, 6, 5, 6])
    assert params.allowed_token_ids == [5, 6]
    params.allowed_token_ids = ids = _CountedIds([5, 6])
    engine = LLMEngine(base, kv_cache_tokens=256, block_size=8)
    engine.add_request([7, 8, 9], params)
    at_add = ids.loops
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert set(outs[-1].token_ids) <= {5, 6} and len(outs[-1].token_ids) == 12
    assert ids.loops == at_add, f"the ids were read again in {ids.loops - at_add} of 12 steps"


# echo + logprobs ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def scoring_server(base):
    """A server that takes large scoring batches: 64 prompts of 250 tokens, 100 logprobs each."""
    engine = LLMEngine(base, kv_cache_tokens=20480, block_size=8, max_model_len=256)
    parser = argparse.ArgumentParser()
    add_server_arguments(parser)  # kvshare serve's flags
    limits = server_limits_from_args(parser.parse_args(["--max-logprobs", "100",
                                                        "--max-scored-entries", str(64 * 250 * 101)]))
    with running_server(engine, limits=limits) as running:
        yield running


def _scoring_body(prompts: int, length: int = 250, logprobs: int = 100) -> dict:
    prompt = [5 + (7 * i) % 300 for i in range(length)]
    return {"model": "tiny-base", "prompt": [prompt] * prompts, "max_tokens": 0, "echo": True, "logprobs": logprobs}


def test_echo_logprobs_over_the_scoring_budget_is_400_naming_it(scoring_server):
    before = scoring_server["engine"].counters["requests"]
    r = _post(scoring_server, "/v1/completions", {**_scoring_body(32), "n": 3})
    assert r.status_code == 400 and "max_scored_entries" in r.json()["error"]["message"], r.text
    assert r.json()["error"]["param"] == "logprobs"
    assert scoring_server["engine"].counters["requests"] == before  # refused before anything queued


def test_health_answers_while_a_large_echo_reply_is_built(scoring_server):
    """64 x 250 prompt tokens x 101 entries: the reply is about 30 MB of JSON. It is built and
    encoded off the event loop, in pieces, so /health answers within a second meanwhile (it
    waited 3 s while the event loop encoded the reply)."""
    url = scoring_server["url"]

    async def main():
        async with httpx.AsyncClient(timeout=120) as client:
            big = asyncio.ensure_future(client.post(url + "/v1/completions", headers=AUTH, json=_scoring_body(64)))
            slowest = 0.0
            while not big.done():
                start = time.perf_counter()
                assert (await client.get(url + "/health")).status_code == 200
                slowest = max(slowest, time.perf_counter() - start)
                await asyncio.sleep(0.02)
            return await big, slowest

    reply, slowest = asyncio.run(main())
    assert reply.status_code == 200, reply.text[:500]
    choices = reply.json()["choices"]
    assert len(choices) == 64 and len(choices[0]["logprobs"]["top_logprobs"]) == 250
    assert slowest < 1.0, f"/health took {slowest:.2f} s while the reply was built"


# /tokenize and /detokenize -----------------------------------------------------------------------

def test_tokenize_and_detokenize_refuse_more_than_the_context(server):
    """As the generation routes: what no request could run is a 400 (max_model_len is 256)."""
    for path, body, param in (("/tokenize", {"prompt": " ".join(["word"] * 300)}, "prompt"),
                              ("/tokenize", {"messages": [{"role": "user", "content": "word " * 300}]}, "messages"),
                              ("/detokenize", {"tokens": [5] * 257}, "tokens")):
        r = _post(server, path, body)
        assert r.status_code == 400 and "256" in r.json()["error"]["message"], (path, r.text)
        assert r.json()["error"]["param"] == param
    assert _post(server, "/detokenize", {"tokens": [5] * 256}).status_code == 200
    assert _post(server, "/tokenize", {"prompt": "word " * 20}).status_code == 200


# one request's share of the queue ----------------------------------------------------------------

def test_one_request_cannot_fill_the_waiting_queue(base):
    """16 prompts x n=16 with max_tokens null would fill the whole default queue (256) with
    sequences that each run to the end of the context: a 400 naming the limit."""
    engine = LLMEngine(base, kv_cache_tokens=1024, block_size=8, max_model_len=256)
    before = engine.counters["requests"]
    body = {"model": "tiny-base", "prompt": [f"p{i}" for i in range(16)], "n": 16, "max_tokens": None}
    with TestClient(create_app(engine, served_model_name="tiny-base")) as local:
        r = local.post("/v1/completions", json=body)
    assert r.status_code == 400 and "max_request_sequences" in r.json()["error"]["message"], r.text
    assert r.json()["error"]["param"] == "n" and engine.counters["requests"] == before
    parser = argparse.ArgumentParser()
    add_server_arguments(parser)  # kvshare serve's flags
    limits = server_limits_from_args(parser.parse_args(["--max-request-sequences", "4"]))
    with TestClient(create_app(engine, served_model_name="tiny-base", limits=limits)) as local:
        r = local.post("/v1/completions", json={**body, "prompt": ["a", "b", "c", "d", "e"], "n": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
        r = local.post("/v1/completions", json={**body, "prompt": ["a", "b"], "n": 2, "max_tokens": 2})
        assert r.status_code == 200 and len(r.json()["choices"]) == 4, r.text


# disconnects -------------------------------------------------------------------------------------

@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": ["Two prompts", "each twice"], "n": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell a story."}]}),
])
def test_a_client_leaving_a_request_not_streamed_frees_its_sequences_within_a_second(server, monkeypatch, path,
                                                                                        body):
    """Each step is slowed to 20 ms, so the 200 tokens asked for would take seconds: the client
    leaves after 0.5 s, and its sequences are aborted and their blocks freed within a second."""
    engine = server["engine"]
    real_run = engine.runner.run

    def slow(plans, lookup):
        time.sleep(0.02)
        return real_run(plans, lookup)

    monkeypatch.setattr(engine.runner, "run", slow)
    aborted, finished = engine.counters["aborted"], engine.counters["finished"]
    with pytest.raises(httpx.ReadTimeout):
        _post(server, path, {"model": "tiny-base", "max_tokens": 200, "ignore_eos": True, **body}, timeout=0.5)
    assert _wait_idle(engine, timeout=1.0) < 1.0
    assert engine.counters["aborted"] > aborted and engine.counters["finished"] == finished


# text that is not Unicode ------------------------------------------------------------------------

LONE = b"\\ud800"  # a JSON escape of half a UTF-16 pair: json.loads gives a str that no UTF-8 can carry


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", b'{"model": "tiny-base", "prompt": "a' + LONE + b'", "max_tokens": 2}'),
    ("/v1/completions", b'{"model": "tiny-base", "prompt": ["ok", "' + LONE + b'"], "max_tokens": 2}'),
    ("/v1/completions", b'{"model": "tiny-base", "prompt": "a", "max_tokens": 2, "stop": ["' + LONE + b'"]}'),
    ("/v1/completions", b'{"model": "' + LONE + b'", "prompt": "a", "max_tokens": 2}'),
    ("/v1/completions", b'{"model": "tiny-base", "prompt": "a", "max_tokens": 2, "user": "' + LONE + b'"}'),
    ("/v1/completions", b'{"model": "tiny-base", "prompt": "a", "max_tokens": 2, "' + LONE + b'": 1}'),
    ("/v1/chat/completions", b'{"model": "tiny-base", "max_tokens": 2, "messages": [{"role": "user", "content": "'
     + LONE + b'"}]}'),
    ("/v1/chat/completions", b'{"model": "tiny-base", "max_tokens": 2, "messages": [{"role": "user", "content": '
     b'[{"type": "text", "text": "' + LONE + b'"}]}]}'),
    ("/v1/chat/completions", b'{"model": "tiny-base", "max_tokens": 2, "messages": [{"role": "user", "content": "a"}],'
     b' "chat_template_kwargs": {"x": "' + LONE + b'"}}'),
    ("/tokenize", b'{"prompt": "' + LONE + b'"}'),
    ("/tokenize", b'{"messages": [{"role": "user", "content": "' + LONE + b'"}]}'),
    ("/detokenize", b'{"model": "' + LONE + b'", "tokens": [5]}'),
    ("/v1/completions", b'{"model": "tiny-base", "prompt": "a\xff", "max_tokens": 2}'),  # not UTF-8
    ("/v1/completions", b'{"model": "tiny-base", "prompt": "a\xed\xa0\x80", "max_tokens": 2}'),  # a surrogate's bytes
])
def test_text_that_is_not_unicode_is_a_4xx_in_any_field(server, path, body):
    r = _post(server, path, body)
    assert 400 <= r.status_code < 500 and r.headers["content-type"] == "application/json", (r.status_code, r.text)
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}, r.text
    emoji = '{"model": "tiny-base", "prompt": "\\ud83d\\ude00", "max_tokens": 2}'.encode()  # a valid pair
    assert _post(server, "/v1/completions", emoji).status_code == 200
