"""KVFlow through `kvshare serve`: hints over HTTP (body and router headers), the serve
flags, and a ReAct workflow through the server on a small pool with the step policy, host
tier and prefetch (outputs equal those of a pool that never evicts)."""

from __future__ import annotations

import asyncio

from kvshare.serve import LLMEngine
from kvshare.serve.workflow import Agent, RoundRobin, ServerBackend, SimulatedTool, Workflow

from test_engine import adapters, base, invocation, tokenizer  # noqa: F401
from test_server import KEY, running_server, server  # noqa: F401


def test_hints_over_http_body_and_router_headers(server):
    import httpx

    url, auth = server["url"] + "/v1/completions", {"Authorization": f"Bearer {KEY}"}
    body = {"model": "tiny-base", "prompt": "Hello there", "max_tokens": 2}
    ok = httpx.post(url, json=body, headers={**auth, "x-session-id": "wf-h", "x-kvshare-agent-id": "critic"}, timeout=60)
    assert ok.status_code == 200
    hints = server["engine"].hints_log[-1][1]
    assert (hints.workflow_id, hints.agent_id) == ("wf-h", "critic")
    ok = httpx.post(url, json={**body, "kvshare_hints": {"workflow_id": "wf-b", "steps_to_execution": {"a": 2}}},
                    headers={**auth, "x-session-id": "wf-h"}, timeout=60)
    assert ok.status_code == 200 and server["engine"].hints_log[-1][1].workflow_id == "wf-b"  # the body wins
    for bad in ({"agent_id": 5.5}, {"color": "red"}, {"steps_to_execution": {"a": -1}}):
        refused = httpx.post(url, json={**body, "kvshare_hints": bad}, headers=auth, timeout=60)
        assert refused.status_code == 400, bad
        assert refused.json()["error"]["param"] == "kvshare_hints" and "kvshare_hints" in refused.json()["error"]["message"]


def test_serve_takes_the_kvflow_and_limit_flags(cli, monkeypatch, tiny_models):
    import kvshare.serve.http.server as server_module

    seen = {}
    monkeypatch.setattr(server_module, "serve", lambda model, adapters, **kw: seen.update(kw))
    result = cli("serve", "--model", str(tiny_models("llama")), "--eviction-policy", "step",
                 "--host-cache-tokens", "4096", "--prefetch-steps", "1", "--max-prompts", "3")
    assert result.code == 0, result.err
    config, limits = seen["config"], seen["limits"]
    assert (config.eviction_policy, config.host_cache_tokens, config.prefetch_steps) == ("step", 4096, 1)
    assert limits.max_prompts == 3


def test_react_through_the_server_with_kvflow_equals_a_pool_that_never_evicts(base, adapters, tokenizer):
    context = tokenizer.encode("Paris is the capital of France. " * 6, add_special_tokens=False)
    agents = [Agent(f"a{i}", name, f"You are agent {i}.") for i, name in
              enumerate(["icarus-a", "lora-a", None, "icarus-a"])]
    histories, stats = [], []
    for settings in (dict(kv_cache_tokens=4096),
                     dict(kv_cache_tokens=8 * 40, eviction_policy="step", host_cache_tokens=4096, prefetch_steps=1)):
        engine = LLMEngine(base, [adapters["icarus-a"], adapters["lora-a"]], block_size=8, **settings)
        with running_server(engine) as running:
            backend = ServerBackend(running["url"] + "/v1", KEY, "tiny-base", tokenizer)
            flow = Workflow(0, backend, context, max_tokens=6, tool=SimulatedTool(observation_tokens=8))
            asyncio.run(flow.react(RoundRobin(agents), turns=6))
        histories.append(flow.history)
        stats.append(engine.stats())
    assert histories[0] == histories[1]
    assert stats[1]["evictions"] > 0 and stats[1]["host_loaded_blocks"] > 0
