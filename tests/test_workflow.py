"""Workflow runtime: ReAct, Reflexion, MapReduce over the engine and over the server."""

from __future__ import annotations

import asyncio
import math

import pytest
from transformers import AutoTokenizer

from kvshare.serve import LLMEngine
from kvshare.serve.driver.engine_thread import AsyncEngine
from kvshare.serve.workflow import (Agent, EngineBackend, RoundRobin, ServerBackend, SimulatedTool,
                                    Skewed, Workflow)

from conftest import assert_one_line_error
from test_engine import adapters, base, invocation, prompts_for, tokenizer  # noqa: F401
from test_server import KEY, server  # noqa: F401


@pytest.fixture
def runner(base, adapters):
    engine = LLMEngine(base, [adapters["icarus-a"], adapters["icarus-b"], adapters["lora-a"],
                              adapters["lora-b"], adapters["alora-a"]], kv_cache_tokens=8192, block_size=8)
    r = AsyncEngine(engine)
    yield r
    r.shutdown()


def context_ids(tokenizer) -> list[int]:
    return [t for p in prompts_for(tokenizer, 3) for t in p] * 2


def test_skewed_order_gives_the_first_agent_about_half_the_turns():
    agents = [Agent(f"a{i}", None, "r") for i in range(4)]
    order = Skewed(agents, seed=1)
    picks = [order.pick(t).name for t in range(400)]
    assert 0.4 < picks.count("a0") / 400 < 0.6
    assert {"a1", "a2", "a3"} <= set(picks)
    assert RoundRobin(agents).pick(5).name == "a1"


def test_react_with_icarus_agents_reuses_the_shared_history(runner, tokenizer):
    agents = [Agent("planner", "icarus-a", "You plan."), Agent("checker", "icarus-b", "You check.")]
    flow = Workflow(0, EngineBackend(runner), context_ids(tokenizer), max_tokens=6,
                    tool=SimulatedTool(delay_s=0.01, observation_tokens=8))
    asyncio.run(flow.react(RoundRobin(agents), turns=4))
    assert [r.agent for r in flow.records] == ["planner", "checker", "planner", "checker"]
    # from the second turn on, every full block the previous agent computed (its prompt and
    # its generated tokens, but the last one) is served from the cache
    for before, record in zip(flow.records, flow.records[1:]):
        assert record.cached_tokens == (before.prompt_tokens + before.completion_tokens - 1) // 8 * 8
    hints = [h for _, h in runner.engine.hints_log][-4:]
    assert [h.agent_id for h in hints] == ["planner", "checker", "planner", "checker"]
    assert len({h.workflow_id for h in hints}) == 1
    # read off the ReAct step graph: the other agent is next (1), the caller two turns on
    assert hints[0].steps_to_execution == {"checker": 1, "planner": 2}
    assert hints[-1].steps_to_execution == {}  # the last turn: nobody runs after it


def test_react_with_lora_agents_cannot_share(runner, tokenizer):
    agents = [Agent("planner", "lora-a", "You plan."), Agent("checker", "lora-b", "You check.")]
    flow = Workflow(0, EngineBackend(runner), context_ids(tokenizer), max_tokens=6)
    asyncio.run(flow.react(RoundRobin(agents), turns=2))
    assert all(r.cached_tokens == 0 for r in flow.records)


def test_reflexion_and_mapreduce_run(runner, tokenizer, invocation):
    actor, critic = Agent("actor", "icarus-a", "Answer."), Agent("critic", "alora-a", "", tuple(invocation))
    flow = Workflow(1, EngineBackend(runner), context_ids(tokenizer), max_tokens=4)
    asyncio.run(flow.reflexion(actor, critic, rounds=2))
    assert [r.agent for r in flow.records] == ["actor", "critic"] * 2
    mappers = [Agent(f"m{i}", "icarus-a" if i % 2 else "icarus-b", f"Part {i}.") for i in range(3)]
    flow = Workflow(2, EngineBackend(runner), context_ids(tokenizer), max_tokens=4)
    asyncio.run(flow.mapreduce(mappers, Agent("reducer", None, "Combine.")))
    assert sorted(r.agent for r in flow.records[:3]) == ["m0", "m1", "m2"]
    assert flow.records[-1].agent == "reducer" and flow.records[-1].cached_tokens > 0


def test_react_against_the_server(server, tokenizer):
    backend = ServerBackend(server["url"] + "/v1", KEY, "tiny-base", tokenizer, ignore_eos=True)
    agents = [Agent("planner", "icarus-a", "You plan."), Agent("base", None, "You summarise.")]
    flow = Workflow(3, backend, context_ids(tokenizer)[:40], max_tokens=5)
    asyncio.run(flow.react(RoundRobin(agents), turns=2))
    assert [r.agent for r in flow.records] == ["planner", "base"]
    # the server's count (its text, encoded again, need not have 5 tokens)
    assert all(r.completion_tokens == 5 and r.latency >= r.ttft >= 0 for r in flow.records)
    sent = [h for _, h in server["engine"].hints_log if h.workflow_id == flow.workflow_id]
    assert [h.agent_id for h in sent] == ["planner", "base"]
    # the second call (base) reads the first's shared history from cache: the usage chunk says so
    assert 0 < flow.records[1].cached_tokens <= flow.records[1].prompt_tokens


def test_react_against_the_server_with_text_prompts(server, tokenizer):
    """For routers that take no token ids: prompts go as text, the server tokenises them."""
    backend = ServerBackend(server["url"] + "/v1", KEY, "tiny-base", tokenizer, text_prompts=True)
    agents = [Agent("planner", "icarus-a", "You plan."), Agent("base", None, "You summarise.")]
    flow = Workflow(4, backend, tokenizer.encode("Rome was founded on seven hills. " * 6), max_tokens=5)
    asyncio.run(flow.react(RoundRobin(agents), turns=2))
    assert all(r.completion_tokens > 0 for r in flow.records)
    assert flow.records[1].cached_tokens > 0  # ICaRus and base share the history's blocks


@pytest.mark.parametrize("code,sent,in_stream", [(500, 2, True), (400, 1, True), (400, 1, False)])
def test_a_call_failed_inside_its_stream_is_sent_again_only_for_a_server_error(tokenizer, code, sent, in_stream):
    """A replica that fails a call after its first token sends an error event in the stream
    (as vLLM does); the OpenAI client raises a plain APIError for it. A 5xx there is retried
    like a 5xx status; a 4xx (the request itself), in the stream or as the status, is not."""
    import json

    import httpx2
    import openai

    posts = []

    def event(data: dict) -> str:
        return f"data: {json.dumps(data)}\n\n"

    def chunk(text: str, usage: dict | None = None) -> dict:
        choices = [] if usage else [{"index": 0, "text": text, "finish_reason": None, "logprobs": None}]
        return {"id": "c", "object": "text_completion", "created": 0, "model": "m", "choices": choices,
                "usage": usage}

    def handler(request):
        posts.append(request)
        error = {"message": "boom", "type": "server_error", "param": None, "code": code}
        if len(posts) == 1 and not in_stream:
            return httpx2.Response(code, json={"error": error})
        if len(posts) == 1:
            body = event(chunk("a")) + event({"error": error})
        else:
            body = event(chunk("ok")) + event(chunk("", {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}))
        return httpx2.Response(200, headers={"content-type": "text/event-stream"}, content=(body + "data: [DONE]\n\n"))

    backend = ServerBackend("http://replica/v1", KEY, "m", tokenizer, retries=1, retry_delay_s=0)
    backend.client = openai.AsyncOpenAI(base_url="http://replica/v1", api_key=KEY, max_retries=0,
                                        http_client=httpx2.AsyncClient(transport=httpx2.MockTransport(handler)))
    call = backend.complete([1, 2], None, 4, {"workflow_id": "w", "agent_id": "a"})
    if code >= 500:
        asyncio.run(call)
        assert backend.calls[-1]["attempts"] == 2
    else:
        with pytest.raises(openai.APIError):
            asyncio.run(call)
    assert len(posts) == sent


def test_workflow_benchmark_runs_every_mode_and_writes_its_report(tiny_models, tmp_path, monkeypatch):
    """Figures are printed, not asserted; what is asserted is what must hold regardless of speed."""
    from kvshare.eval.perf import workflow
    from kvshare.eval.perf.workflow import run_workflow_bench, sharing_ratios

    budgets = []  # each kvshare engine's rows per step, as its scheduler got them

    class Recording(workflow.LLMEngine):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            budgets.append(self._scheduler.max_batched_tokens)

    monkeypatch.setattr(workflow, "LLMEngine", Recording)
    results = run_workflow_bench(model=str(tiny_models("llama")), agents=(2,), qps=(50.0,),
                                 modes=("icarus", "alora", "lora", "base", "hf"), workflows=2, turns=3,
                                 context_tokens=64, max_tokens=4, out_dir=tmp_path, max_num_batched_tokens=48)
    by_mode = {p["mode"]: p for p in results["points"]}
    assert results["max_num_batched_tokens"] == 48 and budgets == [48] * 5  # prompts of 64+ tokens ran in chunks
    assert set(by_mode) == {"icarus", "alora", "lora", "base", "hf"}
    assert all(p["calls"] == 6 and p["tokens_per_s"] > 0 for p in by_mode.values())
    records = by_mode["icarus"]["call_records"]  # every call, in turn order per workflow
    assert [(r["workflow"], r["turn"]) for r in records] == [(w, t) for w in range(2) for t in range(3)]
    assert min(r["start_s"] for r in records) == 0 and all(r["latency_s"] >= r["ttft_s"] > 0 for r in records)
    assert max(r["latency_s"] for r in records) <= by_mode["icarus"]["makespan_s"]
    assert by_mode["icarus"]["hit_rate"] > by_mode["lora"]["hit_rate"]
    assert by_mode["base"]["hit_rate"] > by_mode["lora"]["hit_rate"]  # the base shares as ICaRus does
    assert by_mode["icarus"]["compiled"] is False and "compiled" not in by_mode["hf"]  # the suite runs eager
    [ratios] = sharing_ratios(results["points"])
    assert ratios["icarus_over_base_tokens_per_s"] == pytest.approx(
        by_mode["icarus"]["tokens_per_s"] / by_mode["base"]["tokens_per_s"])
    assert "ICaRus / base tok/s" in (tmp_path / "workflow_bench.md").read_text()
    for name in ("workflow_bench.json", "workflow_bench.md", "p95_vs_qps.png", "throughput_vs_qps.png"):
        assert (tmp_path / name).stat().st_size > 0


@pytest.mark.parametrize("pattern,calls", [("skewed", 3), ("reflexion", 2), ("mapreduce", 3)])
def test_workflow_benchmark_runs_the_briefs_other_patterns(tiny_models, pattern, calls):
    """Skewed ReAct, Reflexion (actor, critic) and MapReduce (two mappers, one reducer) through
    the same engine: every call runs, ICaRus agents share the context as in ReAct."""
    from kvshare.eval.perf.workflow import run_workflow_bench

    agents = 3 if pattern == "mapreduce" else 2
    results = run_workflow_bench(model=str(tiny_models("llama")), agents=(agents,), qps=(50.0,),
                                 modes=("icarus", "lora"), workflows=2, turns=3, context_tokens=64, max_tokens=4,
                                 pattern=pattern)
    by_mode = {p["mode"]: p for p in results["points"]}
    assert results["pattern"] == pattern and all(p["calls"] == 2 * calls for p in by_mode.values())
    assert by_mode["icarus"]["hit_rate"] > by_mode["lora"]["hit_rate"]
    if pattern == "mapreduce":  # the mappers (agents 0, 1) before the reducer (agent 2)
        records = by_mode["icarus"]["call_records"]
        assert sorted(r["agent"] for r in records if r["workflow"] == 0) == ["agent0", "agent1", "agent2"]


def test_workflow_benchmark_refuses_a_pattern_its_agents_cannot_run(cli):
    assert_one_line_error(cli("bench", "workflow", "--pattern", "reflexion", "--agents", "1"),
                          "reflexion pattern needs at least 2 agents")


def test_workflow_benchmark_with_workflow_admission_finishes_every_call(tiny_models):
    """Four workflows arriving at once into a pool that holds three first calls:
    later ones are held until earlier ones end, and every call still runs."""
    from kvshare.eval.perf.workflow import run_workflow_bench

    results = run_workflow_bench(model=str(tiny_models("llama")), agents=(2,), qps=(1000.0,), modes=("icarus",),
                                 workflows=4, turns=3, context_tokens=64, max_tokens=4, kv_cache_tokens=288,
                                 workflow_admission=True)
    [point] = results["points"]
    assert results["workflow_admission"] and point["calls"] == 12 and point["admission_holds"] >= 1


def test_alora_benchmark_runs_and_alora_evaluators_reuse_the_base_kv(tiny_models, tmp_path):
    from kvshare.eval.perf.alora import run_alora_bench

    results = run_alora_bench(model=str(tiny_models("llama")), lengths=(64, 128), evaluators=2,
                              new_tokens=4, out_dir=tmp_path)
    rows = {(r["mode"], r["prompt_tokens"]): r for r in results["rows"]}
    for length in (64, 128):
        assert rows[("alora", length)]["eval_hit_rate"] > 0.8  # x + y came from the base's cache
        assert rows[("lora", length)]["eval_hit_rate"] == 0.0
    assert (tmp_path / "alora_bench.md").read_text().startswith("| prompt tokens |")


@pytest.mark.parametrize("args,message", [
    (["--qps", "0"], "--qps must be > 0"), (["--agents", "0"], "--agents must be > 0"),
    (["--turns", "0"], "--turns must be at least 1"), (["--workflows", "0"], "--workflows must be at least 1"),
    (["--ray", "2", "--workflow-admission"], "--ray does not take --workflow-admission"),
    (["--ray", "2", "--kernels", "int8"], "--ray does not take --kernels")])
def test_a_workload_the_benchmark_cannot_run_is_one_line_error(cli, args, message):
    assert_one_line_error(cli("bench", "workflow", *args), message)


def test_percentiles_are_nearest_rank():
    from kvshare.eval.perf.common import percentile

    values = list(range(1, 33))  # 32 calls: P95 is the 31st value (30.4 rounded up), P50 the 16th
    assert percentile(values, 0.95) == 31 and percentile(values, 0.5) == 16 and percentile(values, 1.0) == 32
    assert percentile([4, 1, 3, 2], 0.5) == 2 and percentile([7], 0.99) == 7 and percentile([5, 1], 0.0) == 1
    assert math.isnan(percentile([], 0.5))
