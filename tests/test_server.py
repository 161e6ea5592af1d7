"""The OpenAI-compatible server, exercised with the real `openai` client over loopback."""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import threading
import time

import httpx
import openai
import pytest
import uvicorn

from kvshare.errors import KvshareError
from kvshare.loopback import free_port
from kvshare.serve import LLM, LLMEngine, SamplingParams
from kvshare.serve.http.server import create_app

from test_engine import INVOCATION, adapters, base, invocation, prompts_for, tokenizer  # noqa: F401

KEY = "test-key"


@contextlib.contextmanager
def running_server(engine: LLMEngine, **app_options):
    """The app over ``engine`` on a free loopback port, in a thread, for the block's duration."""
    app = create_app(engine, api_key=KEY, served_model_name="tiny-base", **app_options)
    port = free_port()
    uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not uv.started:
        assert time.time() < deadline, "server did not start"
        time.sleep(0.05)
    try:
        yield {"url": f"http://127.0.0.1:{port}", "engine": engine}
    finally:
        uv.should_exit = True
        thread.join(timeout=10)


@pytest.fixture(scope="module")
def server(base, adapters):
    engine = LLMEngine(base, [adapters["lora-a"], adapters["alora-a"], adapters["icarus-a"]],
                       kv_cache_tokens=4096, block_size=8, max_model_len=256)
    with running_server(engine, max_waiting=8) as running:
        yield running


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server["url"] + "/v1", api_key=KEY, max_retries=0, timeout=60)


def test_models_lists_base_and_adapters_with_their_sharing(client):
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {"tiny-base", "lora-a", "alora-a", "icarus-a"}
    assert models["icarus-a"].model_extra["kv_sharing"] == "all"
    assert models["lora-a"].model_extra["kv_sharing"] == "none"


def test_tokenize_detokenize_version_and_one_model_as_vllm(client, server, tokenizer):
    """vLLM's /tokenize counts the prompt the server would run: a prompt as completions
    encode it, messages as the chat endpoint renders them for the adapter (an aLoRA's
    invocation included); /detokenize, /version and OpenAI's retrieve-model; bad input is a
    4xx in OpenAI's error shape."""
    url, engine = server["url"], server["engine"]
    auth = {"Authorization": f"Bearer {KEY}"}
    prompt = "What is 12 plus 30? Answer:"
    assert httpx.post(f"{url}/tokenize", json={"prompt": prompt}).status_code == 401  # adapter names, system prompts
    assert httpx.post(f"{url}/detokenize", json={"tokens": [1]}).status_code == 401
    got = httpx.post(f"{url}/tokenize", headers=auth, json={"model": "lora-a", "prompt": prompt}).json()
    assert got["tokens"] == tokenizer.encode(prompt, add_special_tokens=False)
    assert got["count"] == len(got["tokens"]) and got["max_model_len"] == 256
    messages = [{"role": "user", "content": "Check this."}]
    chat = httpx.post(f"{url}/tokenize", headers=auth, json={"model": "alora-a", "messages": messages}).json()
    assert chat["tokens"] == engine.chat_prompt(messages, "alora-a")
    assert chat["tokens"][-len(engine.adapter("alora-a").invocation):] == list(engine.adapter("alora-a").invocation)
    default_base = httpx.post(f"{url}/tokenize", headers=auth, json={"prompt": prompt}).json()
    assert default_base["tokens"] == got["tokens"]
    back = httpx.post(f"{url}/detokenize", headers=auth, json={"model": "tiny-base", "tokens": got["tokens"]}).json()
    assert back == {"prompt": tokenizer.decode(got["tokens"])}
    assert httpx.get(f"{url}/version").json()["version"]
    assert client.models.retrieve("icarus-a").model_extra["kv_sharing"] == "all"
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("no-such-model")
    for path, body, status, words in [
        ("/tokenize", {"model": "lora-a"}, 400, "either prompt or messages"),
        ("/tokenize", {"prompt": "a", "messages": messages}, 400, "either prompt or messages"),
        ("/tokenize", {"model": "nope", "prompt": "a"}, 404, "nope"),
        ("/tokenize", {"prompt": "a", "extra": 1}, 400, "extra"),
        ("/detokenize", {"tokens": [1, 10 ** 9]}, 400, "outside the vocabulary"),
    ]:
        reply = httpx.post(url + path, headers=auth, json=body)
        assert reply.status_code == status and words in reply.json()["error"]["message"], reply.text


def test_completion_matches_the_engine(client, server, tokenizer):
    prompt = "What is 12 plus 30? Answer:"
    out = client.completions.create(model="lora-a", prompt=prompt, max_tokens=12, temperature=0)
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    direct = LLMEngine(server["engine"].model_dir, [server["engine"].adapter("lora-a").path],
                       kv_cache_tokens=1024, block_size=8)
    rid = direct.add_request(ids, SamplingParams(max_tokens=12), adapter="lora-a")
    text = None
    while direct.has_unfinished():
        for o in direct.step():
            if o.request_id == rid and o.finished:
                text = o.text
    assert out.choices[0].text == text
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens >= 1


def test_chat_streamed_equals_not_streamed(client):
    messages = [{"role": "user", "content": "Name a city."}]
    whole = client.chat.completions.create(model="icarus-a", messages=messages, max_tokens=16,
                                           temperature=0)
    pieces = client.chat.completions.create(model="icarus-a", messages=messages, max_tokens=16,
                                            temperature=0, stream=True)
    chunks = list(pieces)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_chat_with_alora_appends_its_invocation(client, server, tokenizer, invocation):
    engine = server["engine"]
    before = engine.counters["prompt_tokens"]
    messages = [{"role": "user", "content": "Is 2 + 2 = 4?"}]
    client.chat.completions.create(model="alora-a", messages=messages, max_tokens=4, temperature=0)
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=True,
                                             return_dict=True)["input_ids"]
    assert engine.counters["prompt_tokens"] - before == len(rendered) + len(invocation)


def test_errors_are_openai_shaped(client, server):
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="nope", prompt="hi", max_tokens=2)
    assert "does not exist" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny-base", prompt="hi " * 200, max_tokens=100)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny-base", prompt="hi", max_tokens=2, temperature=-1)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny-base", messages=[], max_tokens=2)
    bad_key = openai.OpenAI(base_url=server["url"] + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_key.models.list()
    assert httpx.get(server["url"] + "/health").json() == {"status": "ok"}


def test_overload_is_503(server):
    """A server whose waiting queue is full turns new requests away with 503."""
    from fastapi.testclient import TestClient

    app = create_app(server["engine"], served_model_name="tiny-base", max_waiting=0)
    with TestClient(app) as local:
        r = local.post("/v1/completions", json={"model": "tiny-base", "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"


def test_client_disconnect_mid_stream_frees_blocks(server):
    engine = server["engine"]
    with httpx.stream("POST", server["url"] + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                      json={"model": "tiny-base", "prompt": "Paris is", "max_tokens": 200, "temperature": 0,
                            "stream": True}, timeout=30) as response:
        assert response.status_code == 200
        for i, line in enumerate(response.iter_lines()):
            if i > 6:
                break  # hang up mid-stream
    deadline = time.time() + 20
    while engine.stats()["blocks_in_use"] or engine.has_unfinished():
        assert time.time() < deadline, engine.stats()
        time.sleep(0.05)
    assert engine.counters["aborted"] >= 1


def test_metrics_exposes_engine_counters_and_latency_histograms(client, server):
    client.completions.create(model="tiny-base", prompt="Rome is", max_tokens=3, temperature=0)
    text = httpx.get(server["url"] + "/metrics").text
    assert "kvshare_prefix_hit_rate" in text and "kvshare_blocks_in_use" in text
    assert "kvshare_request_time_to_first_token_seconds_bucket" in text


def test_an_engine_failure_fails_the_request_not_the_server(client, server, monkeypatch):
    engine = server["engine"]
    real_forward = engine.runner.model.forward
    calls = {"n": 0}

    def broken_once(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("simulated kernel fault")
        return real_forward(*args, **kwargs)

    monkeypatch.setattr(engine.runner.model, "forward", broken_once)
    with pytest.raises(openai.InternalServerError):
        client.completions.create(model="tiny-base", prompt="Rome is", max_tokens=3, temperature=0)
    out = client.completions.create(model="tiny-base", prompt="Rome is", max_tokens=3, temperature=0)
    assert out.choices[0].finish_reason == "length"
    assert engine.stats()["blocks_in_use"] == 0


@pytest.mark.parametrize("model", ["lora-a", "icarus-a"])
def test_echo_with_logprobs_scores_a_batch_of_prompts_as_the_engine_does(client, server, tokenizer, model):
    """OpenAI's echo + logprobs, on a batch of token prompts: one choice per prompt, the
    prompt's tokens first (the first without a logprob), scored like the engine's
    prompt_logprobs (which test_engine_prompt_logprobs checks against transformers/PEFT)."""
    prompts = prompts_for(tokenizer, 2)
    out = client.completions.create(model=model, prompt=prompts, max_tokens=1, logprobs=2, echo=True, temperature=0)
    engine = server["engine"]
    direct = LLMEngine(engine.model_dir, [engine.adapter(model).path], kv_cache_tokens=1024, block_size=8)
    assert [c.index for c in out.choices] == [0, 1]
    for choice, prompt in zip(out.choices, prompts):
        rid = direct.add_request(prompt, SamplingParams(max_tokens=1, logprobs=2, prompt_logprobs=2), adapter=model)
        want = [o for o in _drain(direct) if o.request_id == rid][-1]
        got = choice.logprobs
        assert choice.text == tokenizer.decode(prompt) + want.text
        assert len(got.tokens) == len(got.token_logprobs) == len(prompt) + 1
        assert got.token_logprobs[0] is None and got.top_logprobs[0] is None
        reference = [e["logprob"] for e in want.prompt_logprobs[1:]] + [want.logprobs[0]["logprob"]]
        assert got.token_logprobs[1:] == pytest.approx(reference, abs=1e-5)
        # keyed by text, as in OpenAI: tokens that decode alike (partial UTF-8 bytes) share a key
        best = [max(e["top"].values()) for e in want.prompt_logprobs[1:]] + [max(want.logprobs[0]["top"].values())]
        assert [max(top.values()) for top in got.top_logprobs[1:]] == pytest.approx(best, abs=1e-5)
    assert out.usage.prompt_tokens == sum(len(p) for p in prompts) and out.usage.completion_tokens == 2


def _drain(engine):
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    return outs


def test_lm_evals_local_completions_scores_through_the_server(server, monkeypatch):
    """lm-eval's own OpenAI-completions client, pointed at `kvshare serve`, gives the
    loglikelihoods of the in-process kvshare lm-eval model for the same adapter."""
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    from kvshare.eval.lm_harness import KvshareLM

    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    engine = server["engine"]
    pairs = [("The capital of France is", " Paris"), ("def add(a, b):\n    return", " a + b"), ("x", " y z w")]
    requests = [Instance(request_type="loglikelihood", doc={}, arguments=p, idx=i) for i, p in enumerate(pairs)]
    remote = LocalCompletionsAPI(base_url=server["url"] + "/v1/completions", model="lora-a",
                                 tokenizer=str(engine.model_dir), tokenizer_backend="huggingface", batch_size=2)
    local = KvshareLM(pretrained=str(engine.model_dir), adapter=str(engine.adapter("lora-a").path))
    got = remote.loglikelihood(requests, disable_tqdm=True)
    want = local.loglikelihood(requests, disable_tqdm=True)
    assert [g[0] for g in got] == pytest.approx([w[0] for w in want], abs=1e-4)
    assert [g[1] for g in got] == [w[1] for w in want]


def test_an_empty_prompt_is_400(server):
    r = _post(server, "/v1/completions", {"model": "tiny-base", "max_tokens": 2, "prompt": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text


def test_a_streamed_batch_with_echo_is_each_prompt_then_its_completion_as_vllm(server):
    """vLLM streams a batch of prompts (choice index = prompt x n + sample) and, with echo,
    opens each choice with its prompt; the texts equal the reply without stream."""
    body = {"model": "tiny-base", "prompt": ["Rome is", "Paris  was"], "max_tokens": 4, "temperature": 0, "n": 2,
            "echo": True}
    r = _post(server, "/v1/completions", body)
    assert r.status_code == 200, r.text
    whole = r.json()["choices"]
    texts: dict[int, str] = {}
    for event in _events(server, "/v1/completions", body):
        for choice in event["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    assert texts == {c["index"]: c["text"] for c in whole} and len(texts) == 4
    assert texts[0].startswith("Rome is") and texts[1].startswith("Rome is") and texts[3].startswith("Paris  was")


def test_health_is_503_when_the_engine_thread_is_gone(base):
    from fastapi.testclient import TestClient

    engine = LLMEngine(base, kv_cache_tokens=256, block_size=8)
    with TestClient(create_app(engine)) as client:
        assert client.get("/health").status_code == 200
        client.app.state.engine_thread.shutdown()  # the thread ends, as if it had died
        r = client.get("/health")
        assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"
        r = client.post("/v1/completions", json={"model": str(base), "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503  # retryable elsewhere, as Ray's router and clients do


@pytest.mark.parametrize("where", ["colocation", "model"])
def test_health_is_503_while_every_step_fails_and_ok_again_after(base, monkeypatch, where):
    """Steps that fail as a whole fail every request; three in a row and /health says so, so a
    load balancer or Ray stops sending here. A broken model fails each request alone (the
    engine splits the batch), which counts the same: no step served anything."""
    from fastapi.testclient import TestClient

    from kvshare.serve.driver.engine_thread import UNHEALTHY_AFTER

    engine = LLMEngine(base, kv_cache_tokens=256, block_size=8)
    body = {"model": str(base), "prompt": "hi", "max_tokens": 2}
    with TestClient(create_app(engine)) as client:
        target = client.app.state.engine_thread.colocation if where == "colocation" else engine.runner
        name = "step" if where == "colocation" else "run"
        real = getattr(target, name)

        def broken(*args, **kwargs):
            raise RuntimeError("simulated broken device")

        monkeypatch.setattr(target, name, broken)
        for _ in range(UNHEALTHY_AFTER):
            assert client.post("/v1/completions", json=body).status_code == 500
        r = client.get("/health")
        assert r.status_code == 503 and "engine steps failed" in r.json()["error"]["message"]
        monkeypatch.setattr(target, name, real)
        assert client.post("/v1/completions", json=body).status_code == 200
        assert client.get("/health").status_code == 200


def test_one_bad_request_retried_on_a_quiet_replica_does_not_take_it_out(base, monkeypatch):
    """A request the engine fails alone, retried by its client on a replica serving nothing
    else, fails every step it runs in: three in a row mark the engine unhealthy, but the idle
    engine then probes itself with a one-token request, which passes, and /health is 200 again
    while the bad request still fails."""
    from fastapi.testclient import TestClient

    from kvshare.serve.driver.engine_thread import UNHEALTHY_AFTER

    engine = LLMEngine(base, kv_cache_tokens=256, block_size=8)
    poison = [7, 7, 7]
    real = engine.runner.run

    def fails_on_poison(plans, adapters):
        if any(plan.seq.prompt == poison for plan in plans):
            raise RuntimeError("simulated request-specific failure")
        return real(plans, adapters)

    monkeypatch.setattr(engine.runner, "run", fails_on_poison)
    with TestClient(create_app(engine)) as client:
        runner = client.app.state.engine_thread
        for _ in range(UNHEALTHY_AFTER):
            assert client.post("/v1/completions", json={"prompt": poison, "max_tokens": 2}).status_code == 500
        deadline = time.monotonic() + 30
        while client.get("/health").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert client.get("/health").status_code == 200 and runner._failed_steps == 0
        assert client.post("/v1/completions", json={"prompt": poison, "max_tokens": 2}).status_code == 500
        assert client.post("/v1/completions", json={"prompt": [8, 9], "max_tokens": 2}).status_code == 200


def test_serving_beyond_loopback_without_a_key_warns(cli, tmp_path, monkeypatch):
    monkeypatch.delenv("KVSHARE_API_KEY", raising=False)
    missing = tmp_path / "no-such-model"  # fails right after the warning: no server starts
    result = cli("serve", "--model", missing, "--host", "0.0.0.0")
    assert result.code == 1 and "warning: serving on 0.0.0.0 without an API key" in result.err
    monkeypatch.setenv("KVSHARE_API_KEY", "k")
    assert "warning" not in cli("serve", "--model", missing, "--host", "0.0.0.0").err


def test_vllms_api_key_variable_keeps_a_deployment_locked(cli, base, monkeypatch):
    """A vLLM deployment keeps its key in VLLM_API_KEY: kvshare serve takes it as vLLM does."""
    import uvicorn
    from fastapi.testclient import TestClient

    monkeypatch.delenv("KVSHARE_API_KEY", raising=False)
    monkeypatch.setenv("VLLM_API_KEY", "k")
    apps = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: apps.append(app))
    assert cli("serve", base, "--kv-cache-tokens", "512").code == 0
    with TestClient(apps[0]) as local:
        assert local.get("/v1/models").status_code == 401
        assert local.get("/v1/models", headers={"Authorization": "Bearer k"}).status_code == 200


AUTH = {"Authorization": f"Bearer {KEY}"}


async def _stream_text(client: httpx.AsyncClient, url: str, body: dict) -> tuple[int, str, list[dict]]:
    """Status, assembled text and the parsed events of one streamed completion."""
    async with client.stream("POST", url + "/v1/completions", json={**body, "stream": True}, headers=AUTH) as r:
        lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
    assert lines and lines[-1] == "data: [DONE]", lines[-3:]
    events = [json.loads(line[6:]) for line in lines[:-1]]
    return r.status_code, "".join(e["choices"][0]["text"] for e in events if "choices" in e), events


def _innocents(n: int, max_tokens: int = 32) -> list[dict]:
    return [{"model": "icarus-a" if i % 2 else "tiny-base", "prompt": f"Item {i} is", "max_tokens": max_tokens,
             "temperature": 0} for i in range(n)]


def _reference(url: str, bodies: list[dict]) -> list[str]:
    """Each innocent body's text, run alone before anything hostile happens."""
    return [httpx.post(url + "/v1/completions", json=b, headers=AUTH, timeout=60).json()["choices"][0]["text"]
            for b in bodies]


def test_a_step_fault_fails_only_its_request_and_ends_its_stream_with_an_error(server, monkeypatch):
    """A fault tied to one request (raised by the runner whenever that request is in the
    batch, once it has made two tokens) ends its stream with an OpenAI-style error event, and a
    non-streaming one with a 500 JSON error; the innocent streams in flight finish with the
    text they give without the fault."""
    engine, url = server["engine"], server["url"]
    innocents = _innocents(4)
    want = _reference(url, innocents)
    bad_prompts = [engine.tokenizer.encode(t, add_special_tokens=False) for t in ("Faulty one:", "Faulty two:")]
    real_run = engine.runner.run

    def faulty(plans, lookup):
        if any(p.seq.prompt in bad_prompts and len(p.seq.output) >= 2 for p in plans):
            raise RuntimeError("simulated fault tied to one request")
        return real_run(plans, lookup)

    monkeypatch.setattr(engine.runner, "run", faulty)

    async def main():
        async with httpx.AsyncClient(timeout=60) as client:
            bad = {"model": "tiny-base", "max_tokens": 40, "temperature": 0}
            return await asyncio.gather(
                *(_stream_text(client, url, b) for b in innocents),
                _stream_text(client, url, {**bad, "prompt": "Faulty one:"}),
                client.post(url + "/v1/completions", headers=AUTH, json={**bad, "prompt": "Faulty two:"}))

    *good, (status, _, events), plain = asyncio.run(main())
    assert [text for _, text, _ in good] == want
    assert status == 200 and "error" in events[-1] and events[-1]["error"]["type"] == "server_error"
    assert any("choices" in e for e in events[:-1])  # it failed mid-stream, after some output
    assert plain.status_code == 500 and plain.json()["error"]["type"] == "server_error"
    assert engine.counters["failed"] >= 2 and engine.stats()["blocks_in_use"] == 0


def test_tool_calling_turns_reach_the_chat_template(server, monkeypatch):
    """OpenAI's tool-calling shapes (an assistant turn of tool_calls and no content, a tool
    turn with its call id, the developer role) reach the template whole, as in vLLM."""
    engine = server["engine"]
    seen = []
    apply = engine.tokenizer.apply_chat_template

    def recording(messages, *args, **kwargs):
        seen.append(messages)
        return apply(messages, *args, **kwargs)

    monkeypatch.setattr(engine.tokenizer, "apply_chat_template", recording)
    messages = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": None,
                 "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "4"}]
    r = httpx.post(server["url"] + "/v1/chat/completions", headers=AUTH, timeout=60,
                   json={"model": "tiny-base", "max_tokens": 2, "messages": messages})
    assert r.status_code == 200, r.text
    sent = seen[-1]
    assert sent[0]["role"] == "developer" and sent[2]["tool_calls"][0]["id"] == "c1" and sent[2]["content"] == ""
    assert sent[3]["tool_call_id"] == "c1" and "tool_calls" not in sent[1]


def test_a_chat_template_error_is_400_and_innocents_go_on(server, monkeypatch):
    """A chat the model's template refuses (here: a role it raises on) is the client's mistake: 400."""
    from kvshare.testing import CHATML_TEMPLATE

    engine, url = server["engine"], server["url"]
    strict = "{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tool messages') }}" \
             "{% endif %}{% endfor %}" + CHATML_TEMPLATE
    monkeypatch.setattr(engine.tokenizer, "chat_template", strict)
    innocents = _innocents(3)
    want = _reference(url, innocents)

    async def main():
        async with httpx.AsyncClient(timeout=60) as client:
            hostile = client.post(url + "/v1/chat/completions", headers=AUTH, json={
                "model": "tiny-base", "max_tokens": 2, "messages": [{"role": "tool", "content": "x"}]})
            return await asyncio.gather(*(_stream_text(client, url, b) for b in innocents), hostile)

    *good, bad = asyncio.run(main())
    assert [text for _, text, _ in good] == want
    assert bad.status_code == 400 and "no tool messages" in bad.json()["error"]["message"]


def test_a_batch_larger_than_the_queue_is_400_and_queues_nothing(server):
    engine = server["engine"]
    before = engine.counters["requests"]
    r = httpx.post(server["url"] + "/v1/completions", headers=AUTH, timeout=30,
                   json={"model": "tiny-base", "prompt": [f"p{i}" for i in range(9)], "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text  # the queue holds 8
    assert engine.counters["requests"] == before
    ok = httpx.post(server["url"] + "/v1/completions", headers=AUTH, timeout=30,
                    json={"model": "tiny-base", "prompt": [f"p{i}" for i in range(8)], "max_tokens": 2})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 8


def test_limits_are_options(server):
    """Each limit is a ServerLimits field (and a --flag from add_server_arguments)."""
    import argparse

    from fastapi.testclient import TestClient

    from kvshare.serve.config import ServerLimits, add_server_arguments, server_limits_from_args

    parser = argparse.ArgumentParser()
    add_server_arguments(parser)
    assert server_limits_from_args(parser.parse_args([])) == ServerLimits()
    limits = server_limits_from_args(parser.parse_args(["--max-request-bytes", "2048", "--max-prompts", "2",
                                                        "--max-stop-sequences", "1", "--max-logprobs", "1"]))
    assert limits.max_request_bytes == 2048 and limits.max_prompts == 2
    body = {"model": "tiny-base", "max_tokens": 2, "prompt": "hi"}
    with TestClient(create_app(server["engine"], served_model_name="tiny-base", limits=limits)) as local:
        assert local.post("/v1/completions", json=body).status_code == 200
        for extra, status in (({"user": "x" * 2048}, 413), ({"prompt": ["a", "b", "c"]}, 400),
                              ({"stop": ["a", "b"]}, 400), ({"logprobs": 2}, 400), ({"logprobs": 1}, 200)):
            r = local.post("/v1/completions", json={**body, **extra})
            assert r.status_code == status and (status == 200 or "error" in r.json()), (extra, r.text)


def test_a_batch_with_a_refused_prompt_is_400_and_runs_none_of_it(server):
    """The engine refuses one prompt of a batch (a token id outside the vocabulary): the reply is
    400 and the batch's other prompts, already queued, are aborted rather than run for nobody."""
    engine = server["engine"]
    before = dict(engine.counters)
    r = httpx.post(server["url"] + "/v1/completions", headers=AUTH, timeout=30,
                   json={"model": "tiny-base", "prompt": [[5, 6, 7], [5, 10 ** 9]], "max_tokens": 200,
                         "temperature": 0})
    assert r.status_code == 400 and "vocabulary" in r.json()["error"]["message"], r.text
    deadline = time.time() + 20
    while engine.has_unfinished() or engine.stats()["blocks_in_use"]:
        assert time.time() < deadline, engine.stats()
        time.sleep(0.05)
    assert engine.counters["finished"] == before["finished"]
    assert engine.counters["aborted"] == before["aborted"] + 1


# vLLM-compatible surface -------------------------------------------------------------------------

def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server["url"] + path, headers=AUTH, json=body, timeout=60)


def _events(server, path: str, body: dict) -> list[dict]:
    """The parsed data events of one streamed request (the final [DONE] checked and dropped)."""
    with httpx.stream("POST", server["url"] + path, headers=AUTH, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


def test_model_cards_have_vllms_root_and_parent(client, server):
    cards = {m.id: m.model_extra | {"owned_by": m.owned_by} for m in client.models.list().data}
    engine = server["engine"]
    assert cards["tiny-base"]["root"] == str(engine.model_dir) and cards["tiny-base"]["parent"] is None
    for name in ("lora-a", "alora-a", "icarus-a"):
        assert cards[name]["root"] == str(engine.adapter(name).path)
        assert cards[name]["parent"] == "tiny-base" and cards[name]["owned_by"] == "kvshare"


def test_lora_modules_and_served_model_name_flags(cli, base, adapters, monkeypatch):
    """`--lora-modules name=path` and its JSON form serve an adapter under that name;
    `--served-model-name` names the base; a JSON base_model_name for another base is a one-line error."""
    from fastapi.testclient import TestClient

    from conftest import assert_one_line_error

    apps = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: apps.append(app))
    result = cli("serve", "--model", base, "--kv-cache-tokens", "1024", "--lora-modules", f"mine={adapters['lora-a']}",
                 json.dumps({"name": "theirs", "path": str(adapters["icarus-a"]), "base_model_name": "tiny"}),
                 "--served-model-name", "tiny", "alias")
    assert result.code == 0, result.err
    with TestClient(apps[0]) as local:
        cards = {c["id"]: c for c in local.get("/v1/models").json()["data"]}
        assert list(cards) == ["tiny", "alias", "mine", "theirs"]  # every served name, as vLLM lists them
        assert cards["alias"]["root"] == cards["tiny"]["root"] and cards["alias"]["parent"] is None
        assert local.get("/v1/models/alias").json()["id"] == "alias"
        assert cards["mine"]["root"] == str(adapters["lora-a"]) and cards["mine"]["parent"] == "tiny"
        for model in ("tiny", "alias", "mine", "theirs"):
            r = local.post("/v1/completions", json={"model": model, "prompt": "Rome is", "max_tokens": 2})
            assert r.status_code == 200 and r.json()["model"] == model, r.text
        unnamed = local.post("/v1/completions", json={"model": "lora-a", "prompt": "x", "max_tokens": 2})
        assert unnamed.status_code == 404  # served under its --lora-modules name only
        assert local.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "y"}).status_code == 404
    other = json.dumps({"name": "x", "path": str(adapters["lora-a"]), "base_model_name": "some-other-base"})
    assert_one_line_error(cli("serve", "--model", base, "--lora-modules", other), "'some-other-base'")
    assert_one_line_error(cli("serve", "--model", base, "--lora-modules", "no-equals-sign"), "name=path")
    assert_one_line_error(cli("serve", "--model", base, "--lora-modules", '{"name": "x"}'), "'path'")


def test_min_p_and_repetition_penalty_over_http(client, server, tokenizer):
    prompt = "Paris is the capital of France. Paris is the capital of France. Paris is"
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    out = client.completions.create(model="lora-a", prompt=prompt, max_tokens=10, temperature=0,
                                    extra_body={"repetition_penalty": 0.05, "min_p": 0.3, "top_k": 5})
    plain = client.completions.create(model="lora-a", prompt=prompt, max_tokens=10, temperature=0)
    engine = server["engine"]
    direct = LLMEngine(engine.model_dir, [engine.adapter("lora-a").path], kv_cache_tokens=1024, block_size=8)
    rid = direct.add_request(ids, SamplingParams(max_tokens=10, repetition_penalty=0.05, min_p=0.3, top_k=5),
                             adapter="lora-a")
    want = [o for o in _drain(direct) if o.request_id == rid][-1]
    assert out.choices[0].text == want.text != plain.choices[0].text
    for field, value in (("min_p", 1.5), ("repetition_penalty", 0), ("top_k", -2)):
        r = _post(server, "/v1/completions", {"model": "tiny-base", "prompt": "a", "max_tokens": 2, field: value})
        assert r.status_code == 400 and field in r.json()["error"]["message"], r.text


def test_stream_options_include_usage_ends_with_a_usage_chunk(client, server):
    messages = [{"role": "user", "content": "Name a city."}]
    whole = client.chat.completions.create(model="icarus-a", messages=messages, max_tokens=8, temperature=0)
    chunks = list(client.chat.completions.create(model="icarus-a", messages=messages, max_tokens=8, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    events = _events(server, "/v1/completions", {"model": "tiny-base", "prompt": "Rome is", "max_tokens": 4,
                                                  "temperature": 0, "stream_options": {"include_usage": True}})
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 4
    plain = _events(server, "/v1/completions", {"model": "tiny-base", "prompt": "Rome is", "max_tokens": 4})
    assert all(e["choices"] and "usage" not in e for e in plain)  # without it: no usage chunk
    for options, param in (({"include_usage": True, "continuous_usage_stats": True},
                            "stream_options.continuous_usage_stats"), ({"bogus": 1}, "stream_options.bogus")):
        r = _post(server, "/v1/completions", {"model": "tiny-base", "prompt": "a", "max_tokens": 2, "stream": True,
                                              "stream_options": options})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = _post(server, "/v1/completions", {"model": "tiny-base", "prompt": "a", "max_tokens": 2,
                                          "stream_options": {"include_usage": True}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options"


def test_chat_content_parts_are_joined_text_and_other_parts_are_400(client, server):
    engine = server["engine"]
    as_text = client.chat.completions.create(model="tiny-base", max_tokens=6, temperature=0,
                                             messages=[{"role": "user", "content": "Name a\ncity."}])
    as_parts = client.chat.completions.create(model="tiny-base", max_tokens=6, temperature=0, messages=[
        {"role": "user", "content": [{"type": "text", "text": "Name a"}, {"type": "text", "text": "city."}]}])
    assert as_parts.choices[0].message.content == as_text.choices[0].message.content
    assert as_parts.usage.prompt_tokens == as_text.usage.prompt_tokens
    before = engine.counters["requests"]
    r = _post(server, "/v1/chat/completions", {"model": "tiny-base", "max_tokens": 2, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "see"},
                                     {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]})
    assert r.status_code == 400 and "'image_url'" in r.json()["error"]["message"], r.text
    assert engine.counters["requests"] == before


def test_fields_we_do_not_implement_are_400_naming_the_field(server):
    for path, extra, field in (("/v1/completions", {"use_beam_search": True}, "use_beam_search"),
                               ("/v1/completions", {"best_of": 3}, "best_of"),
                               ("/v1/completions", {"guided_json": {"type": "object"}}, "guided_json"),
                               ("/v1/chat/completions", {"prompt_logprobs": 1}, "prompt_logprobs")):
        body = {"model": "tiny-base", "max_tokens": 2, **extra}
        body.update({"prompt": "a"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "a"}]})
        r = _post(server, path, body)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
        assert field in r.json()["error"]["message"] and "not supported" in r.json()["error"]["message"]
    ok = _post(server, "/v1/completions", {"model": "tiny-base", "prompt": "a", "max_tokens": 2, "best_of": 1})
    assert ok.status_code == 200


def test_n_choices_are_seeded_per_choice_and_share_the_prompts_kv(client, server, tokenizer):
    engine = server["engine"]
    body = dict(model="lora-a", prompt="Tell me a story about a cat:", max_tokens=12, temperature=1.0, seed=7)
    three = client.completions.create(n=3, **body)
    again = client.completions.create(n=3, **body)
    single = client.completions.create(n=1, **body)
    texts = [c.text for c in three.choices]
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert texts == [c.text for c in again.choices] and texts[0] == single.choices[0].text
    assert len(set(texts)) > 1  # seed + i per choice: the choices differ
    assert three.usage.prompt_tokens == single.usage.prompt_tokens  # the prompt counts once
    assert three.usage.completion_tokens > single.usage.completion_tokens
    # the prompt's blocks are computed once: the later choices reuse them from the prefix cache
    prompt = "A prompt of many distinct words seen nowhere else in these tests, long enough for blocks:"
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    hits = engine._blocks.stats.hit_tokens
    out = client.completions.create(model="tiny-base", prompt=[prompt, "Other"], n=4, max_tokens=3, temperature=0)
    assert engine._blocks.stats.hit_tokens - hits >= 3 * (len(ids) // engine.block_size) * engine.block_size > 0
    assert [c.index for c in out.choices] == list(range(8)) and len({c.text for c in out.choices[:4]}) == 1
    assert out.usage.prompt_tokens == len(ids) + len(tokenizer.encode("Other", add_special_tokens=False))
    # streamed chat with n: the chunks of each index assemble its non-streamed choice
    chat = dict(model="icarus-a", messages=[{"role": "user", "content": "Name a city."}], max_tokens=8,
                temperature=1.0, seed=3, n=2)
    whole = client.chat.completions.create(**chat)
    pieces = {0: "", 1: ""}
    for chunk in client.chat.completions.create(stream=True, **chat):
        for choice in chunk.choices:
            pieces[choice.index] += choice.delta.content or ""
    assert [pieces[0], pieces[1]] == [c.message.content for c in whole.choices]
    events = _events(server, "/v1/completions", {**body, "n": 3})
    streamed = ["".join(e["choices"][0]["text"] for e in events if e["choices"][0]["index"] == i) for i in range(3)]
    assert streamed == texts


def test_n_is_capped_and_counts_against_the_queue(server):
    for n, prompts, why in ((17, "a", "at most 16"), (5, ["a", "b"], "capacity of 8")):  # 2 x 5 > the queue
        r = _post(server, "/v1/completions", {"model": "tiny-base", "prompt": prompts, "max_tokens": 2, "n": n})
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == "n" and why in error["message"], r.text
    ok = _post(server, "/v1/completions", {"model": "tiny-base", "prompt": ["a", "b"], "max_tokens": 2, "n": 4})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 8


def test_cache_salt_isolates_tenants_and_reuses_within_one(client, server):
    prompt = "The secret plan of tenant one is written here in full, word after word, for the cache:"
    cached = {}
    texts = {}
    for name, salt in (("t1", "tenant-1"), ("t2", "tenant-2"), ("t1-again", "tenant-1"), ("none", None),
                       ("none-again", None)):
        extra = {"cache_salt": salt} if salt else {}
        out = client.completions.create(model="tiny-base", prompt=prompt, max_tokens=4, temperature=0, extra_body=extra)
        cached[name], texts[name] = out.usage.prompt_tokens_details.cached_tokens, out.choices[0].text
    assert cached["t1"] == 0 and cached["t2"] == 0 and cached["none"] == 0  # nobody sees another's blocks
    assert cached["t1-again"] > 0 and cached["none-again"] > 0  # same salt (or none): shared
    assert len(set(texts.values())) == 1
    r = _post(server, "/v1/completions", {"model": "tiny-base", "prompt": "a", "max_tokens": 2, "cache_salt": ""})
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"


def test_runtime_lora_loading_checks_like_adapter_and_refuses_to_unload_in_use(base, adapters, tiny_models, tmp_path,
                                                                                 monkeypatch):
    from kvshare.fingerprint import fingerprints

    engine = LLMEngine(base, kv_cache_tokens=2048, block_size=8, max_model_len=256)
    with running_server(engine, enable_lora_loading=True) as srv:
        load = {"lora_name": "hot", "lora_path": str(adapters["lora-a"])}
        r = _post(srv, "/v1/load_lora_adapter", load)
        assert r.status_code == 200 and "hot" in r.text
        assert _post(srv, "/v1/load_lora_adapter", load).status_code == 400  # the name is taken
        cards = {c["id"]: c for c in httpx.get(srv["url"] + "/v1/models", headers=AUTH).json()["data"]}
        assert cards["hot"]["root"] == str(adapters["lora-a"]) and cards["hot"]["parent"] == "tiny-base"
        # another base's adapter is refused by the fingerprint check of --adapter
        foreign = tmp_path / "foreign"
        shutil.copytree(adapters["lora-b"], foreign)
        manifest = json.loads((foreign / "kvshare.json").read_text())
        manifest["base_model"]["fingerprint"] = fingerprints(tiny_models("llama", seed=1)).base
        (foreign / "kvshare.json").write_text(json.dumps(manifest))
        r = _post(srv, "/v1/load_lora_adapter", {"lora_name": "foreign", "lora_path": str(foreign)})
        assert r.status_code == 400 and "would not match" in r.json()["error"]["message"], r.text
        assert _post(srv, "/v1/load_lora_adapter", {"lora_name": "gone", "lora_path": str(tmp_path / "no")}
                     ).status_code == 400
        # in use: refused; once its request is gone: unloaded, and the name is unknown
        real_run = engine.runner.run
        monkeypatch.setattr(engine.runner, "run", lambda *a: (time.sleep(0.01), real_run(*a))[1])  # keep it in flight
        with httpx.stream("POST", srv["url"] + "/v1/completions", headers=AUTH, timeout=60,
                          json={"model": "hot", "prompt": "Rome is", "max_tokens": 200, "temperature": 0,
                                "stream": True}) as streaming:
            lines = streaming.iter_lines()
            next(lines)
            r = _post(srv, "/v1/unload_lora_adapter", {"lora_name": "hot"})
            assert r.status_code == 409 and "in use" in r.json()["error"]["message"], r.text
            assert engine.has_unfinished()
        deadline = time.time() + 20
        while engine.has_unfinished():
            assert time.time() < deadline
            time.sleep(0.05)
        r = _post(srv, "/v1/unload_lora_adapter", {"lora_name": "hot"})
        assert r.status_code == 200 and "removed" in r.text
        assert _post(srv, "/v1/unload_lora_adapter", {"lora_name": "hot"}).status_code == 404
        r = _post(srv, "/v1/completions", {"model": "hot", "prompt": "a", "max_tokens": 2})
        assert r.status_code == 404


def test_runtime_lora_loading_is_404_without_the_flag_and_on_with_vllms_variable(server, cli, base, monkeypatch):
    assert _post(server, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "y"}).status_code == 404
    assert _post(server, "/v1/unload_lora_adapter", {"lora_name": "lora-a"}).status_code == 404
    seen = {}
    monkeypatch.setattr("kvshare.serve.http.server.serve", lambda *a, **kw: seen.update(kw))
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    assert cli("serve", "--model", base).code == 0 and seen["enable_lora_loading"] is True
    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING")
    assert cli("serve", "--model", base).code == 0 and seen["enable_lora_loading"] is False
    assert cli("serve", "--model", base, "--enable-lora-loading").code == 0 and seen["enable_lora_loading"] is True


def test_a_vllm_command_line_runs_unchanged(cli, base, adapters, monkeypatch):
    """`vllm serve MODEL --enable-lora --lora-modules ... --enable-prefix-caching` (the model
    positional, vLLM's always-on flags accepted) serves as `--model` does; vLLM's fields:
    `stop_token_ids` (ids outside the vocabulary a 400) end a choice, `ignore_eos` generates
    max_tokens past the end-of-sequence token."""
    from fastapi.testclient import TestClient

    from conftest import assert_one_line_error

    apps = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: apps.append(app))
    result = cli("serve", base, "--enable-lora", "--lora-modules", f"mine={adapters['lora-a']}",
                 "--enable-prefix-caching", "--kv-cache-tokens", "1024")
    assert result.code == 0, result.err
    with TestClient(apps[0]) as local:
        assert {c["id"] for c in local.get("/v1/models").json()["data"]} == {str(base), "mine"}
        body = {"model": "mine", "prompt": [5, 6, 7], "temperature": 0}
        alone = LLM(base, [adapters["lora-a"]], kv_cache_tokens=512)
        first = alone.generate([[5, 6, 7]], SamplingParams(max_tokens=1), adapter="lora-a")[0].token_ids[0]
        stopped = local.post("/v1/completions", json=body | {"max_tokens": 12, "stop_token_ids": [first]}).json()
        assert stopped["usage"]["completion_tokens"] == 1 and stopped["choices"][0]["finish_reason"] == "stop"
        for bad in ([-1], [10 ** 9], list(range(100))):  # outside the vocabulary; more than the limit allows
            r = local.post("/v1/completions", json=body | {"stop_token_ids": bad})
            assert r.status_code == 400 and r.json()["error"]["param"] == "stop_token_ids", r.text
        apps[0].state.engine_thread.engine.eos_token_ids = frozenset({first})  # the greedy first token now ends it
        stopped = local.post("/v1/completions", json=body | {"max_tokens": 12}).json()
        assert stopped["usage"]["completion_tokens"] == 1 and stopped["choices"][0]["finish_reason"] == "stop"
        r = local.post("/v1/completions", json=body | {"max_tokens": 12, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 12 and r.json()["choices"][0]["finish_reason"] == "length"
    assert_one_line_error(cli("serve"), "needs a model")
    assert_one_line_error(cli("serve", base, "--model", "other"), "two models")


def test_a_stream_holds_back_what_may_begin_a_stop_string(server, tokenizer):
    """A stop string that starts inside one token and ends in a later one: the stream may not
    send its first characters before it knows they are cut; streamed text = the reply."""
    url = server["url"]
    body = {"model": "tiny-base", "prompt": "The list:", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    reply = httpx.post(url + "/v1/completions", json=body, headers=AUTH, timeout=60).json()["choices"][0]["text"]
    ids = tokenizer.encode(reply, add_special_tokens=False)
    stop = None
    for i in range(1, len(ids)):  # a 3-character stop string across a token boundary, first seen there
        cut = len(tokenizer.decode(ids[:i]))
        candidate = reply[cut - 1:cut + 2]
        if len(candidate) == 3 and 0 < cut - 1 == reply.find(candidate) and not candidate.isspace():
            stop = candidate
            break
    assert stop is not None, reply
    whole = httpx.post(url + "/v1/completions", json={**body, "stop": [stop]}, headers=AUTH,
                       timeout=60).json()["choices"][0]
    assert whole["finish_reason"] == "stop" and whole["text"] == reply[:reply.find(stop)]

    async def streamed():
        async with httpx.AsyncClient(timeout=60) as client:
            return await _stream_text(client, url, {**body, "stop": [stop]})

    status, text, events = asyncio.run(streamed())
    assert status == 200 and text == whole["text"], (stop, text, whole["text"])
    assert events[-1]["choices"][0]["finish_reason"] == "stop"


def test_null_fields_take_their_defaults_and_max_tokens_null_is_the_rest_of_the_context(server):
    """OpenAI's optional fields are "X or null"; a chat without max_tokens may run to the end of
    the context (the test server's is 256 tokens), as in OpenAI and vLLM, and so may a completion
    whose max_tokens is null (vLLM; left out, it is 16)."""
    url = server["url"]
    chat = {"model": "tiny-base", "messages": [{"role": "user", "content": "Count: one two"}], "temperature": 0,
            "top_p": None, "n": None, "stream": None, "max_tokens": None, "logprobs": None, "seed": None,
            "ignore_eos": True}
    r = httpx.post(url + "/v1/chat/completions", json=chat, headers=AUTH, timeout=120)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == server["engine"].max_model_len
    r = httpx.post(url + "/v1/completions", headers=AUTH, timeout=60,
                   json={"model": "tiny-base", "prompt": "Hi", "temperature": None, "echo": None, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 16, r.text
    r = httpx.post(url + "/v1/completions", headers=AUTH, timeout=120,
                   json={"model": "tiny-base", "prompt": ["Hi", "Count: one two"], "max_tokens": None,
                         "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]  # each of the two prompts ran to the end of the context
    assert usage["prompt_tokens"] + usage["completion_tokens"] == 2 * server["engine"].max_model_len


@pytest.mark.parametrize("k", [0, 2])
def test_streamed_logprobs_equal_the_reply_not_streamed(server, k):
    """Each chunk carries the logprobs of the tokens generated since the last (vLLM's shape): put
    together they are the whole reply's, tokens, logprobs, alternatives and text offsets (greedy,
    so both runs pick the same tokens); chat too. Echo with logprobs is not streamed: a 400."""
    body = {"model": "tiny-base", "prompt": "Hi there", "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "logprobs": k}
    whole = _post(server, "/v1/completions", body).json()["choices"][0]["logprobs"]
    parts = [c["logprobs"] for e in _events(server, "/v1/completions", body) for c in e["choices"] if c["logprobs"]]
    for key in ("tokens", "text_offset"):
        assert sum((p[key] for p in parts), []) == whole[key]
    assert sum((p["token_logprobs"] for p in parts), []) == pytest.approx(whole["token_logprobs"], abs=1e-5)
    assert [sorted(t) for p in parts for t in p["top_logprobs"]] == [sorted(t) for t in whole["top_logprobs"]]
    chat = {"model": "tiny-base", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "temperature": 0,
            "ignore_eos": True, "logprobs": True, "top_logprobs": k}
    whole = _post(server, "/v1/chat/completions", chat).json()["choices"][0]["logprobs"]["content"]
    events = _events(server, "/v1/chat/completions", chat)
    parts = [entry for e in events for c in e["choices"] if c["logprobs"] for entry in c["logprobs"]["content"]]
    assert [(p["token"], p["bytes"], len(p["top_logprobs"])) for p in parts] == [
        (w["token"], w["bytes"], len(w["top_logprobs"])) for w in whole]
    assert [p["logprob"] for p in parts] == pytest.approx([w["logprob"] for w in whole], abs=1e-5)
    r = _post(server, "/v1/completions", {**body, "echo": True, "stream": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"


def test_a_client_that_leaves_while_queued_is_aborted_before_any_token(server, monkeypatch):
    """The engine thread is held inside another request's step, so this one is still queued
    when its client gives up: it is aborted without ever being run."""
    engine, url = server["engine"], server["url"]
    gate, entered = threading.Event(), threading.Event()
    real_run = engine.runner.run

    def held(plans, lookup):
        if not gate.is_set():
            entered.set()
            gate.wait(30)
        return real_run(plans, lookup)

    monkeypatch.setattr(engine.runner, "run", held)
    generated, aborted = engine.counters["generated_tokens"], engine.counters["aborted"]
    holder = threading.Thread(target=lambda: httpx.post(url + "/v1/completions", headers=AUTH, timeout=60, json={
        "model": "tiny-base", "prompt": "Rome is", "max_tokens": 2, "ignore_eos": True}))
    holder.start()
    assert entered.wait(30)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/completions", headers=AUTH, timeout=0.3, json={
            "model": "tiny-base", "prompt": "A long story:", "max_tokens": 50, "ignore_eos": True})
    time.sleep(0.5)  # the server notices the client left within 0.1 s and queues the abort
    gate.set()
    deadline = time.time() + 10
    while engine.counters["aborted"] == aborted:
        assert time.time() < deadline
        time.sleep(0.05)
    holder.join(30)
    assert engine.counters["generated_tokens"] - generated == 2  # the holder's two, none of the leaver's
    assert engine.stats()["blocks_in_use"] == 0


def test_a_failed_choice_cancels_the_other_choices_of_its_request(server, monkeypatch):
    """n=2, not streamed: the second choice (seed + 1) faults after two tokens; the reply is a
    500, and the first choice is aborted instead of generating on for nobody."""
    engine, url = server["engine"], server["url"]
    real_run = engine.runner.run

    def faulty(plans, lookup):
        if any(p.seq.params.seed == 8 and len(p.seq.output) >= 2 for p in plans):
            raise RuntimeError("simulated fault tied to one choice")
        return real_run(plans, lookup)

    monkeypatch.setattr(engine.runner, "run", faulty)
    finished, aborted = engine.counters["finished"], engine.counters["aborted"]
    r = httpx.post(url + "/v1/completions", headers=AUTH, timeout=60, json={
        "model": "tiny-base", "prompt": "Two choices:", "n": 2, "seed": 7, "temperature": 0.8, "max_tokens": 200,
        "ignore_eos": True})
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    deadline = time.time() + 20
    while engine.counters["aborted"] == aborted or engine.has_unfinished():
        assert time.time() < deadline, engine.counters
        time.sleep(0.05)
    assert engine.counters["finished"] == finished  # the first choice never ran to its 200 tokens
    assert engine.stats()["blocks_in_use"] == 0


def test_an_alias_may_not_hide_an_adapter_and_chat_defaults_fit_the_pool(base, adapters):
    engine = LLMEngine(base, [adapters["lora-a"]], kv_cache_tokens=64, block_size=4)
    with pytest.raises(KvshareError, match="also an adapter's name"):
        create_app(engine, served_model_name=["tiny-base", "lora-a"])
    from fastapi.testclient import TestClient

    assert engine.max_request_tokens() == 64 < engine.max_model_len
    with TestClient(create_app(engine, served_model_name="tiny-base")) as local:
        r = local.post("/v1/chat/completions", json={"model": "tiny-base", "ignore_eos": True,
                                                     "messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == 64


def test_completions_take_vllms_add_special_tokens(base, monkeypatch):
    """Text prompts get the tokenizer's special tokens unless add_special_tokens is false
    (vLLM's field and its default)."""
    from fastapi.testclient import TestClient

    engine = LLMEngine(base, kv_cache_tokens=256, block_size=8)
    seen, encode = [], engine.tokenizer.encode
    monkeypatch.setattr(engine.tokenizer, "encode", lambda text, **kw: seen.append(kw["add_special_tokens"])
                        or encode(text, **kw))
    with TestClient(create_app(engine, served_model_name="tiny-base")) as client:
        for extra in ({}, {"add_special_tokens": False}):
            r = client.post("/v1/completions", json={"model": "tiny-base", "prompt": "hi", "max_tokens": 1, **extra})
            assert r.status_code == 200, r.text
    assert seen == [True, False]


def test_a_stream_holds_back_the_longest_end_that_begins_a_stop_string():
    """``stop_prefix`` (which skips lengths whose last character cannot match) against the
    definition, on random texts and stop strings over a small alphabet (many partial matches)."""
    import random

    from kvshare.serve.http.streaming import stop_prefix

    def by_definition(text, stops):
        return max([k for s in stops for k in range(1, min(len(s) - 1, len(text)) + 1)
                    if text.endswith(s[:k])], default=0)

    rng = random.Random(0)
    for _ in range(2000):
        text = "".join(rng.choice("ab c") for _ in range(rng.randrange(0, 12)))
        stops = ["".join(rng.choice("ab c") for _ in range(rng.randrange(1, 9))) for _ in range(rng.randrange(1, 4))]
        assert stop_prefix(text, stops) == by_definition(text, stops), (text, stops)


def test_unexpected_failures_are_openai_errors_not_tracebacks(cli, base, monkeypatch):
    """An error the server did not foresee is a 500 in OpenAI's error shape (its traceback in
    the server's log), and an engine error while rendering a chat (an adapter unloaded since
    the request named it) a 400; the server goes on serving."""
    import uvicorn
    from fastapi.testclient import TestClient

    from kvshare.errors import KvshareError

    apps = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: apps.append(app))
    assert cli("serve", base, "--kv-cache-tokens", "512").code == 0
    engine = apps[0].state.engine_thread.engine
    body = {"model": str(base), "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    with TestClient(apps[0], raise_server_exceptions=False) as local:
        for error, status, kind in ((RuntimeError("a bug"), 500, "server_error"),
                                    (TypeError("a bug of ours, not the template's"), 500, "server_error"),
                                    (KvshareError("unknown adapter 'gone'"), 400, "invalid_request_error")):
            def failing(*args, error=error, **kwargs):
                raise error
            monkeypatch.setattr(engine, "chat_prompt", failing)
            r = local.post("/v1/chat/completions", json=body)
            assert r.status_code == status and r.json()["error"]["type"] == kind, r.text
        monkeypatch.undo()
        assert local.post("/v1/completions", json={"model": str(base), "prompt": [5, 6], "max_tokens": 2}).status_code == 200


def test_logprob_responses_are_built_off_the_event_loop(cli, base, monkeypatch):
    """echo + logprobs decode every prompt and output token and each alternative (an lm-eval
    batch: hundreds of thousands): on the tokenizer thread, once per distinct id, never on
    the event loop that serves every other request."""
    import asyncio

    import uvicorn
    from fastapi.testclient import TestClient

    apps = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: apps.append(app))
    assert cli("serve", base, "--kv-cache-tokens", "512").code == 0
    tokenizer = apps[0].state.engine_thread.engine.tokenizer
    on_loop, original = [], tokenizer.batch_decode

    def recording(ids, *args, **kwargs):
        try:
            asyncio.get_running_loop()
            on_loop.append(True)
        except RuntimeError:
            on_loop.append(False)
        assert len({tuple(i) for i in ids}) == len(ids)  # each distinct id once
        return original(ids, *args, **kwargs)

    monkeypatch.setattr(tokenizer, "batch_decode", recording)
    with TestClient(apps[0]) as local:
        r = local.post("/v1/completions", json={"model": str(base), "prompt": [5, 6, 7, 5], "max_tokens": 3,
                                                "logprobs": 2, "echo": True, "temperature": 0})
        assert r.status_code == 200, r.text
        assert len(r.json()["choices"][0]["logprobs"]["tokens"]) == 4 + 3
        assert r.json()["choices"][0]["logprobs"]["tokens"][:4] == [tokenizer.decode([t]) for t in (5, 6, 7, 5)]
        r = local.post("/v1/chat/completions", json={"model": str(base), "messages": [{"role": "user", "content": "hi"}],
                                                     "max_tokens": 3, "logprobs": True, "top_logprobs": 2,
                                                     "ignore_eos": True})  # sampled: an early EOS would end it
        assert r.status_code == 200 and len(r.json()["choices"][0]["logprobs"]["content"]) == 3, r.text
        r = local.post("/v1/completions", json={"model": str(base), "prompt": [5, 6, 7], "max_tokens": 3,
                                                "logprobs": 1, "stream": True, "ignore_eos": True})
        assert r.status_code == 200 and '"token_logprobs"' in r.text  # streamed: the chunks' texts too
    assert on_loop and not any(on_loop)


def test_echo_with_max_tokens_0_scores_the_prompt_alone(server, tokenizer):
    """OpenAI/HELM's prompt scoring (vLLM's echo without generation): the reply is the prompt,
    every token but the first scored, nothing generated or counted as completion."""
    http = httpx.Client(base_url=server["url"], headers=AUTH, timeout=60)
    body = {"model": "tiny-base", "prompt": [5, 6, 7], "max_tokens": 0, "echo": True, "logprobs": 1}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"] == tokenizer.decode([5, 6, 7]) and choice["finish_reason"] == "length"
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == 3 and lp["token_logprobs"][0] is None and all(
        isinstance(v, float) for v in lp["token_logprobs"][1:])
    assert r.json()["usage"]["completion_tokens"] == 0 and r.json()["usage"]["prompt_tokens"] == 3
    scored = http.post("/v1/completions", json={**body, "max_tokens": 1}).json()["choices"][0]["logprobs"]
    assert lp["token_logprobs"][1:] == pytest.approx(scored["token_logprobs"][1:3], abs=1e-6)
    for wrong, param in (({"echo": False}, "max_tokens"), ({"stream": True, "logprobs": None}, "max_tokens")):
        r = http.post("/v1/completions", json={**body, **wrong})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_logprob_fields_are_openais(server):
    """Completions: each position's alternatives hold the chosen token ("up to logprobs + 1";
    with logprobs 0, the chosen token alone), and text_offset says where each token's text
    starts. Chat: every token and alternative has its UTF-8 bytes."""
    http = httpx.Client(base_url=server["url"], headers=AUTH, timeout=60)
    for body in ({"logprobs": 0, "temperature": 0}, {"logprobs": 1, "temperature": 1.5, "seed": 3}):
        r = http.post("/v1/completions", json={"model": "tiny-base", "prompt": [5, 6, 7], "max_tokens": 8,
                                               "echo": True, **body})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        lp = choice["logprobs"]
        for token, logprob, top in zip(lp["tokens"][1:], lp["token_logprobs"][1:], lp["top_logprobs"][1:]):
            # keyed by text: a token that decodes like a likelier one (a partial UTF-8 byte) shows its logprob
            assert top[token] >= logprob - 1e-6 and len(top) <= body["logprobs"] + 1
        assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(lp["tokens"]))]
        assert choice["text"].startswith(lp["tokens"][0])
    r = http.post("/v1/chat/completions", json={"model": "tiny-base", "messages": [{"role": "user", "content": "hi"}],
                                                "max_tokens": 3, "logprobs": True, "top_logprobs": 2})
    for entry in r.json()["choices"][0]["logprobs"]["content"]:
        assert entry["bytes"] == list(entry["token"].encode("utf-8", "replace"))
        assert all(t["bytes"] == list(t["token"].encode("utf-8", "replace")) for t in entry["top_logprobs"])


def test_vllms_own_fields_at_their_defaults_are_accepted_and_other_values_named(server):
    """A client written for vLLM sends its fields at their defaults (vLLM's clients and
    benchmarks do); only values we do not implement are refused, by name."""
    at_defaults = {"skip_special_tokens": True, "spaces_between_special_tokens": True, "min_tokens": 0, "priority": 0,
                   "use_beam_search": False, "length_penalty": 1.0, "return_tokens_as_token_ids": False,
                   "allowed_token_ids": None, "bad_words": [], "include_stop_str_in_output": False}
    chat_defaults = {"add_generation_prompt": True, "continue_final_message": False, "tools": [],
                     "tool_choice": "none", "parallel_tool_calls": True, "response_format": {"type": "text"},
                     "echo": False, "chat_template_kwargs": {}, "top_logprobs": 0}
    messages = [{"role": "user", "content": "a"}]
    r = _post(server, "/v1/completions", {"model": "tiny-base", "prompt": "a", "max_tokens": 2, **at_defaults})
    assert r.status_code == 200, r.text
    r = _post(server, "/v1/chat/completions", {"model": "tiny-base", "messages": messages, "max_tokens": 2,
                                               **at_defaults, **chat_defaults})
    assert r.status_code == 200, r.text
    for path, extra, param in (("/v1/completions", {"priority": 3}, "priority"),
                               ("/v1/completions", {"bad_words": ["x"]}, "bad_words"),
                               ("/v1/completions", {"best_of": 1, "n": 2}, "best_of"),  # below n: vLLM's 400 too
                               ("/v1/chat/completions", {"tools": [{"type": "function"}]}, "tools"),
                               ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, "response_format"),
                               ("/v1/chat/completions", {"continue_final_message": True}, "continue_final_message"),
                               ("/v1/chat/completions", {"chat_template_kwargs": {"tokenize": False}},
                                "chat_template_kwargs")):
        body = {"model": "tiny-base", "max_tokens": 2, **extra}
        body.update({"prompt": "a"} if path == "/v1/completions" else {"messages": messages})
        r = _post(server, path, body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_min_tokens_and_allowed_token_ids_as_vllm(server, base):
    """vLLM's min_tokens (no stop before them) and allowed_token_ids (sample only among them)
    reach the sampler; min_tokens above max_tokens and ids past the vocabulary are 400s."""
    tokenizer = server["engine"].tokenizer
    prompt = tokenizer.encode("a", add_special_tokens=False)
    base_request = {"model": "tiny-base", "prompt": prompt, "max_tokens": 6, "temperature": 0}
    first = LLM(base, kv_cache_tokens=256, block_size=8).generate([prompt], SamplingParams(max_tokens=1))[0].token_ids[0]
    r = _post(server, "/v1/completions", {**base_request, "stop_token_ids": [first]})
    assert r.json()["usage"]["completion_tokens"] == 1 and r.json()["choices"][0]["finish_reason"] == "stop"
    assert r.json()["choices"][0]["stop_reason"] == first  # vLLM's field: the stop token id
    events = _events(server, "/v1/completions", {**base_request, "stop_token_ids": [first]})
    assert [c["stop_reason"] for e in events for c in e["choices"]][-1] == first
    r = _post(server, "/v1/chat/completions", {"model": "tiny-base", "messages": [{"role": "user", "content": "a"}],
                                               "max_tokens": 3, "ignore_eos": True})
    assert r.json()["choices"][0]["finish_reason"] == "length" and r.json()["choices"][0]["stop_reason"] is None
    r = _post(server, "/v1/completions", {**base_request, "stop_token_ids": [first], "min_tokens": 4, "ignore_eos": True})
    assert r.json()["usage"]["completion_tokens"] >= 4, r.text
    word = tokenizer.encode(" the", add_special_tokens=False)[0]
    r = _post(server, "/v1/chat/completions", {"model": "tiny-base", "messages": [{"role": "user", "content": "a"}],
                                               "max_tokens": 4, "allowed_token_ids": [word], "ignore_eos": True})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == tokenizer.decode([word] * 4), r.text
    for extra, words in (({"min_tokens": 7}, "min_tokens"), ({"allowed_token_ids": [10 ** 9]}, "allowed_token_ids"),
                         ({"allowed_token_ids": []}, "allowed_token_ids")):
        r = _post(server, "/v1/completions", {**base_request, **extra})
        assert r.status_code == 400 and words in r.json()["error"]["message"], r.text


def test_a_request_without_model_runs_on_the_first_base(server):
    """vLLM 0.8+: ``model`` may be left out; the reply names the base it ran on."""
    for path, body in (("/v1/completions", {"prompt": [5, 6, 7]}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}]})):
        r = _post(server, path, {"max_tokens": 3, "temperature": 0, **body})
        named = _post(server, path, {"model": "tiny-base", "max_tokens": 3, "temperature": 0, **body})
        assert r.status_code == 200 and r.json()["model"] == "tiny-base", r.text
        assert r.json()["choices"] == named.json()["choices"]


def test_echo_returns_the_clients_own_prompt_text(base, monkeypatch):
    """vLLM echoes a text prompt as sent, not its token ids decoded again (which a tokenizer
    may normalise, or prefix with a BOS); token-id prompts are decoded."""
    from fastapi.testclient import TestClient

    engine = LLMEngine(base, kv_cache_tokens=256, block_size=8)
    monkeypatch.setattr(engine.tokenizer, "decode", lambda ids, **kw: "<decoded>")
    with TestClient(create_app(engine, served_model_name="tiny-base")) as client:
        body = {"model": "tiny-base", "max_tokens": 1, "echo": True}
        text = client.post("/v1/completions", json={**body, "prompt": "Rome  is"}).json()["choices"][0]["text"]
        ids = client.post("/v1/completions", json={**body, "prompt": [5, 6]}).json()["choices"][0]["text"]
    assert text.startswith("Rome  is") and ids.startswith("<decoded>")


def test_stop_strings_and_stop_tokens_leave_the_text_unless_asked_to_stay(server, base, tokenizer):
    """vLLM's rule: a stop string is cut, and so is a stop token's own text (it stayed before);
    ``include_stop_str_in_output`` keeps either."""
    prompt = tokenizer.encode("Paris is the capital of", add_special_tokens=False)
    greedy = SamplingParams(max_tokens=6, ignore_eos=True)
    ids = LLM(base, kv_cache_tokens=256, block_size=8).generate([prompt], greedy)[0].token_ids
    first = ids.index(ids[2])  # where the stop token first comes
    body = {"model": "tiny-base", "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    cut = _post(server, "/v1/completions", {**body, "stop_token_ids": [ids[2]]}).json()["choices"][0]
    kept = _post(server, "/v1/completions", {**body, "stop_token_ids": [ids[2]],
                                             "include_stop_str_in_output": True}).json()["choices"][0]
    # (a character the tokens before it left unfinished goes with it: the text stops where it was whole)
    assert (cut["text"], cut["finish_reason"]) == (tokenizer.decode(ids[:first]).rstrip("\ufffd"), "stop")
    assert (kept["text"], kept["finish_reason"]) == (tokenizer.decode(ids[:first + 1]), "stop")
    text = _post(server, "/v1/completions", body).json()["choices"][0]["text"]
    assert text == tokenizer.decode(ids)
    stop = next(text[k:k + 2] for k in range(1, len(text) - 1) if text[k:k + 2].strip())
    cut = _post(server, "/v1/completions", {**body, "stop": [stop]}).json()["choices"][0]["text"]
    kept = _post(server, "/v1/completions", {**body, "stop": [stop], "include_stop_str_in_output": True})
    assert cut == text[:text.find(stop)]
    assert kept.json()["choices"][0]["text"] == text[:text.find(stop) + len(stop)]
    assert kept.json()["choices"][0]["stop_reason"] == stop  # vLLM's field: the stop string that matched


def test_truncate_prompt_tokens_and_request_id_as_vllm(server):
    body = {"model": "tiny-base", "prompt": list(range(5, 25)), "max_tokens": 2, "temperature": 0,
            "truncate_prompt_tokens": 4, "request_id": "abc"}
    r = _post(server, "/v1/completions", body).json()
    assert r["usage"]["prompt_tokens"] == 4 and r["id"] == "cmpl-abc"
    last4 = _post(server, "/v1/completions", {**body, "prompt": list(range(21, 25)), "truncate_prompt_tokens": None})
    assert r["choices"][0]["text"] == last4.json()["choices"][0]["text"]


def test_chat_template_fields_reach_the_template(server, monkeypatch):
    """add_generation_prompt false leaves out the assistant header; continue_final_message
    leaves the last message open; chat_template_kwargs are the template's variables."""
    from kvshare.testing import CHATML_TEMPLATE

    monkeypatch.setattr(server["engine"].tokenizer, "chat_template", "{{ greeting | default('') }}" + CHATML_TEMPLATE)
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    usage = {}
    for name, extra in (("default", {}), ("no header", {"add_generation_prompt": False}),
                        ("open", {"add_generation_prompt": False, "continue_final_message": True}),
                        ("greeted", {"chat_template_kwargs": {"greeting": "hello there, "}})):
        r = _post(server, "/v1/chat/completions", {"model": "tiny-base", "messages": messages, "max_tokens": 1,
                                                   **extra})
        assert r.status_code == 200, r.text
        usage[name] = r.json()["usage"]["prompt_tokens"]
    assert usage["greeted"] > usage["default"] > usage["no header"] > usage["open"]


def test_a_template_that_trips_on_a_field_is_400(server, monkeypatch):
    """A template reading what a message lacks can raise TypeError (a 500 before); vLLM: 400.
    (A TypeError of our own code stays a 500: see the test of unexpected failures.)"""
    from kvshare.testing import CHATML_TEMPLATE

    trips = "{% for m in messages %}{% if m.tool_calls %}{{ m.tool_calls[0].function.arguments | join }}" \
            "{% endif %}{% endfor %}" + CHATML_TEMPLATE
    monkeypatch.setattr(server["engine"].tokenizer, "chat_template", trips)
    r = _post(server, "/v1/chat/completions", {"model": "tiny-base", "max_tokens": 1, "messages": [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": 3}}]}]})
    assert r.status_code == 400 and "TypeError" in r.json()["error"]["message"], r.text


def test_sampling_left_out_comes_from_the_models_generation_config(base, tmp_path):
    """vLLM 0.8+ (``--generation-config auto``): what a request leaves out comes from the
    model's generation_config.json; ``vllm`` leaves it off. transformers' defaults and bad
    values in the file are no setting."""
    from fastapi.testclient import TestClient

    from kvshare.models import sampling_defaults

    model = tmp_path / "model"
    shutil.copytree(base, model)
    config = json.loads((model / "generation_config.json").read_text())
    config.update({"temperature": 0.0, "top_k": 50, "top_p": 0, "repetition_penalty": "high"})
    (model / "generation_config.json").write_text(json.dumps(config))
    assert sampling_defaults(model) == {"temperature": 0.0}
    engine = LLMEngine(str(model), kv_cache_tokens=512, block_size=8)
    body = {"model": "m", "prompt": [5, 6, 7, 8], "max_tokens": 8, "ignore_eos": True, "seed": 3}
    replies = {}
    for mode in ("auto", "vllm"):
        with TestClient(create_app(engine, served_model_name="m", generation_config=mode)) as client:
            for name, extra in (("left out", {}), ("greedy", {"temperature": 0}), ("hot", {"temperature": 1.0})):
                r = client.post("/v1/completions", json={**body, **extra})
                assert r.status_code == 200, r.text
                replies[mode, name] = r.json()["choices"][0]["text"]
    assert replies["auto", "left out"] == replies["auto", "greedy"]
    assert replies["vllm", "left out"] == replies["vllm", "hot"] != replies["vllm", "greedy"]
