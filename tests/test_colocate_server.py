"""Several base models in one `kvshare serve` process (kvshare.serve.driver.colocation): routing by
`model`, the model list, per-model /metrics, isolation between the models, one driver thread
that never runs two steps at once, and the `--colocate` command line."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest
import uvicorn
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from kvshare.errors import KvshareError
from kvshare.random_adapters import random_adapter
from kvshare.serve import LLM, LLMEngine, SamplingParams
from kvshare.serve.driver.colocation import Colocation
from kvshare.serve.http.server import create_app

from conftest import assert_one_line_error

BS = 8
PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]


@pytest.fixture(scope="module")
def bases(tiny_models) -> dict[str, object]:
    return {"alpha": tiny_models("llama"), "beta": tiny_models("qwen2")}


@pytest.fixture(scope="module")
def adapter_dirs(bases, tmp_path_factory) -> dict[str, object]:
    root = tmp_path_factory.mktemp("colocate-adapters")
    return {"lora-a": random_adapter("lora", bases["alpha"], root, "lora-a", seed=1),
            "icarus-b": random_adapter("icarus", bases["beta"], root, "icarus-b", seed=2),
            "other-b": random_adapter("lora", bases["beta"], root / "other", "other-b", seed=3),
            "lora-a-on-beta": random_adapter("lora", bases["beta"], root / "clash", "lora-a", seed=4)}


SETTINGS = {"alpha": dict(kv_cache_tokens=1024, block_size=BS, max_model_len=128),
            "beta": dict(kv_cache_tokens=2048, block_size=BS, max_model_len=256)}
ADAPTER_OF = {"alpha": "lora-a", "beta": "icarus-b"}


def engines_for(bases, adapter_dirs) -> dict[str, LLMEngine]:
    return {name: LLMEngine(bases[name], [adapter_dirs[ADAPTER_OF[name]]], **SETTINGS[name]) for name in bases}


@pytest.fixture(scope="module")
def served(bases, adapter_dirs):
    engines = engines_for(bases, adapter_dirs)
    with TestClient(create_app(Colocation(engines), enable_lora_loading=True)) as client:
        yield client, engines


def alone(base, adapter_dir, adapter: str | None, prompt: list[int], max_tokens: int, settings: dict):
    """What the engine gives for ``prompt`` when it is the only model (greedy, logprobs)."""
    llm = LLM(base, [adapter_dir], **settings)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    return llm.generate([prompt], params, adapter=adapter)[0]


def post_all(app, bodies: list[dict], path: str = "/v1/completions") -> list[httpx.Response]:
    """POST every body at once (their steps interleave on the one driver thread)."""
    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://colocated", timeout=60) as client:
            return await asyncio.gather(*(client.post(path, json=body) for body in bodies))
    return asyncio.run(main())


def scrape(client) -> dict:
    """family name -> {(sample name, sorted labels): value}."""
    text = client.get("/metrics").text
    return {f.name: {(s.name, tuple(sorted(s.labels.items()))): s.value for s in f.samples}
            for f in text_string_to_metric_families(text)}


def test_completions_route_by_model_and_equal_each_engine_alone(served, bases, adapter_dirs):
    client, _ = served
    models = [("alpha", "alpha", None), ("lora-a", "alpha", "lora-a"), ("beta", "beta", None),
              ("icarus-b", "beta", "icarus-b")]
    bodies = [{"model": model, "prompt": PROMPT, "max_tokens": 10, "temperature": 0, "ignore_eos": True,
               "logprobs": 0} for model, _, _ in models]
    replies = post_all(client.app, bodies)
    texts = set()
    for (model, base, adapter), reply in zip(models, replies):
        assert reply.status_code == 200, reply.text
        choice = reply.json()["choices"][0]
        want = alone(bases[base], adapter_dirs[ADAPTER_OF[base]], adapter, PROMPT, 10, SETTINGS[base])
        assert choice["text"] == want.text, model
        assert choice["logprobs"]["token_logprobs"] == pytest.approx([e["logprob"] for e in want.logprobs],
                                                                     abs=1e-5), model
        texts.add(choice["text"])
    assert len(texts) == 4  # four different models answered


def test_models_lists_every_base_and_its_adapters(served, bases, adapter_dirs):
    client, _ = served
    cards = {c["id"]: c for c in client.get("/v1/models").json()["data"]}
    assert set(cards) == {"alpha", "lora-a", "beta", "icarus-b"}
    for base in ("alpha", "beta"):
        assert cards[base]["parent"] is None and cards[base]["root"] == str(bases[base])
        assert cards[base]["max_model_len"] == SETTINGS[base]["max_model_len"]
        adapter = ADAPTER_OF[base]
        assert cards[adapter]["parent"] == base and cards[adapter]["root"] == str(adapter_dirs[adapter])


def test_metrics_show_each_models_blocks_and_engine_values(served):
    client, engines = served
    before = scrape(client)
    assert client.post("/v1/completions", json={"model": "icarus-b", "prompt": PROMPT, "max_tokens": 3}
                       ).status_code == 200
    after = scrape(client)
    for name, engine in engines.items():
        model = (("model_name", name),)
        owned = engine.kv_usage()["kv"]["blocks_total"]
        assert owned == SETTINGS[name]["kv_cache_tokens"] // BS
        assert after["kvshare:kv_blocks_owned"][("kvshare:kv_blocks_owned", model)] == owned
        assert after["kvshare:kv_blocks_lent"][("kvshare:kv_blocks_lent", model)] == 0
        assert after["kvshare:kv_blocks_borrowed"][("kvshare:kv_blocks_borrowed", model)] == 0
        stats = engine.stats()
        assert after["kvshare_generated_tokens"][("kvshare_generated_tokens_total", model)] == \
            stats["generated_tokens"]
        assert after["kvshare_blocks_total"][("kvshare_blocks_total", model)] == owned
        labels = (("engine", "0"), ("model_name", name))
        assert after["vllm:prompt_tokens"][("vllm:prompt_tokens_total", labels)] == stats["prompt_tokens"]
    count = "vllm:e2e_request_latency_seconds_count"
    grew = {name: after["vllm:e2e_request_latency_seconds"][(count, (("engine", "0"), ("model_name", name)))]
            - before["vllm:e2e_request_latency_seconds"][(count, (("engine", "0"), ("model_name", name)))]
            for name in engines}
    assert grew == {"alpha": 0, "beta": 1}  # the request is observed under its base's name


def test_an_unknown_model_is_a_404_in_openais_shape(served):
    client, _ = served
    for path, body in (("/v1/completions", {"prompt": "hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        r = client.post(path, json={"model": "gamma", "max_tokens": 2, **body})
        assert r.status_code == 404, r.text
        assert r.json()["error"] == {"message": "model 'gamma' does not exist", "type": "not_found_error",
                                     "param": "model", "code": 404}


def test_a_bad_request_for_one_model_leaves_the_other_models_request_unharmed(served, bases, adapter_dirs,
                                                                              monkeypatch):
    """Requests refused by beta's limits, beta's engine or a fault in beta's step (which fails
    beta's requests only) do not change what alpha's request in flight gives."""
    client, engines = served
    beta = engines["beta"]
    real_step, calls = beta.step, []

    def faulty_step():  # two good steps, then every step fails
        calls.append(1)
        if len(calls) > 2:
            raise RuntimeError("simulated fault in beta's engine")
        return real_step()

    good = {"model": "lora-a", "prompt": PROMPT, "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    too_long_for_alpha = {"model": "alpha", "prompt": PROMPT, "max_tokens": 150}  # fits beta's 256 only
    bad = [{"model": "beta", "prompt": PROMPT, "max_tokens": 300},  # over beta's max_model_len
           {"model": "icarus-b", "prompt": [5, 10 ** 9], "max_tokens": 2},  # outside the vocabulary
           {"model": "beta", "prompt": PROMPT, "max_tokens": 2, "top_k": 10 ** 6},
           too_long_for_alpha]
    replies = post_all(client.app, [good, *bad, {**too_long_for_alpha, "model": "beta"}])
    assert [r.status_code for r in replies] == [200, 400, 400, 400, 400, 200], [r.text for r in replies]
    want = alone(bases["alpha"], adapter_dirs["lora-a"], "lora-a", PROMPT, 40, SETTINGS["alpha"])
    assert replies[0].json()["choices"][0]["text"] == want.text
    # a fault in beta's steps: beta's request fails (500), alpha's goes on unchanged
    monkeypatch.setattr(beta, "step", faulty_step)
    replies = post_all(client.app, [good, {"model": "icarus-b", "prompt": PROMPT, "max_tokens": 30,
                                           "ignore_eos": True}])
    assert replies[0].status_code == 200 and replies[0].json()["choices"][0]["text"] == want.text
    assert replies[1].status_code == 500 and replies[1].json()["error"]["type"] == "server_error"
    assert len(calls) > 2  # beta's request failed in flight, after its first steps
    monkeypatch.undo()
    assert not beta.has_unfinished() and beta.stats()["blocks_in_use"] == 0
    assert client.post("/v1/completions", json={"model": "beta", "prompt": PROMPT, "max_tokens": 2}
                       ).status_code == 200


def test_load_lora_adapter_goes_to_the_named_base_and_names_stay_unique(served, adapter_dirs):
    """``base_model_name`` picks the base (default: the first); an adapter name another
    co-located model serves is refused; unload finds the adapter on its base."""
    client, engines = served
    load = {"lora_name": "hot-b", "lora_path": str(adapter_dirs["other-b"])}
    r = client.post("/v1/load_lora_adapter", json=load)  # onto alpha, the first: the fingerprint refuses it
    assert r.status_code == 400 and "would not match" in r.json()["error"]["message"], r.text
    r = client.post("/v1/load_lora_adapter", json={**load, "base_model_name": "gamma"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "base_model_name", r.text
    r = client.post("/v1/load_lora_adapter", json={**load, "lora_name": "lora-a", "base_model_name": "beta"})
    assert r.status_code == 400 and "unique across co-located" in r.json()["error"]["message"], r.text
    r = client.post("/v1/load_lora_adapter", json={**load, "lora_name": "alpha", "base_model_name": "beta"})
    assert r.status_code == 400 and "base model's name" in r.json()["error"]["message"], r.text
    r = client.post("/v1/load_lora_adapter", json={**load, "base_model_name": "beta"})
    assert r.status_code == 200, r.text
    try:
        cards = {c["id"]: c for c in client.get("/v1/models").json()["data"]}
        assert cards["hot-b"]["parent"] == "beta"
        assert [a.name for a in engines["beta"].adapters()] == ["icarus-b", "hot-b"]
        r = client.post("/v1/completions", json={"model": "hot-b", "prompt": PROMPT, "max_tokens": 2})
        assert r.status_code == 200, r.text
    finally:
        r = client.post("/v1/unload_lora_adapter", json={"lora_name": "hot-b"})
    assert r.status_code == 200 and "hot-b" not in {a.name for a in engines["beta"].adapters()}
    assert client.post("/v1/unload_lora_adapter", json={"lora_name": "beta"}).status_code == 404


class RecordingLending:
    """A lending policy that moves nothing and reports fixed figures, recording when the driver
    calls it; each engine's step records overlaps, so the test sees the driver's discipline."""

    def __init__(self, engines: dict[str, LLMEngine]):
        self.engines, self.lock = engines, threading.Lock()
        self.active, self.overlaps, self.rebalances, self.during_step = 0, 0, 0, 0
        for engine in engines.values():
            engine.step = self._recorded(engine.step)

    def _recorded(self, step):
        def run():
            with self.lock:
                self.active += 1
                self.overlaps += self.active > 1
            try:
                return step()
            finally:
                with self.lock:
                    self.active -= 1
        return run

    def rebalance(self) -> None:
        with self.lock:
            self.rebalances += 1
            self.during_step += self.active > 0

    def stats(self) -> dict[str, dict[str, int]]:
        return {name: {"owned_blocks": 100 + i, "lent_blocks": 10 * i, "borrowed_blocks": 7 - i, "block_size": BS}
                for i, name in enumerate(self.engines)}


def test_one_driver_thread_never_steps_two_engines_at_once_and_rebalances_between_steps(bases, adapter_dirs):
    engines = engines_for(bases, adapter_dirs)
    lending = RecordingLending(engines)
    with TestClient(create_app(Colocation(engines, lending))) as client:
        bodies = [{"model": model, "prompt": PROMPT, "max_tokens": 12, "ignore_eos": True}
                  for model in ("alpha", "beta", "lora-a", "icarus-b") * 2]
        assert [r.status_code for r in post_all(client.app, bodies)] == [200] * 8
        metrics = scrape(client)
    assert lending.overlaps == 0 and lending.during_step == 0
    assert lending.rebalances >= 12  # once per driver step, before the engines step
    for i, name in enumerate(engines):
        model = (("model_name", name),)
        assert metrics["kvshare:kv_blocks_owned"][("kvshare:kv_blocks_owned", model)] == 100 + i
        assert metrics["kvshare:kv_blocks_lent"][("kvshare:kv_blocks_lent", model)] == 10 * i
        assert metrics["kvshare:kv_blocks_borrowed"][("kvshare:kv_blocks_borrowed", model)] == 7 - i


def test_adapter_names_must_be_unique_across_colocated_models(bases, adapter_dirs):
    alpha = LLMEngine(bases["alpha"], [adapter_dirs["lora-a"]], kv_cache_tokens=256, block_size=BS)
    beta = LLMEngine(bases["beta"], [adapter_dirs["lora-a-on-beta"]], kv_cache_tokens=256, block_size=BS)
    with pytest.raises(KvshareError, match="unique across co-located"):
        Colocation({"alpha": alpha, "beta": beta})
    with pytest.raises(KvshareError, match="served base model's name"):
        Colocation({"alpha": alpha, "lora-a": LLMEngine(bases["beta"], kv_cache_tokens=256, block_size=BS)})


# the command line ----------------------------------------------------------------------------------

def test_serve_colocate_builds_each_model_with_its_own_pool(cli, bases, adapter_dirs, monkeypatch):
    apps = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: apps.append(app))
    spec = {"model": str(bases["beta"]), "served_model_name": "beta", "adapters": [str(adapter_dirs["icarus-b"])],
            "kv_cache_tokens": 1024}
    result = cli("serve", bases["alpha"], "--served-model-name", "alpha", "--adapter", adapter_dirs["lora-a"],
                 "--kv-cache-tokens", "512", "--block-size", "16", "--colocate", json.dumps(spec))
    assert result.code == 0, result.err
    with TestClient(apps[0]) as client:
        cards = {c["id"]: c for c in client.get("/v1/models").json()["data"]}
        assert {k: c["parent"] for k, c in cards.items()} == {"alpha": None, "lora-a": "alpha", "beta": None,
                                                             "icarus-b": "beta"}
        metrics = scrape(client)
        owned = {dict(labels)["model_name"]: v for (_, labels), v in metrics["kvshare:kv_blocks_owned"].items()}
        assert owned == {"alpha": 512 // 16, "beta": 1024 // 16}  # the spec's kv_cache_tokens, shared block size
        r = client.post("/v1/completions", json={"model": "icarus-b", "prompt": PROMPT, "max_tokens": 2})
        assert r.status_code == 200 and r.json()["model"] == "icarus-b"


def test_serve_colocate_mistakes_are_one_line_errors(cli, bases, adapter_dirs, monkeypatch):
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: pytest.fail("no server may start"))
    base, other = str(bases["alpha"]), str(bases["beta"])
    for spec, fragment in (("{not json", "invalid JSON"), ('["a"]', "must be a JSON object"),
                           ('{"served_model_name": "x"}', "string 'model'"),
                           (json.dumps({"model": other, "gpus": 2}), "unknown: gpus"),
                           (json.dumps({"model": other, "adapters": "dir"}), "'adapters'"),
                           (json.dumps({"model": other, "kv_cache_tokens": 0}), "'kv_cache_tokens'"),
                           (json.dumps({"model": base}), f"{base!r} is used twice")):
        assert_one_line_error(cli("serve", base, "--colocate", spec), fragment)
    twice = json.dumps({"model": other, "served_model_name": "b"})
    assert_one_line_error(cli("serve", base, "--colocate", twice, "--colocate", twice), "'b' is used twice")
    assert_one_line_error(cli("serve", base, "--colocate", twice, "--ray"), "do not work with --ray")
    assert_one_line_error(cli("serve", base, "--lending"), "--lending needs --colocate")
    assert_one_line_error(cli("serve", base, "--served-model-name", "a", "b", "--colocate", twice), "one name")
    clash = json.dumps({"model": other, "adapters": [str(adapter_dirs["lora-a-on-beta"])]})
    assert_one_line_error(cli("serve", base, "--adapter", adapter_dirs["lora-a"], "--kv-cache-tokens", "256",
                              "--colocate", clash), "'lora-a'", "unique across co-located")


def test_serve_colocate_with_lending_serves_beyond_a_models_own_pool(cli, bases, monkeypatch):
    """`--lending`: a request longer than its model's own KV memory runs on blocks the other
    model lends, gives what a private pool gives, and /metrics shows the loan."""
    apps = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: apps.append(app))
    spec = {"model": str(bases["alpha"]), "served_model_name": "roomy", "kv_cache_tokens": 1024}
    result = cli("serve", bases["alpha"], "--served-model-name", "tight", "--kv-cache-tokens", "64",
                 "--block-size", "16", "--colocate", json.dumps(spec), "--lending")
    assert result.code == 0, result.err
    prompt = list(range(5, 105))  # 100 tokens: more than tight's own 64
    want = LLM(bases["alpha"], kv_cache_tokens=1024, block_size=16).generate(
        [prompt], SamplingParams(max_tokens=4, ignore_eos=True))[0].text
    with TestClient(apps[0]) as client:
        r = client.post("/v1/completions", json={"model": "tight", "prompt": prompt, "max_tokens": 4,
                                                 "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want
        metrics = scrape(client)
    tight, roomy = (("model_name", "tight"),), (("model_name", "roomy"),)
    assert metrics["kvshare:kv_blocks_borrowed"][("kvshare:kv_blocks_borrowed", tight)] > 0
    assert metrics["kvshare:kv_blocks_lent"][("kvshare:kv_blocks_lent", roomy)] > 0


def test_a_failing_rebalance_fails_no_request(bases, adapter_dirs):
    """Lending's rebalance ran outside the per-engine guard: one failure aborted every model's
    requests. Now the round moves nothing and the engines step with what they hold."""
    engines = engines_for(bases, adapter_dirs)
    lending = RecordingLending(engines)

    def broken() -> None:
        lending.rebalances += 1
        raise RuntimeError("simulated lending bug")

    lending.rebalance = broken
    with TestClient(create_app(Colocation(engines, lending))) as client:
        bodies = [{"model": model, "prompt": PROMPT, "max_tokens": 4, "ignore_eos": True} for model in ("alpha", "beta")]
        assert [r.status_code for r in post_all(client.app, bodies)] == [200, 200]
    assert lending.rebalances > 0


def test_the_in_process_workflow_backend_refuses_co_located_models(bases, adapter_dirs):
    """It named no model, and read a tokenizer a Colocation has not: an AttributeError before."""
    from kvshare.serve.driver.engine_thread import AsyncEngine
    from kvshare.serve.workflow import EngineBackend

    runner = AsyncEngine(Colocation(engines_for(bases, adapter_dirs), None))
    try:
        with pytest.raises(KvshareError, match="EngineBackend calls one engine"):
            EngineBackend(runner)
    finally:
        runner.shutdown()


def test_each_colocated_model_has_its_own_queue_budget(bases, adapter_dirs):
    """max_waiting bounds each model's queue: requests waiting for (or queued to) one model do not
    refuse another's, as with a server per model."""
    from kvshare.serve.driver.engine_thread import AsyncEngine

    engines = engines_for(bases, adapter_dirs)
    runner = AsyncEngine(Colocation(engines, None), max_waiting=2)
    runner.shutdown()  # the state below stays as set: nothing steps
    alpha, beta = engines
    for _ in range(2):
        engines[alpha].add_request([5, 6, 7], SamplingParams(max_tokens=2))
    assert not runner.has_room(model=alpha) and runner.has_room(2, model=beta) and not runner.has_room(3, model=beta)
    runner._queued[beta] += 1  # an add on its way to the engine thread counts for its model only
    assert runner.has_room(model=beta) and not runner.has_room(2, model=beta)
