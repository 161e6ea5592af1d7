"""kvshare on Ray Serve, for real: a local cluster of two simulated nodes, two engine replicas
of the tiny model, ICaRus workflows over loopback (bounded in count and time).

Affinity keeps every call of a workflow on one replica and so its cache; the control
(Ray's default load router) spreads them and loses most of it. Then the node of one replica
is removed mid-run: its workflows move once, miss once, stick and hit again, and Ray Serve
brings the deployment back to two replicas. Deselect with ``-m 'not ray'``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import sys
import time
from collections import defaultdict
from dataclasses import replace

import httpx
import pytest
import ray
from ray import serve
from ray.cluster_utils import Cluster
from ray.serve.exceptions import RayServeException
from transformers import AutoTokenizer

from kvshare.loopback import free_port
from kvshare.random_adapters import random_adapter
from kvshare.serve.config import EngineConfig
from kvshare.serve.ray.replicas import (APP_NAME, REPLICA_HEADER, EngineSpec, RayServeOptions, running_replicas, start,
                               wait_healthy, workflow_id_of)
from kvshare.serve.workflow import Agent, RoundRobin, ServerBackend, SimulatedTool, Workflow
from conftest import assert_one_line_error

WORKFLOWS, AGENTS, ROUNDS = 6, 3, 3  # each agent takes 3 turns (round-robin): 9 calls per workflow
TURNS = AGENTS * ROUNDS
FAILOVER_TURNS, FAILOVER_MAX_TOKENS = 6, 24  # longer calls, so some are in flight when the node goes
PHASE_TIMEOUT_S = 180


@pytest.fixture(scope="module")
def spec(tiny_models, tmp_path_factory) -> EngineSpec:
    base = tiny_models("llama")
    root = tmp_path_factory.mktemp("ray-adapters")
    adapters = tuple(str(random_adapter("icarus", base, root, f"icarus-{i}", seed=i)) for i in range(AGENTS))
    return EngineSpec(str(base), adapters, EngineConfig(kv_cache_tokens=4096, max_model_len=512))


@pytest.fixture(scope="module")
def serve_port() -> int:
    """One HTTP port for every test of the module: Serve keeps the proxy of its first start
    ("New http_options will not be applied"), so a test starting on another port finds nothing."""
    return free_port()


@pytest.fixture(scope="module")
def cluster():
    """Two simulated nodes with two CPUs each: one replica per node at first, and room for
    both on the head once the other node is gone."""
    config = {"health_check_initial_delay_ms": 0, "health_check_period_ms": 1000,
              "health_check_failure_threshold": 3}
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "_system_config": config,
                                                            "include_dashboard": False})
    worker = cluster.add_node(num_cpus=2)
    ray.init(address=cluster.address, log_to_driver=False)
    yield cluster, worker
    serve.shutdown()
    ray.shutdown()
    cluster.shutdown()


def contexts(tokenizer, phase: str) -> list[list[int]]:
    """Each workflow's task text, different from the first token on (no sharing across workflows)."""
    texts = [f"{phase}{i} task: " + " ".join(f"fact {phase}{i}.{j} is that item {j} weighs {i * 7 + j} kg."
                                             for j in range(2)) for i in range(WORKFLOWS)]
    return [tokenizer.encode(t, add_special_tokens=False) for t in texts]


async def run_workflows(backend: ServerBackend, phase: str, turns: int, tool: SimulatedTool,
                        max_tokens: int = 4) -> list[Workflow]:
    agents = [Agent(f"agent{i}", f"icarus-{i}", f"You are agent {i}.") for i in range(AGENTS)]
    flows = [Workflow(i, backend, ctx, max_tokens=max_tokens, tool=tool)
             for i, ctx in enumerate(contexts(backend.tokenizer, phase))]
    await asyncio.wait_for(asyncio.gather(*(f.react(RoundRobin(agents), turns) for f in flows)), PHASE_TIMEOUT_S)
    return flows


def calls_by_workflow(backend: ServerBackend) -> dict[str, list[dict]]:
    grouped = defaultdict(list)
    for call in backend.calls:
        grouped[call["workflow_id"]].append(call)
    return grouped


def cache_share(calls: list[dict]) -> float:
    return sum(c["cached_tokens"] for c in calls) / sum(c["prompt_tokens"] for c in calls)


def test_routing_key_is_the_header_else_the_body_hint():
    body = json.dumps({"model": "m", "prompt": "hi", "kvshare_hints": {"workflow_id": "wf-body"}}).encode()
    assert workflow_id_of({"x-session-id": "wf-head"}, body) == "wf-head"
    assert workflow_id_of({}, body) == "wf-body"
    assert workflow_id_of({}, json.dumps({"kvshare_hints": {"workflow_id": 7}}).encode()) == "7"
    for junk in (b"", b'{"kvshare_hints": ', b'{"kvshare_hints": [1]}', b'["kvshare_hints"]',
                 json.dumps({"kvshare_hints": {"workflow_id": True}}).encode()):
        assert workflow_id_of({}, junk) is None


def test_ray_flags_need_ray_and_ray_needs_its_extra(cli, monkeypatch):
    assert_one_line_error(cli("serve", "m", "--replicas", "2"), "--replicas needs --ray")
    assert_one_line_error(cli("serve", "m", "--ray", "--replicas", "0"), "--replicas must be at least 1")
    assert_one_line_error(cli("serve", "m", "--replicas", "0"), "--replicas needs --ray")  # 0 is given too
    assert_one_line_error(cli("serve", "m", "--ray", "--enable-lora-loading"), "would reach one replica")
    monkeypatch.setitem(sys.modules, "ray", None)  # as if kvshare[ray] were not installed
    monkeypatch.delitem(sys.modules, "kvshare.serve.ray.replicas")
    assert_one_line_error(cli("serve", "m", "--ray"), "pip install 'kvshare[ray]'")


@pytest.mark.ray
def test_workflow_affinity_failover_and_control(spec, cluster, serve_port):
    head_and_worker, worker = cluster
    tokenizer = AutoTokenizer.from_pretrained(spec.model)
    began = time.monotonic()
    port = serve_port
    url = start(spec, RayServeOptions(replicas=2, threads_per_replica=1, affinity=True), port=port, timeout_s=180)
    deployed = time.monotonic()
    gateways = [actor["Address"]["NodeID"] for actor in ray._private.state.actors(actor_state_name="ALIVE").values()
                if "KvshareGateway" in actor["Name"]]
    assert gateways == [head_and_worker.head_node.node_id]  # the router's table survives a worker's loss

    # 1. affinity: every workflow on one replica, both replicas used, turns 2+ hit the cache
    backend = ServerBackend(url + "/v1", "EMPTY", spec.model, tokenizer, retries=3)
    asyncio.run(run_workflows(backend, "A", TURNS, SimulatedTool(observation_tokens=8)))
    grouped = calls_by_workflow(backend)
    assert len(grouped) == WORKFLOWS and all(len(calls) == TURNS for calls in grouped.values())
    for calls in grouped.values():
        assert len({c["replica"] for c in calls}) == 1, calls
        assert all(c["cached_tokens"] > 0 for c in calls[1:]), calls  # turn 2 on: the shared KV is there
    replicas = {c["replica"] for c in backend.calls}
    nodes = {c["node"] for c in backend.calls}
    assert len(replicas) == 2 and len(nodes) == 2, (replicas, nodes)
    affinity_share = cache_share(backend.calls)

    # 2. fail-over: remove the worker node once every workflow has made two calls
    moved_from = next(c["replica"] for c in backend.calls if c["node"] == worker.node_id)
    backend = ServerBackend(url + "/v1", "EMPTY", spec.model, tokenizer, retries=120, retry_delay_s=0.25)
    removed = {}

    async def remove_when_ready():
        grouped = calls_by_workflow(backend)
        while len(grouped) < WORKFLOWS or any(len(calls) < 2 for calls in grouped.values()):
            await asyncio.sleep(0.05)
            grouped = calls_by_workflow(backend)
        removed["at"] = time.perf_counter()
        removed["monotonic"] = time.monotonic()
        await asyncio.to_thread(head_and_worker.remove_node, worker)

    async def phase_b():
        remover = asyncio.create_task(remove_when_ready())
        flows = await run_workflows(backend, "B", FAILOVER_TURNS, SimulatedTool(delay_s=0.1, observation_tokens=8),
                                    FAILOVER_MAX_TOKENS)
        await remover
        return flows

    asyncio.run(phase_b())
    finished = time.monotonic()
    grouped = calls_by_workflow(backend)
    assert len(grouped) == WORKFLOWS and all(len(calls) == FAILOVER_TURNS for calls in grouped.values())
    moved = {wf: calls for wf, calls in grouped.items() if calls[0]["node"] == worker.node_id}
    stayed = {wf: calls for wf, calls in grouped.items() if wf not in moved}
    assert moved and stayed
    for calls in stayed.values():  # the survivor's workflows never move
        assert len({c["replica"] for c in calls}) == 1, calls
    first_moved_call = None
    for calls in moved.values():
        before = [c for c in calls if c["node"] == worker.node_id]
        after = calls[len(before):]
        assert len(after) >= 2 and all(c["node"] != worker.node_id for c in after), calls  # moved for good
        assert len({c["replica"] for c in after}) == 1, calls  # and stuck to its new replica
        assert after[0]["cached_tokens"] == 0, calls  # the new replica never saw it: one miss
        assert all(c["cached_tokens"] > 0 for c in after[1:]), calls  # then hits again
        first_moved_call = min(first_moved_call or after[0]["end"], after[0]["end"])
    to_first_moved_call = first_moved_call - removed["at"]
    healthy_at = wait_healthy(2, timeout_s=120)
    to_two_replicas = healthy_at - removed["monotonic"]
    retried = sum(c["attempts"] - 1 for c in backend.calls)

    # 3. control: the very same calls as in 1, on fresh replicas behind Ray's load-balancing router
    serve.delete("kvshare")
    url = start(spec, RayServeOptions(replicas=2, threads_per_replica=1, affinity=False), port=port, timeout_s=180)
    backend = ServerBackend(url + "/v1", "EMPTY", spec.model, tokenizer, retries=3)
    asyncio.run(run_workflows(backend, "A", TURNS, SimulatedTool(observation_tokens=8)))
    control_share = cache_share(backend.calls)
    spread = sum(len({c["replica"] for c in calls}) > 1 for calls in calls_by_workflow(backend).values())
    assert control_share < affinity_share, (control_share, affinity_share)
    assert running_replicas() == 2

    print(f"\n[ray fail-over] deploy (2 replicas, 2 nodes): {deployed - began:.1f} s; "
          f"workflows moved: {len(moved)} of {WORKFLOWS} (from replica {moved_from}); client retries: {retried}; "
          f"node removal -> first successful call of a moved workflow: {to_first_moved_call:.2f} s; "
          f"node removal -> two healthy replicas: {to_two_replicas:.2f} s; "
          f"fail-over phase finished {finished - removed['monotonic']:.1f} s after the removal")
    print(f"[ray cache share] affinity: {affinity_share:.3f}; load balancing: {control_share:.3f} "
          f"({spread} of {WORKFLOWS} workflows spread over both replicas); test {time.monotonic() - began:.0f} s")


@pytest.mark.ray
def test_replicas_whose_engine_refuses_its_settings_are_one_error_not_a_hang(spec, cluster, serve_port):
    """serve.run waited without a timeout for the app to run; when every replica's engine
    refuses its settings, Ray marks the app failed and kvshare says why in one line."""
    from dataclasses import replace

    from kvshare.errors import KvshareError

    from kvshare.serve.ray.replicas import APP_NAME

    serve.delete(APP_NAME)  # the test above's app, if it ran: its replicas would count as up
    bad = replace(spec, config=EngineConfig(kv_cache_tokens=4096, max_model_len=10 ** 6))
    began = time.monotonic()
    with pytest.raises(KvshareError, match="max_model_len"):
        start(bad, RayServeOptions(replicas=1, threads_per_replica=1), port=serve_port, timeout_s=300)
    assert time.monotonic() - began < 300


def metric(url: str, name: str) -> float:
    """The replica's value of ``name`` (one replica: every /metrics is its)."""
    found = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", httpx.get(url + "/metrics").text, re.M)
    return float(found.group(1))


def aborted(url: str) -> float:
    return metric(url, "kvshare_aborted_total")


async def leave_once_running(url: str, body: dict, headers: dict) -> None:
    """Ask for a non-streamed completion and hang up once the replica runs it (it has sent
    nothing yet: only the gateway can tell it the client left)."""
    async with httpx.AsyncClient(timeout=60) as client:
        call = asyncio.ensure_future(client.post(url + "/v1/completions", json=body, headers=headers))
        while not await asyncio.to_thread(metric, url, "vllm:num_requests_running"):
            assert not call.done(), call.result().text
            await asyncio.sleep(0.05)
        call.cancel()
        await asyncio.gather(call, return_exceptions=True)


def wait_for(condition, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


@pytest.mark.ray
def test_the_gateway_checks_the_key_cancels_for_a_gone_client_and_ends_a_dead_replicas_stream(spec, cluster,
                                                                                               serve_port):
    """On a real cluster: what the gateway's unit tests fake (tests/test_ray_gateway.py)."""
    with contextlib.suppress(RayServeException):  # no Serve yet when this test runs alone
        serve.delete(APP_NAME)  # an earlier test's app holds the CPUs
    url = start(replace(spec, api_key="k"), RayServeOptions(replicas=1, threads_per_replica=1), port=serve_port,
                timeout_s=180)
    key = {"authorization": "Bearer k"}
    long = {"model": spec.model, "prompt": "hello", "max_tokens": 500, "ignore_eos": True}  # seconds of steps

    refused = httpx.post(url + "/v1/completions", json=long)  # never reached a replica: none named itself
    assert refused.status_code == 401 and REPLICA_HEADER not in refused.headers, refused.headers
    assert refused.json()["error"]["type"] == "authentication_error"

    warm = httpx.post(url + "/v1/completions", json={**long, "max_tokens": 2}, headers=key, timeout=300)
    assert warm.status_code == 200 and warm.headers[REPLICA_HEADER]  # prefill and decode steps compile once
    before = aborted(url)  # a client that leaves mid-stream, then one that leaves before any reply
    with httpx.stream("POST", url + "/v1/completions", json={**long, "stream": True}, headers=key,
                      timeout=60) as reply:
        next(reply.iter_lines())
    asyncio.run(leave_once_running(url, long, key))
    wait_for(lambda: aborted(url) >= before + 2)

    with httpx.stream("POST", url + "/v1/completions", json={**long, "stream": True}, headers=key,
                      timeout=60) as reply:
        lines = reply.iter_lines()
        assert next(lines).startswith("data: ")
        ray.kill(ray.get_actor(f"SERVE_REPLICA::{APP_NAME}#KvshareEngine#{reply.headers[REPLICA_HEADER]}",
                               namespace="serve"), no_restart=False)
        events = [line for line in lines if line]
    assert events[-1] == "data: [DONE]", events[-3:]
    assert json.loads(events[-2].removeprefix("data: "))["error"]["code"] == 503, events[-3:]
