"""Load and faults against a real `kvshare serve` process on loopback (bounded in count and time)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time

import httpx
import pytest

from test_engine import adapters, base, invocation, tokenizer  # noqa: F401
from test_server import free_port

KEY = "load-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server_url(base, adapters):
    port = free_port()
    proc = subprocess.Popen(  # the key comes from the environment, as the README recommends
        [sys.executable, "-m", "kvshare", "serve", "--model", str(base), "--adapter", str(adapters["icarus-a"]),
         "--port", str(port), "--kv-cache-tokens", "4096", "--max-model-len", "256"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env={**os.environ, "KVSHARE_API_KEY": KEY})
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


def gauge(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return float(re.search(rf"^kvshare_{name} (\S+)$", text, re.M).group(1))


def wait_idle(url: str, timeout: float = 60) -> None:
    deadline = time.time() + timeout
    while gauge(url, "blocks_in_use") or gauge(url, "running") or gauge(url, "waiting"):
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
    assert gauge(server_url, "finished") >= 200


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


def test_a_bad_request_does_not_hurt_innocent_requests_in_flight(server_url):
    """Innocent streams run while hostile requests arrive; all innocent ones complete normally."""
    async def innocent(client, i):
        body = {"model": "icarus-a", "prompt": f"Item {i} is", "max_tokens": 12, "temperature": 0,
                "stream": True}
        async with client.stream("POST", server_url + "/v1/completions", json=body, headers=AUTH) as r:
            lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
            return r.status_code == 200 and lines[-1] == "data: [DONE]"

    async def hostile(client, body):
        await asyncio.sleep(0.05)
        r = await client.post(server_url + "/v1/completions", json={"model": "icarus-a", **body}, headers=AUTH)
        return r.status_code

    async def main():
        async with httpx.AsyncClient(timeout=120) as client:
            bad = [{"prompt": "x", "max_tokens": 2, "seed": 2 ** 64}, {"prompt": [1, 10 ** 9], "max_tokens": 2},
                   {"prompt": "x", "max_tokens": 3, "temperature": 1e-300}]
            return await asyncio.gather(*(innocent(client, i) for i in range(6)), *(hostile(client, b) for b in bad))

    results = asyncio.run(main())
    assert all(results[:6]) and results[6:] == [400, 400, 200]  # a tiny temperature samples greedily
    assert httpx.get(server_url + "/health", timeout=10).status_code == 200


def test_a_disconnected_non_streaming_request_is_aborted(server_url):
    before = gauge(server_url, "aborted")
    with pytest.raises(httpx.ReadTimeout):  # the client gives up long before 240 tokens are made
        httpx.post(server_url + "/v1/completions", headers=AUTH, timeout=0.1,
                   json={"model": "icarus-a", "prompt": "A long story:", "max_tokens": 240,
                         "temperature": 0, "stream": False})
    deadline = time.time() + 30
    while gauge(server_url, "aborted") <= before:
        assert time.time() < deadline, "the request kept running after its client left"
        time.sleep(0.05)
    wait_idle(server_url)


def test_the_key_is_required(server_url):
    body = {"model": "icarus-a", "prompt": "hi", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Bearer {KEY}x"}):
        r = httpx.post(server_url + "/v1/completions", json=body, headers=headers, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.post(server_url + "/v1/completions", json=body, headers=AUTH, timeout=30).status_code == 200
