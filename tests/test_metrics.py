"""/metrics after real requests: counters are counters, vLLM's names sit beside ours with its
types and the engine's values, and prefix-cache hits are told apart by the kind of KV reused."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from kvshare.serve import LLMEngine, SamplingParams
from kvshare.serve.http.metrics import ServerMetrics
from kvshare.kinds import find_invocation_start
from kvshare.serve.http.server import create_app

from test_engine import adapters, base, invocation, prompts_for, tokenizer  # noqa: F401

BS = 8
KINDS = ("shared_base", "alora_pre_invocation", "lora_private")


@pytest.fixture(scope="module")
def served(base, adapters):
    engine = LLMEngine(base, [adapters["lora-a"], adapters["alora-a"], adapters["icarus-a"]],
                       kv_cache_tokens=4096, block_size=BS, max_model_len=256)
    with TestClient(create_app(engine, served_model_name="tiny-base")) as client:
        yield client, engine


def scrape(client) -> dict:
    """name -> (type, {(sample name, sorted labels): value}) from the Prometheus text."""
    response = client.get("/metrics")
    assert response.status_code == 200
    return {family.name: (family.type, {(s.name, tuple(sorted(s.labels.items()))): s.value
                                        for s in family.samples})
            for family in text_string_to_metric_families(response.text)}


def value(metrics: dict, family: str, sample: str | None = None, **labels) -> float:
    return metrics[family][1][(sample or family, tuple(sorted(labels.items())))]


def complete(client, model: str, prompt: list[int], max_tokens: int = 4) -> dict:
    response = client.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                                    "temperature": 0})
    assert response.status_code == 200, response.text
    return response.json()


def hits_by_kind(client) -> dict[str, float]:
    metrics = scrape(client)
    assert metrics["kvshare_prefix_cache_hit_tokens"][0] == "counter"
    return {k: value(metrics, "kvshare_prefix_cache_hit_tokens", "kvshare_prefix_cache_hit_tokens_total",
                     kv_kind=k) for k in KINDS}


def delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before[k] for k in after}


def test_monotonic_values_are_counters_that_grow(served, tokenizer):
    client, engine = served
    before = scrape(client)
    out = complete(client, "tiny-base", prompts_for(tokenizer, 1)[0], max_tokens=5)
    after = scrape(client)
    for name in ("kvshare_requests", "kvshare_finished", "kvshare_aborted", "kvshare_failed",
                 "kvshare_prompt_tokens", "kvshare_generated_tokens", "kvshare_prefix_queried_tokens",
                 "kvshare_prefix_hit_tokens", "kvshare_evictions", "kvshare_preemptions", "kvshare_steps"):
        assert after[name][0] == "counter", name
    for name in ("kvshare_blocks_in_use", "kvshare_running", "kvshare_waiting", "kvshare_prefix_hit_rate"):
        assert after[name][0] == "gauge", name
    grew = {name: value(after, name, name + "_total") - value(before, name, name + "_total")
            for name in ("kvshare_requests", "kvshare_finished", "kvshare_prompt_tokens", "kvshare_generated_tokens")}
    assert grew == {"kvshare_requests": 1, "kvshare_finished": 1,
                    "kvshare_prompt_tokens": out["usage"]["prompt_tokens"],
                    "kvshare_generated_tokens": out["usage"]["completion_tokens"]}
    # the names the existing load test reads stay plain, unlabelled gauges
    assert value(after, "kvshare_blocks_in_use") == engine.stats()["blocks_in_use"] == 0


def test_vllm_names_have_vllms_types_and_the_engines_values(served, tokenizer):
    client, engine = served
    before = scrape(client)
    out = complete(client, "icarus-a", prompts_for(tokenizer, 2)[1], max_tokens=6)
    after, stats = scrape(client), engine.stats()
    labels = {"model_name": "tiny-base", "engine": "0"}
    types = {"vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge",
             "vllm:kv_cache_usage_perc": "gauge", "vllm:prefix_cache_queries": "counter",
             "vllm:prefix_cache_hits": "counter", "vllm:prompt_tokens": "counter",
             "vllm:generation_tokens": "counter", "vllm:num_preemptions": "counter",
             "vllm:request_success": "counter", "vllm:time_to_first_token_seconds": "histogram",
             "vllm:e2e_request_latency_seconds": "histogram", "vllm:time_per_output_token_seconds": "histogram",
             "vllm:request_queue_time_seconds": "histogram", "vllm:request_prompt_tokens": "histogram"}
    assert {name: after[name][0] for name in types} == types
    # idle engine: the counters equal its statistics exactly
    for name, key in (("vllm:prefix_cache_queries", "prefix_queried_tokens"), ("vllm:prefix_cache_hits",
                      "prefix_hit_tokens"), ("vllm:prompt_tokens", "prompt_tokens"),
                      ("vllm:generation_tokens", "generated_tokens"), ("vllm:num_preemptions", "preemptions")):
        assert value(after, name, name + "_total", **labels) == stats[key], name
    assert value(after, "vllm:num_requests_running", **labels) == stats["running"] == 0
    assert value(after, "vllm:num_requests_waiting", **labels) == stats["waiting"] == 0
    assert value(after, "vllm:kv_cache_usage_perc", **labels) == stats["blocks_in_use"] / stats["blocks_total"]
    reason = out["choices"][0]["finish_reason"]
    success = {r: value(after, "vllm:request_success", "vllm:request_success_total", finished_reason=r, **labels)
               - value(before, "vllm:request_success", "vllm:request_success_total", finished_reason=r, **labels)
               for r in ("stop", "length", "abort", "error")}
    assert success == {r: float(r == reason) for r in success}
    for name in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
                 "vllm:time_per_output_token_seconds"):
        count = value(after, name, name + "_count", **labels) - value(before, name, name + "_count", **labels)
        assert count == 1, name
    sizes = value(after, "vllm:request_prompt_tokens", "vllm:request_prompt_tokens_sum", **labels) - \
        value(before, "vllm:request_prompt_tokens", "vllm:request_prompt_tokens_sum", **labels)
    assert sizes == out["usage"]["prompt_tokens"]


def test_gauges_follow_a_running_request(base, tokenizer):
    """Mid-request (driven step by step here, no server thread), the gauges show it."""
    engine = LLMEngine(base, kv_cache_tokens=1024, block_size=BS, max_model_len=256)
    metrics = ServerMetrics(engine, "tiny-base")
    rid = engine.add_request(prompts_for(tokenizer, 1)[0], SamplingParams(max_tokens=8, ignore_eos=True))
    parsed = {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}
    assert parsed["vllm:num_requests_waiting"].samples[0].value == 1
    engine.step()
    stats = engine.stats()
    parsed = {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}
    usage = parsed["vllm:kv_cache_usage_perc"].samples[0].value
    assert 0 < usage == stats["blocks_in_use"] / stats["blocks_total"] <= 1
    assert parsed["vllm:num_requests_running"].samples[0].value == stats["running"] == 1
    assert parsed["kvshare_blocks_in_use"].samples[0].value == stats["blocks_in_use"]
    engine.abort(rid)
    parsed = {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}
    aborted = {s.labels["finished_reason"]: s.value for s in parsed["vllm:request_success"].samples}
    assert aborted["abort"] == 1 and parsed["kvshare_aborted"].samples[0].value == 1


def test_icarus_reading_base_kv_counts_as_shared_base(served, tokenizer):
    client, _ = served
    prompt = prompts_for(tokenizer, 3)[2] * 2
    complete(client, "tiny-base", prompt)
    before = hits_by_kind(client)
    cached = complete(client, "icarus-a", prompt)["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= BS
    assert delta(hits_by_kind(client), before) == {"shared_base": cached, "alora_pre_invocation": 0,
                                                   "lora_private": 0}


def test_lora_rerunning_its_prompt_counts_as_lora_private(served, tokenizer):
    client, _ = served
    prompt = prompts_for(tokenizer, 2)[0] + prompts_for(tokenizer, 2)[1]
    before = hits_by_kind(client)
    assert complete(client, "lora-a", prompt)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    cached = complete(client, "lora-a", prompt)["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == len(prompt) // BS * BS
    assert delta(hits_by_kind(client), before) == {"shared_base": 0, "alora_pre_invocation": 0,
                                                   "lora_private": cached}


def test_alora_before_its_invocation_counts_as_alora_pre_invocation(served, tokenizer, invocation):
    client, _ = served
    head, tail = prompts_for(tokenizer, 3)[2], prompts_for(tokenizer, 3)[1]
    prompt = head + head + invocation + tail
    shared = find_invocation_start(prompt, invocation) // BS * BS
    complete(client, "tiny-base", prompt)  # base KV for the whole prompt
    before = hits_by_kind(client)
    first = complete(client, "alora-a", prompt)["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert first == shared >= BS
    assert delta(hits_by_kind(client), before) == {"shared_base": 0, "alora_pre_invocation": shared,
                                                   "lora_private": 0}
    # run again: the base KV before the invocation, then its own KV from the invocation on
    again = complete(client, "alora-a", prompt)["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert again == len(prompt) // BS * BS > shared
    assert delta(hits_by_kind(client), before) == {"shared_base": 0, "alora_pre_invocation": 2 * shared,
                                                   "lora_private": again - shared}
