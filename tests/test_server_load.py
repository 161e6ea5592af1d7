"""Load and faults against a real `kvshare serve` process on loopback (bounded in count and time)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvshare.loopback import free_port

from test_engine import adapters, base, invocation, tokenizer  # noqa: F401

KEY = "load-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


def _serve(base, adapters, max_model_len: int):
    """A `kvshare serve` process on a free loopback port: yields its URL, stops it after."""
    port = free_port()
    proc = subprocess.Popen(  # the key comes from the environment, as the README recommends
        [sys.executable, "-m", "kvshare", "serve", "--model", str(base), "--adapter", str(adapters["icarus-a"]),
         "--port", str(port), "--kv-cache-tokens", str(max(4096, max_model_len)),
         "--max-model-len", str(max_model_len)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        # the tiny model has 512 positions; its random weights run past them as well as before
        env={**os.environ, "KVSHARE_API_KEY": KEY, "VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 90
    while True:
        assert proc.poll() is None, proc.stderr.read()[-2000:]
        assert time.time() < deadline, "server did not come up"
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.2)
    yield url
    proc.terminate()
    proc.wait(timeout=20)


@pytest.fixture(scope="module")
def server_url(base, adapters):
    yield from _serve(base, adapters, 256)


@pytest.fixture(scope="module")
def long_server_url(base, adapters):
    """A server whose requests may run for thousands of tokens: the tiny model makes 240 in
    about 0.2 s, as fast as a disconnect is seen, so a short request can finish first."""
    yield from _serve(base, adapters, 8192)


def metric(url: str, name: str) -> float:
    """The unlabelled value of ``kvshare_NAME`` (a gauge, or a counter's ``_total``)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    family = next(f for f in text_string_to_metric_families(text) if f.name == f"kvshare_{name}")
    return next(s.value for s in family.samples if s.name in (family.name, family.name + "_total"))


def wait_idle(url: str, timeout: float = 60) -> None:
    deadline = time.time() + timeout
    while metric(url, "blocks_in_use") or metric(url, "running") or metric(url, "waiting"):
        assert time.time() < deadline, "the pool did not return to idle"
        time.sleep(0.1)


def test_200_concurrent_streaming_clients(server_url):
    async def one(client: httpx.AsyncClient, i: int) -> bool:
        body = {"model": "icarus-a" if i % 2 else str_base(server_url), "prompt": f"Item {i} is",
                "max_tokens": 4, "temperature": 0, "stream": True}
        async with client.stream("POST", server_url + "/v1/completions", json=body, headers=AUTH) as r:
            if r.status_code != 200:
                return False
            lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
            return lines[-1] == "data: [DONE]" and json.loads(lines[-2][6:])["choices"][0]["finish_reason"]

    async def main():
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            return await asyncio.gather(*(one(client, i) for i in range(200)))

    results = asyncio.run(main())
    assert sum(1 for ok in results if not ok) == 0
    wait_idle(server_url)
    assert metric(server_url, "finished") >= 200


def str_base(url: str) -> str:
    return httpx.get(url + "/v1/models", headers=AUTH, timeout=10).json()["data"][0]["id"]


@pytest.mark.parametrize("body,status", [
    ('{"model": "x", "prompt": ', 400),  # malformed JSON
    ({"prompt": "hi", "max_tokens": "many"}, 400),  # wrong type
    ({"prompt": "hi", "max_tokens": 2, "temperature_typo": 1}, 400),  # unknown field
    ({"prompt": "hi", "max_tokens": 10**9}, 400),  # absurd max_tokens
    ({"prompt": "word " * 400, "max_tokens": 2}, 400),  # prompt over the limit
    ({"prompt": "hi", "max_tokens": 2, "frequency_penalty": 1.5}, 400),  # unsupported option
    ({"model": "nobody", "prompt": "hi", "max_tokens": 2}, 404),
    # each of these used to kill the engine thread or fail every request in flight
    ({"prompt": "hi", "max_tokens": 2, "seed": 2 ** 64}, 400),
    ({"prompt": "hi", "max_tokens": 2, "seed": -(2 ** 63) - 1}, 400),
    ({"prompt": [5, 6, 10 ** 6], "max_tokens": 2}, 400),  # token id beyond the vocabulary
    ({"prompt": [5, -1], "max_tokens": 2}, 400),
    ({"prompt": [5, 2 ** 63], "max_tokens": 2}, 400),
    ('{"model": "M", "prompt": "hi", "max_tokens": 2, "temperature": NaN}', 400),
])
def test_bad_requests_are_4xx_and_the_server_keeps_serving(server_url, body, status):
    if isinstance(body, dict):
        body = json.dumps({"model": str_base(server_url), **body})
    else:
        body = body.replace('"M"', json.dumps(str_base(server_url)))
    r = httpx.post(server_url + "/v1/completions", content=body, timeout=30,
                   headers={**AUTH, "content-type": "application/json"})
    assert r.status_code == status and "error" in r.json()
    ok = httpx.post(server_url + "/v1/completions", headers=AUTH, timeout=30,
                    json={"model": str_base(server_url), "prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200


def test_abrupt_disconnects_free_their_blocks(server_url):
    for i in range(20):
        with httpx.stream("POST", server_url + "/v1/completions", headers=AUTH, timeout=30,
                          json={"model": "icarus-a", "prompt": f"Story {i}:", "max_tokens": 150,
                                "temperature": 0, "stream": True}) as r:
            for n, _ in enumerate(r.iter_lines()):
                if n >= 3:
                    break
    wait_idle(server_url)


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


# (path, body: a dict merged over a valid request, or raw JSON text, or an async byte stream
# factory for a chunked upload, expected status): each must be refused without harming anyone
HOSTILE = [
    ("/v1/completions", {"seed": 2 ** 64}, 400),
    ("/v1/completions", {"prompt": [1, 10 ** 9]}, 400),
    ("/v1/completions", {"temperature": 1e-300}, 200),  # a tiny temperature samples greedily
    # numeric fields are bounded
    ("/v1/completions", {"top_k": 10 ** 6}, 400),  # beyond the vocabulary
    ("/v1/completions", {"top_k": -2}, 400),
    ("/v1/completions", {"top_k": 5, "temperature": 0.7, "seed": 1}, 200),  # vLLM's top_k is accepted
    ("/v1/completions", {"n": 0}, 400),
    ("/v1/completions", {"logprobs": 21}, 400),  # over max_logprobs (20)
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, 400),
    ("/v1/chat/completions", {"top_logprobs": 2}, 400),  # top_logprobs needs logprobs: true
    # stop strings, hints and batches are capped
    ("/v1/completions", {"stop": [f"s{i}" for i in range(17)]}, 400),  # over 16 stop sequences
    ("/v1/completions", {"stop": "x" * 1025}, 400),  # a stop string over 1024 characters
    ("/v1/completions", {"stop": [""]}, 400),
    ("/v1/completions", {"kvshare_hints": {"next_agents": ["a" * 200] * 400}}, 400),  # over 64 KiB as JSON
    ("/v1/completions", {"kvshare_hints": {"graph": json.loads(_nested(40))}}, 400),  # nested too deep
    ("/v1/completions", {"prompt": ["x"] * 65}, 400),  # over 64 prompts in one request
    # bodies: too large (declared or chunked), unparsable, unknown routes - all OpenAI-shaped
    ("/v1/completions", {"user": "x" * (9 * 2 ** 20)}, 413),
    ("/v1/completions", "chunked", 413),
    ("/v1/completions", '{"model": "M", "prompt": "hi", "user": ' + _nested(100_000) + "}", 400),
    ("/v1/nowhere", {}, 404),
]


async def _chunked_over_the_limit():
    yield b'{"model": "icarus-a", "prompt": "hi", "user": "'
    for _ in range(9):
        yield b"x" * 2 ** 20
    yield b'"}'


def test_a_bad_request_does_not_hurt_innocent_requests_in_flight(server_url):
    """Innocent streams run while hostile requests arrive: each hostile one gets its status and
    an OpenAI-style error, and every innocent one completes with the text it gets alone."""
    innocents = [{"model": "icarus-a", "prompt": f"Item {i} is", "max_tokens": 48, "temperature": 0}
                 for i in range(6)]
    want = [httpx.post(server_url + "/v1/completions", json=b, headers=AUTH, timeout=60).json()["choices"][0]["text"]
            for b in innocents]

    async def innocent(client, body):
        async with client.stream("POST", server_url + "/v1/completions", json={**body, "stream": True},
                                 headers=AUTH) as r:
            lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
        assert r.status_code == 200 and lines[-1] == "data: [DONE]"
        return "".join(json.loads(line[6:])["choices"][0]["text"] for line in lines[:-1])

    async def hostile(client, path, body):
        await asyncio.sleep(0.05)
        valid = {"model": "icarus-a", "max_tokens": 2}
        valid.update({"messages": [{"role": "user", "content": "x"}]} if "chat" in path else {"prompt": "x"})
        if body == "chunked":
            content = _chunked_over_the_limit()
        else:
            content = json.dumps({**valid, **body}) if isinstance(body, dict) else body.replace('"M"', '"icarus-a"')
        r = await client.post(server_url + path, content=content,
                              headers={**AUTH, "content-type": "application/json"})
        return r.status_code, r.json()

    async def main():
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(innocent(client, b) for b in innocents),
                                        *(hostile(client, path, body) for path, body, _ in HOSTILE))

    results = asyncio.run(main())
    assert results[:len(innocents)] == want
    for (path, body, status), (got, reply) in zip(HOSTILE, results[len(innocents):]):
        shown = body if len(str(body)) < 200 else str(body)[:60]
        assert got == status, (path, shown, reply)
        assert status == 200 or set(reply["error"]) >= {"message", "type", "code"}, (path, shown, reply)
    assert httpx.get(server_url + "/health", timeout=10).status_code == 200
    wait_idle(server_url)


def test_a_huge_prompt_is_tokenised_off_the_event_loop(server_url):
    """A prompt of megabytes takes seconds to tokenise; the server keeps answering meanwhile
    (the prompt is then refused: it is far over the context length)."""
    async def main():
        async with httpx.AsyncClient(timeout=120) as client:
            huge = asyncio.ensure_future(client.post(
                server_url + "/v1/completions", headers=AUTH,
                json={"model": "icarus-a", "prompt": "word " * 600_000, "max_tokens": 2}))
            started, slowest = time.perf_counter(), 0.0
            while not huge.done():
                t = time.perf_counter()
                assert (await client.get(server_url + "/health")).status_code == 200
                slowest = max(slowest, time.perf_counter() - t)
                await asyncio.sleep(0.02)
            return (await huge), time.perf_counter() - started, slowest

    reply, took, slowest = asyncio.run(main())
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "max_tokens"
    assert took > 0.5 and slowest < took / 3, (took, slowest)


def test_a_disconnected_non_streaming_request_is_aborted(long_server_url):
    """ignore_eos: the request has 8,000 tokens of work whatever the tiny model's greedy path is
    (seconds), so it cannot finish (unaborted) before the server sees its client leave (at most
    0.1 s after it does)."""
    url = long_server_url
    before, finished = metric(url, "aborted"), metric(url, "finished")
    with pytest.raises(httpx.ReadTimeout):  # the client gives up long before 8,000 tokens are made
        httpx.post(url + "/v1/completions", headers=AUTH, timeout=0.1,
                   json={"model": "icarus-a", "prompt": "A long story:", "max_tokens": 8000,
                         "temperature": 0, "stream": False, "ignore_eos": True})
    deadline = time.time() + 30
    while metric(url, "aborted") <= before:
        assert time.time() < deadline, "the request kept running after its client left"
        assert metric(url, "finished") == finished, "the request ran to its end after its client left"
        time.sleep(0.05)
    wait_idle(url)


def test_the_key_is_required(server_url):
    body = {"model": "icarus-a", "prompt": "hi", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Bearer {KEY}x"}):
        r = httpx.post(server_url + "/v1/completions", json=body, headers=headers, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.post(server_url + "/v1/completions", json=body, headers=AUTH, timeout=30).status_code == 200
