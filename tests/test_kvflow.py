"""KVFlow: typed hints, the agent step graph, the step-aware policy, the host tier with
load-back and prefetch, and the scheduler that skips requests whose KV is loading.

Exactness: KV that went to the host and came back is bit-identical, and greedy outputs with
the step-aware policy, the host tier and prefetch equal those of a pool that never evicts,
for every adapter kind."""

from __future__ import annotations

import math
import random
import time

import pytest
import torch

from kvshare.errors import KvshareError
from kvshare.kinds import kind_spec
from kvshare.serve import LLM, SamplingParams
from kvshare.serve.cache import AgentTable, BlockManager, HostTier, StepAwarePolicy
from kvshare.serve.hints import AgentHints
from kvshare.serve.sequence import Sequence
from kvshare.serve.task_graph import StepGraph, StepNode

from conftest import assert_one_line_error
from test_engine import adapters, base, invocation, tokenizer  # noqa: F401

BS = 4
FIXED = 24  # tokens of each agent's fixed prompt (6 blocks)


# hints ----------------------------------------------------------------------------------------
def test_hints_parse_validate_and_take_router_headers():
    h = AgentHints.parse({"workflow_id": "w1", "agent_id": "critic", "fixed_prefix_tokens": 64,
                          "steps_to_execution": {"planner": 1, "critic": 3}})
    assert h.agent_key == ("w1", "critic") and h.fixed_prefix_tokens == 64
    assert h.steps_to_execution == {"planner": 1, "critic": 3}
    assert AgentHints.parse(None) == AgentHints() and AgentHints().agent_key is None
    assert AgentHints.parse({"next_agents": ["b", "c"]}).steps_to_execution == {"b": 1, "c": 1}
    routed = AgentHints.parse({}, {"X-Session-Id": "w9", "x-kvshare-agent-id": "a"})
    assert routed.agent_key == ("w9", "a")
    assert AgentHints.parse({"workflow_id": "body"}, {"x-session-id": "header"}).workflow_id == "body"
    graph = {"nodes": [{"id": "p", "agent": "planner"}, {"id": "c", "agent": "critic", "after": ["p"]}],
             "done": []}
    assert AgentHints.parse({"graph": graph}).steps_to_execution == {"planner": 1, "critic": 2}  # next: 1 away
    bad = [{"agent": "x"}, {"agent_id": 5.5}, {"agent_id": ""}, {"agent_id": "x" * 300},
           {"fixed_prefix_tokens": -1}, {"fixed_prefix_tokens": True}, {"steps_to_execution": [1]},
           {"steps_to_execution": {"a": -2}}, {"steps_to_execution": {"a": 1}, "next_agents": ["b"]},
           {"next_agents": "b"}, {"graph": {"nodes": [{"id": "a", "agent": "x", "after": ["zz"]}]}},
           {"graph": {"nodes": [{"id": "a", "agent": "x", "after": ["a"]}]}}]
    for raw in bad:
        with pytest.raises(KvshareError, match="kvshare_hints|step graph"):
            AgentHints.parse(raw)


# step graph -----------------------------------------------------------------------------------
def test_step_graph_joins_and_the_runtime_patterns():
    g = StepGraph([StepNode("a", "A"), StepNode("b", "B", ("a",)), StepNode("c", "C", ("a",)),
                   StepNode("d", "C", ("b",)), StepNode("all", "R", ("c", "d"), "all"),
                   StepNode("any", "S", ("c", "d"), "any")])
    assert g.node_steps() == {"a": 0, "b": 1, "c": 1, "d": 2, "all": 3, "any": 2}
    assert g.node_steps({"a", "c"}) == {"b": 0, "d": 1, "all": 2, "any": 0}
    assert g.agent_steps() == {"A": 0, "B": 1, "C": 1, "R": 3, "S": 2}  # C: min over its two nodes
    with pytest.raises(KvshareError, match="cycle"):
        StepGraph([StepNode("x", "A", ("y",)), StepNode("y", "B", ("x",))])
    with pytest.raises(KvshareError, match="unique"):
        StepGraph([StepNode("x", "A"), StepNode("x", "B")])
    react = StepGraph.chain(["p", "c", "w", "p", "c"])  # round-robin over three agents
    assert react.agent_steps({"n0"}) == {"c": 0, "w": 1, "p": 2}
    mapreduce = StepGraph.fan_in(["m0", "m1", "m2"], "r")
    assert mapreduce.agent_steps() == {"m0": 0, "m1": 0, "m2": 0, "r": 1}
    assert mapreduce.agent_steps({"map0", "map1"}) == {"m2": 0, "r": 1}
    long = StepGraph.chain([f"a{i % 10}" for i in range(5000)])  # no recursion limit to hit
    assert long.agent_steps({"n0"})["a0"] == 9


def test_agent_table_steps_learned_boundary_and_bound():
    t = AgentTable()
    key = t.on_request(AgentHints("w", "a", steps_to_execution={"a": 3, "b": 1}))
    assert key == ("w", "a") and t.steps_of(key) == 0 and t.steps_of(("w", "b")) == 1
    t.on_finish(key)
    assert t.steps_of(key) == 3 and t.steps_of(("w", "zz")) == math.inf
    k = [bytes([i]) for i in range(8)]
    assert t.fixed_blocks(key, k[:5], None, 4) == 5  # first call: the whole prompt
    assert t.fixed_blocks(key, k[:3] + [b"x", b"y"], None, 4) == 3  # then what the calls share
    assert t.fixed_blocks(key, k, 9, 4) == 2  # explicit: whole blocks of fixed_prefix_tokens
    assert t.due(3) == [(3, ("w", "a"))] and t.due(2) == []  # b has no fixed prompt to load yet


def test_agent_table_a_schedule_replaces_the_last_one_of_its_workflow():
    """An agent a later call's schedule leaves out has no call ahead: it is not due and its
    blocks rank furthest (stale steps kept ended workflows' prompts above live ones)."""
    t = AgentTable()
    a, b, c = ("w", "a"), ("w", "b"), ("w", "c")
    for agent in "abc":  # each agent has a fixed prompt on record
        t.fixed_blocks(("w", agent), [agent.encode()], 4, 4)
    t.on_finish(t.on_request(AgentHints("w", "a", steps_to_execution={"a": 3, "b": 1, "c": 2})))
    assert [t.steps_of(k) for k in (a, b, c)] == [3, 1, 2]
    t.on_request(AgentHints("w", "b", steps_to_execution={"c": 1}))  # a and b: no call ahead
    assert [t.steps_of(k) for k in (a, b, c)] == [math.inf, 0, 1]
    t.on_finish(b)
    assert t.steps_of(b) == math.inf and t.due(8) == [(1, c)]
    t.on_request(AgentHints("w2", "x", steps_to_execution={"y": 1}))  # other workflows untouched
    t.on_request(AgentHints("w", "c", steps_to_execution={}))  # the workflow's last call
    t.on_finish(c)
    assert [t.steps_of(k) for k in (a, b, c)] == [math.inf] * 3 and t.due(8) == []
    assert t.steps_of(("w2", "y")) == 1
    # hints without a schedule leave the workflow's steps as they were
    t.on_finish(t.on_request(AgentHints("w2", "y", steps_to_execution={"y": 2})))
    t.on_request(AgentHints("w2", "x"))
    assert t.steps_of(("w2", "y")) == 2


# step-aware policy ---------------------------------------------------------------------------
def _seq(tokens, name, agent=None, fixed=None, steps=None):
    s = Sequence(name, list(tokens), SamplingParams(max_tokens=1))
    s.spec = kind_spec(None)
    if agent:
        s.hints = AgentHints("w", agent, fixed, steps)
    return s


def _run(m, s):
    s.agent = m.agents.on_request(s.hints)
    m.allocate(s)
    s.num_computed = len(s)
    m.register_computed(s)
    m.free(s)
    m.agents.on_finish(s.agent)


def test_step_policy_evicts_dynamic_then_furthest_agent_then_lru_leaves_only():
    m = BlockManager(64, 2, "sha256:base", policy=StepAwarePolicy())
    # agent a: fixed 4 tokens (2 blocks) + dynamic 2 (1 block); next call in 5 steps
    schedule = {"a": 5, "b": 1, "c": 2}
    _run(m, _seq([1, 2, 3, 4, 9, 9], "a1", "a", 4, schedule))
    _run(m, _seq([5, 6, 7, 8, 9, 8], "b1", "b", 4, schedule))
    _run(m, _seq([1, 2, 3, 4, 7, 7], "c1", "c", 4, schedule))  # shares a's fixed prompt
    order = []
    while len(m.policy):
        victim = m.policy.pop_victim()
        order.append((m.blocks[victim].dynamic, tuple(sorted(r[1] for r in m.blocks[victim].readers))))
        m._evict(victim)
    # the three dynamic suffixes first; then the fixed prompt a and c share (its readers'
    # nearest call: min(5, 2) = 2 steps away); b's (1 step away) last
    assert order[:3] == [(True, ())] * 3
    assert order[3:] == [(False, ("a", "c"))] * 2 + [(False, ("b",))] * 2
    # leaves only: the deeper block of each chain left before its parent
    m2 = BlockManager(64, 2, "sha256:base", policy=StepAwarePolicy())
    _run(m2, _seq([1, 2, 3, 4], "x", "a", 4, {"a": 9}))
    first = m2.policy.pop_victim()
    assert m2.blocks[first].parent is not None  # the second block (the leaf), not the root one


def _scan_victim(m):
    """The step-aware order by a plain scan of every idle block (what the heap must match)."""
    released = m.policy._released
    leaves = [b for b in released if m.is_leaf(b)] or list(released)
    return min((m.rank(b) + (released[b],), b) for b in leaves)[1]


def test_step_policy_heap_picks_what_a_full_scan_picks():
    """Random agents, hints, shared prefixes, hits and evictions: every victim the heap picks
    (and every peeked rank) equals a brute-force scan over all idle blocks."""
    rng = random.Random(7)
    m = BlockManager(48, 2, "sha256:base", policy=StepAwarePolicy())
    prefixes = [[rng.randrange(50) for _ in range(rng.choice([2, 4, 6]))] for _ in range(5)]
    checked = 0
    for i in range(300):
        agent = rng.choice("abcdef")
        tokens = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randint(0, 5))]
        steps = {a: rng.randint(1, 6) for a in rng.sample("abcdef", 3)}
        seq = _seq(tokens, f"r{i}", agent, rng.choice([None, 2, 4]), steps)
        seq.agent = m.agents.on_request(seq.hints)
        while True:  # evict what allocate would, checking each choice against the scan
            if m.pool.num_free >= m.blocks_needed(len(seq)) or not len(m.policy):
                break
            expected = _scan_victim(m)
            assert m.policy.peek_rank() == m.rank(expected)
            assert m.policy.pop_victim() == expected
            m._evict(expected)
            m.pool.release(expected)  # back to the free list (it holds no reference)
            checked += 1
        m.allocate(seq)
        seq.num_computed = len(seq)
        m.register_computed(seq)
        m.free(seq)
        m.agents.on_finish(seq.agent)
    assert checked > 100


# host tier ------------------------------------------------------------------------------------
def test_host_tier_round_trip_is_bit_identical_and_demand_outranks_prefetch():
    kv = torch.randn(8, 3, 2, 4, 2, 5)  # block-major: (blocks, layers, 2, block_size, heads, dim)
    tier = HostTier(kv, num_blocks=4, bandwidth_gbps=kv[0].numel() * 4 / 0.05 / 1e9)  # 50 ms a block
    original = kv[1].clone()
    assert tier.offload(b"k1", 1, "meta") and tier.state(b"k1") == "host"
    kv[1] = 0
    for i, key in enumerate([b"p1", b"p2", b"d"]):
        tier.offload(key, 2 + i, None)
    tier.load(b"k1", 6, demand=False)  # starts at once
    while not tier.loading[b"k1"].started:
        time.sleep(0.001)
    tier.load(b"p1", 0, demand=False)
    tier.load(b"p2", 1, demand=False)
    tier.load(b"d", 7, demand=True)
    tier.promote(b"p2")  # a request now waits for p2 too
    landed = []
    while len(landed) < 4:
        tier.wait(1.0)
        landed += [t.key for t in tier.landed()]
    assert landed == [b"k1", b"d", b"p2", b"p1"]
    assert torch.equal(kv[6], original)  # bit-identical after the round trip
    assert tier.stats.loaded_blocks == 4 and tier.stats.prefetched_blocks == 2
    assert tier.stats.transfer_seconds >= 4 * 0.05 * 0.9  # the simulated link held each copy
    tier.offload(b"new", 0, None)  # the tier is full: its least recent block goes
    assert len(tier.index) == 4 and tier.stats.dropped_blocks == 1 and b"k1" not in tier
    tier.load(b"new", 3, demand=True)
    tier.clear()  # waits for the load in flight, then forgets everything
    assert not tier.loading and not tier.index and len(tier.free) == 4 and torch.equal(kv[3], kv[0])


# through the engine ---------------------------------------------------------------------------
KINDS = {"base": None, "lora": "lora-a", "alora": "alora-a", "icarus": "icarus-a"}


def _agent_loop(llm, fixed_prompts, adapter_of, turns, seed=0, max_tokens=4):
    """A single ReAct-style workflow: agents take turns, each with its fixed prompt plus a new
    dynamic suffix; returns [(tokens, cached prompt tokens, load wait)] per call."""
    rng = random.Random(seed)
    n = len(fixed_prompts)
    results = []
    for turn in range(turns):
        a = turn % n
        prompt = fixed_prompts[a] + [rng.randrange(10, 200) for _ in range(5)]
        if adapter_of[a] == "alora-a":
            prompt += llm.engine.adapter("alora-a").invocation
        hints = {"workflow_id": "wf", "agent_id": f"agent{a}", "fixed_prefix_tokens": FIXED,
                 "steps_to_execution": {f"agent{(turn + k) % n}": k for k in range(1, n + 1)}}
        out = None
        llm.engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                               adapter=adapter_of[a], hints=hints)
        while llm.engine.has_unfinished():
            for o in llm.engine.step():
                out = o if o.finished else out
        results.append((out.token_ids, out.metrics["prompt_tokens_cached"], out.metrics["load_wait_time"]))
    return results


@pytest.fixture(scope="module")
def fixed_prompts():
    rng = random.Random(7)
    return [[rng.randrange(10, 200) for _ in range(FIXED)] for _ in range(4)]


@pytest.mark.parametrize("kind", list(KINDS))
def test_step_policy_host_tier_and_prefetch_equal_a_pool_that_never_evicts(base, adapters, fixed_prompts, kind):
    adapter_of = [KINDS[kind]] * 2 + [None, KINDS[kind]]  # the base agent's blocks mix in
    ample = LLM(base, list(adapters.values()), kv_cache_tokens=4096, block_size=BS)
    expected = _agent_loop(ample, fixed_prompts, adapter_of, turns=12)
    modes = {"lru+tier": dict(host_cache_tokens=1024),
             "kvflow": dict(eviction_policy="step", host_cache_tokens=1024, prefetch_steps=2)}
    for name, settings in modes.items():
        small = LLM(base, list(adapters.values()), kv_cache_tokens=20 * BS, block_size=BS, **settings)
        got = _agent_loop(small, fixed_prompts, adapter_of, turns=12)
        assert [g[0] for g in got] == [e[0] for e in expected], name
        stats = small.engine.stats()
        assert stats["evictions"] > 0 and stats["host_loaded_blocks"] > 0, (name, stats)
        assert sum(g[1] for g in got[4:]) >= 0.9 * sum(e[1] for e in expected[4:]), name
    assert small.engine.stats()["host_prefetched_blocks"] > 0


def test_step_policy_keeps_the_agent_due_next_where_lru_loses_it(base, fixed_prompts):
    adapter_of = [None] * 4
    cached = {}
    for policy in ("lru", "step"):
        llm = LLM(base, kv_cache_tokens=20 * BS, block_size=BS, eviction_policy=policy)
        cached[policy] = sum(c for _, c, _ in _agent_loop(llm, fixed_prompts, adapter_of, turns=12)[4:])
    assert cached["lru"] == 0  # the loop always evicts exactly the agent that runs next
    assert cached["step"] >= 4 * FIXED


def test_a_request_whose_prefix_is_loading_is_skipped_not_waited_for(base, fixed_prompts):
    block_bytes = LLM(base, kv_cache_tokens=64, block_size=BS).engine.kv_bytes_per_token * BS
    slow = block_bytes / 0.15 / 1e9  # 150 ms per block: a load of 6 blocks takes ~0.9 s
    llm = LLM(base, kv_cache_tokens=20 * BS, block_size=BS, host_cache_tokens=1024, host_bandwidth_gbps=slow)
    engine = llm.engine
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    for prompt in fixed_prompts:  # the first agent's prompt ends up in the host tier
        llm.generate([prompt + [5, 6]], params)
    engine.add_request(fixed_prompts[0] + [7, 8], params, request_id="reload")
    engine.add_request([11, 12, 13], params, request_id="other")
    finished = []
    while engine.has_unfinished():
        finished += [(o.request_id, o) for o in engine.step() if o.finished]
    order = [rid for rid, _ in finished]
    assert order == ["other", "reload"]  # the second request ran while the first one's KV loaded
    reload = dict(finished)["reload"]
    assert reload.metrics["prompt_tokens_cached"] == FIXED
    if engine.device.type == "cpu":  # the slow link is simulated on CPU; a GPU copies at its own speed
        assert reload.metrics["load_wait_time"] > 0.3
    fresh = LLM(base, kv_cache_tokens=4096, block_size=BS).generate([fixed_prompts[0] + [7, 8]], params)[0]
    assert reload.token_ids == fresh.token_ids


def test_prefetch_loads_the_next_agent_before_its_request_arrives(base, fixed_prompts):
    """Whether a prefetch lands before its request is timing; that it *started* before is not:
    with prefetch no request has to start a load of its own (host_hit_tokens counts those)."""
    results, stats = {}, {}
    for prefetch in (0, 1):
        llm = LLM(base, kv_cache_tokens=20 * BS, block_size=BS, eviction_policy="step",
                  host_cache_tokens=1024, prefetch_steps=prefetch)
        results[prefetch] = _agent_loop(llm, fixed_prompts, [None] * 4, turns=12, max_tokens=12)
        stats[prefetch] = llm.engine.stats()
    assert stats[0]["host_hit_tokens"] > 0 and stats[0]["host_prefetched_blocks"] == 0
    assert stats[1]["host_hit_tokens"] == 0 and stats[1]["host_prefetched_blocks"] > 0
    assert all(c == FIXED for _, c, _ in results[1][4:])  # every fixed prompt from the cache
    assert [r[0] for r in results[0]] == [r[0] for r in results[1]]


def test_kvflow_benchmark_runs_every_mode_and_writes_its_report(tiny_models, tmp_path, cli):
    """Speed is printed, not asserted; what must hold regardless of speed is asserted."""
    from kvshare.eval.perf.kvflow import run_kvflow_bench

    results = run_kvflow_bench(model=str(tiny_models("llama")), fixed_tokens=(64,), output_tokens=(4,),
                               agents=6, rounds=2, concurrent=1, links=("25",), out_dir=tmp_path)
    by_mode = {r["mode"]: r for r in results["records"]}
    assert set(by_mode) == {"lru", "lru+host", "kvflow"}
    assert by_mode["lru"]["fixed_hit_rate"] == 0.0  # LRU evicts exactly the agent that runs next
    assert by_mode["lru+host"]["fixed_hit_rate"] == by_mode["kvflow"]["fixed_hit_rate"] == 1.0
    assert by_mode["kvflow"]["blocks_prefetched"] > 0 and by_mode["lru+host"]["blocks_prefetched"] == 0
    assert by_mode["kvflow"]["tokens_recomputed"] < by_mode["lru"]["tokens_recomputed"]
    assert all(r["warm_calls"] == 6 and r["speedup_vs_lru"] > 0 for r in results["records"])
    for name in ("kvflow_bench.json", "kvflow_bench.md", "kvflow_latency.png"):
        assert (tmp_path / name).stat().st_size > 0
    for args, message in ((["--links", "fast"], "gpu-ratio"), (["--rounds", "1"], "2 rounds")):
        bad = cli("bench", "kvflow", "--model", str(tiny_models("llama")), "--fixed-tokens", "32",
                  "--output-tokens", "2", "--agents", "2", "--concurrent", "1", *args)
        assert_one_line_error(bad, message)



def test_a_shared_history_too_big_to_keep_whole_still_finishes(base, adapters, tokenizer):
    """ReAct over one growing history with ICaRus, LoRA and base agents on a pool that cannot
    hold it twice: a request's chain is partly on device and partly on host. Its blocks are
    pinned while it waits, so loads never evict each other (this livelocked before)."""
    import asyncio

    from kvshare.serve.driver.engine_thread import AsyncEngine
    from kvshare.serve.workflow import Agent, EngineBackend, RoundRobin, SimulatedTool, Workflow

    context = tokenizer.encode("Paris is the capital of France. " * 6, add_special_tokens=False)
    agents = [Agent(f"a{i}", n, f"You are agent {i}.") for i, n in enumerate(["icarus-a", "lora-a", None, "icarus-a"])]
    engine = LLM(base, [adapters["icarus-a"], adapters["lora-a"]], block_size=8, kv_cache_tokens=8 * 40,
                 eviction_policy="step", host_cache_tokens=4096, prefetch_steps=1).engine
    runner = AsyncEngine(engine)
    flow = Workflow(0, EngineBackend(runner), context, max_tokens=6, tool=SimulatedTool(observation_tokens=8))
    try:
        asyncio.run(asyncio.wait_for(flow.react(RoundRobin(agents), turns=6), 120))
    finally:
        runner.shutdown()
    assert len(flow.records) == 6 and engine.stats()["host_loaded_blocks"] > 0
    assert engine.kv_usage()["kv"]["blocks_in_use"] == 0  # no pin outlives its request


@pytest.mark.parametrize("host_blocks", [4, 12])
@pytest.mark.parametrize("policy", ["lru", "step"])
def test_a_full_host_tier_never_drops_the_block_it_is_loading_back(base, fixed_prompts, host_blocks, policy):
    """A host tier smaller than the agents' prompts: taking a device block for a load evicts
    (offloads) another, and the full tier makes room by dropping its oldest entry, which was
    often the very block being loaded (a KeyError that failed the step)."""
    expected = _agent_loop(LLM(base, kv_cache_tokens=4096, block_size=BS), fixed_prompts, [None] * 4, turns=12)
    llm = LLM(base, kv_cache_tokens=20 * BS, block_size=BS, host_cache_tokens=host_blocks * BS,
              eviction_policy=policy, prefetch_steps=2 if policy == "step" else 0)
    got = _agent_loop(llm, fixed_prompts, [None] * 4, turns=12)
    assert [g[0] for g in got] == [e[0] for e in expected]
    stats = llm.engine.stats()
    assert stats["host_dropped_blocks"] > 0 and stats["blocks_in_use"] == 0, stats


def test_an_engine_with_loads_in_flight_is_unfinished_until_they_land(base, fixed_prompts):
    """A prefetch started by the step that finished the last request holds its device block
    until a step collects it; an engine that stopped stepping then would keep that block in
    use for good (a lender could not take its unit back, the cache could not be reset)."""
    block_bytes = LLM(base, kv_cache_tokens=64, block_size=BS).engine.kv_bytes_per_token * BS
    slow = block_bytes / 0.05 / 1e9  # 50 ms a block
    llm = LLM(base, kv_cache_tokens=20 * BS, block_size=BS, eviction_policy="step", host_cache_tokens=1024,
              prefetch_steps=2, host_bandwidth_gbps=slow)
    for turns in range(5, 9):
        _agent_loop(llm, fixed_prompts, [None] * 4, turns=turns, seed=turns)  # stops stepping when unfinished is false
        stats = llm.engine.stats()
        assert stats["blocks_in_use"] == 0 and stats["host_loads_in_flight"] == 0, stats
    assert llm.engine.stats()["host_prefetched_blocks"] > 0
    llm.engine.reset_prefix_cache()


def test_resetting_the_cache_lets_loads_in_flight_land_first(base, fixed_prompts):
    """A caller that stops stepping once its requests finish may leave a prefetch's loads in
    flight; resetting the prefix cache (or joining an arena) then waits for them to land
    instead of failing on their blocks (a RuntimeError before)."""
    block_bytes = LLM(base, kv_cache_tokens=64, block_size=BS).engine.kv_bytes_per_token * BS
    slow = block_bytes / 0.05 / 1e9  # 50 ms a block
    llm = LLM(base, kv_cache_tokens=20 * BS, block_size=BS, eviction_policy="step", host_cache_tokens=1024,
              prefetch_steps=2, host_bandwidth_gbps=slow)
    engine, rng, caught = llm.engine, random.Random(3), 0
    for turn in range(16):
        a = turn % len(fixed_prompts)
        hints = {"workflow_id": "wf", "agent_id": f"agent{a}", "fixed_prefix_tokens": FIXED,
                 "steps_to_execution": {f"agent{(turn + k) % 4}": k for k in range(1, 5)}}
        engine.add_request(fixed_prompts[a] + [rng.randrange(10, 200) for _ in range(5)],
                           SamplingParams(max_tokens=4, ignore_eos=True), hints=hints)
        while engine.sequences:  # stop as soon as the request is done, loads or not
            engine.step()
        if engine.stats()["host_loads_in_flight"]:
            caught += 1
            engine.reset_prefix_cache()
            stats = engine.stats()
            assert stats["host_loads_in_flight"] == 0 and stats["blocks_in_use"] == 0, stats
    assert caught, "no turn ended with loads in flight: the test did not test"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA streams (the CPU tier copies in order)")
def test_a_load_lands_after_the_engines_queued_kernels_on_its_block():
    """A load's copy runs on the tier's own stream: it must wait for the kernels the engine
    already queued on that device block (the last step's writes, when the block was freed by
    an abort between steps and the step ended with no sync), or they overwrite what it loaded."""
    kv = torch.zeros(4, 2, 2, 4, 1, 8, device="cuda")
    tier = HostTier(kv, 2)
    kv[1].fill_(3.0)
    assert tier.offload(b"prefix", 1, None)  # the host now holds 3s
    torch.cuda._sleep(int(5e8))  # the engine's stream is busy for a while...
    kv[1].fill_(7.0)  # ...then the last step writes the freed block
    tier.load(b"prefix", 1, demand=True)
    landed = []
    while not landed:
        tier.wait(1.0)
        landed = tier.landed()
    torch.cuda.synchronize()
    assert torch.all(kv[1] == 3.0)  # the load came after the write, as the engine asked
