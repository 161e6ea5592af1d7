"""Workflow admission (``workflow_admission=True``): a new workflow's call waits while the
running workflows' contexts fill the pool, admitted workflows' calls go first, and it changes
the order of work only, never a token."""

from __future__ import annotations

import time

import pytest

from kvshare.errors import KvshareError
from kvshare.serve import LLMEngine, SamplingParams
from kvshare.serve.http.metrics import ServerMetrics

from test_engine import base, prompts_for, tokenizer  # noqa: F401

# 64 blocks of 4 tokens: two workflows of 100-token contexts fit (26 blocks each), three do not
SETTINGS = dict(kv_cache_tokens=256, block_size=4, compile="off")
PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)


def _context(tokenizer, i: int) -> list[int]:
    return (sum(prompts_for(tokenizer, 3), []) * 4)[i: i + 100]


def _hints(workflow: str, agent: str, next_agent: str | None) -> dict:
    """The agent's call; ``next_agent`` is due next (None: the workflow's last call)."""
    return {"workflow_id": workflow, "agent_id": agent,
            "steps_to_execution": {next_agent: 1} if next_agent else {}}


def _run(engine: LLMEngine, until=None) -> dict:
    """Step until ``until(done)`` (default: nothing left); the finished calls' tokens by id."""
    done = {}
    for _ in range(500):  # a held call that is never admitted fails here instead of hanging
        if (until(done) if until else not engine.has_unfinished()):
            return done
        done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    raise AssertionError("the engine did not get there in 500 steps")


def test_a_third_workflow_waits_until_one_of_two_ends(base, tokenizer):
    engine = LLMEngine(base, workflow_admission=True, **SETTINGS)
    first = {w: engine.add_request(_context(tokenizer, i), PARAMS, hints=_hints(w, "a", "b"))
             for i, w in enumerate(["w0", "w1", "w2"])}
    engine.step()
    waiting = lambda: {seq.request_id for seq in engine._scheduler.waiting}  # noqa: E731
    assert waiting() == {first["w2"]}  # the pool holds two contexts: the third workflow waits
    done = _run(engine, lambda done: first["w0"] in done and first["w1"] in done)
    engine.step()
    assert waiting() == {first["w2"]}  # w0 and w1 are still live: agent b is due next
    last = [engine.add_request(_context(tokenizer, i) + done[first[w]], PARAMS, hints=_hints(w, "b", None))
            for i, w in enumerate(["w0", "w1"])]
    done = _run(engine, lambda done: set(last) <= set(done))
    assert first["w2"] not in done  # held until a workflow ended
    _run(engine)
    stats = engine.stats()
    assert stats["admission_holds"] >= 2 and stats["workflows_admitted"] == 1  # w2, live: agent b is due


def test_admitted_workflows_calls_overtake_a_held_one(base, tokenizer):
    """A held new workflow does not block the next calls of the admitted ones behind it."""
    engine = LLMEngine(base, workflow_admission=True, **SETTINGS)
    first = {w: engine.add_request(_context(tokenizer, i), PARAMS, hints=_hints(w, "a", "b"))
             for i, w in enumerate(["w0", "w1"])}
    done = _run(engine)
    held = engine.add_request(_context(tokenizer, 2), PARAMS, hints=_hints("w2", "a", "b"))
    follow = engine.add_request(_context(tokenizer, 0) + done[first["w0"]], PARAMS, hints=_hints("w0", "b", "a"))
    engine.step()
    running = {s.request_id for s in engine._scheduler.running}
    assert follow in running and held not in running


def test_calls_without_a_workflow_are_never_held(base, tokenizer):
    engine = LLMEngine(base, workflow_admission=True, **SETTINGS)
    for i, w in enumerate(["w0", "w1"]):
        engine.add_request(_context(tokenizer, i), PARAMS, hints=_hints(w, "a", "b"))
    anonymous = engine.add_request(_context(tokenizer, 2)[:20], PARAMS)
    engine.step()
    assert anonymous in {s.request_id for s in engine._scheduler.running}


def test_a_workflow_gone_idle_frees_its_place(base, tokenizer):
    engine = LLMEngine(base, workflow_admission=True, workflow_idle_s=2.0, **SETTINGS)
    for i, w in enumerate(["w0", "w1"]):
        engine.add_request(_context(tokenizer, i), PARAMS, hints=_hints(w, "a", "b"))
    _run(engine)  # both stay live: agent b is due, but never calls
    held = engine.add_request(_context(tokenizer, 2), PARAMS, hints=_hints("w2", "a", "b"))
    engine.step()
    assert held in {s.request_id for s in engine._scheduler.waiting}
    time.sleep(2.1)  # w0 and w1 sent nothing for longer than workflow_idle_s
    engine.step()
    assert held not in {s.request_id for s in engine._scheduler.waiting}
    with pytest.raises(KvshareError, match="workflow_idle_s"):
        LLMEngine(base, workflow_admission=True, workflow_idle_s=0, **SETTINGS)


def test_admission_changes_no_token(base, tokenizer):
    """Four one-call workflows: two run, then the other two; the same greedy tokens as without
    admission (all four at once)."""
    outputs = []
    for admission in (True, False):
        engine = LLMEngine(base, workflow_admission=admission, **SETTINGS)
        ids = [engine.add_request(_context(tokenizer, i), PARAMS, hints=_hints(f"w{i}", "a", None)) for i in range(4)]
        done = _run(engine)
        outputs.append([done[i] for i in ids])
        assert not admission or engine.stats()["admission_holds"] >= 1
    assert outputs[0] == outputs[1]


def test_workflows_count_at_least_the_footprint_of_those_that_ended(base, tokenizer):
    """A workflow that ended after growing its context to 51 blocks teaches the estimate: two
    new workflows whose first calls need 26 blocks each no longer both fit the 64-block pool
    (each will grow as that one did)."""
    engine = LLMEngine(base, workflow_admission=True, **SETTINGS)
    a = engine.add_request(_context(tokenizer, 0), PARAMS, hints=_hints("w0", "a", "b"))
    done = _run(engine)
    grown = (_context(tokenizer, 0) + done[a]) * 2
    engine.add_request(grown[:200], PARAMS, hints=_hints("w0", "b", None))
    _run(engine)
    assert engine._scheduler.admission.workflows["w0"].footprint() == 51
    first = [engine.add_request(_context(tokenizer, i), PARAMS, hints=_hints(w, "a", "b"))
             for i, w in enumerate(["w1", "w2"], start=1)]
    engine.step()
    assert engine._scheduler.admission.ended[-1] == 51
    assert {s.request_id for s in engine._scheduler.waiting} == {first[1]}


def test_a_growing_workflow_counts_the_calls_its_schedule_names_before_any_workflow_ended(base, tokenizer):
    """w0's context grew from its first call to its second and its schedule names three more
    calls: it counts as its footprint plus three times that growth. A new workflow's first call
    (26 blocks, three calls ahead) is held beside it, although no workflow has ended and the
    footprints alone (w0's and the first call's) fit the 64-block pool; once w0 ends it runs."""
    engine = LLMEngine(base, workflow_admission=True, **SETTINGS)
    admission = engine._scheduler.admission
    ahead = {"workflow_id": "w0", "steps_to_execution": {"b": 1, "c": 2, "d": 3}}
    a = engine.add_request(_context(tokenizer, 0), PARAMS, hints={**ahead, "agent_id": "a"})
    done = _run(engine)
    grown = (_context(tokenizer, 0) + done[a] + _context(tokenizer, 5))[:120]
    b = engine.add_request(grown, PARAMS, hints={"workflow_id": "w0", "agent_id": "b",
                                                 "steps_to_execution": {"c": 1, "d": 2, "e": 3}})
    done = _run(engine)
    w0 = admission.workflows["w0"]
    assert w0.growth() >= 5 and w0.calls_to_grow() == 3 and not admission.ended
    assert w0.footprint() + 26 <= 64  # on footprints alone, the new workflow would run
    held = engine.add_request(_context(tokenizer, 1), PARAMS,
                              hints={"workflow_id": "w1", "agent_id": "a", "steps_to_execution": {"b": 1, "c": 2, "d": 3}})
    engine.step()
    assert held in {s.request_id for s in engine._scheduler.waiting} and admission.held == 1
    last = engine.add_request(grown + done[b], PARAMS, hints={"workflow_id": "w0", "agent_id": "c",
                                                              "steps_to_execution": {}})
    done = _run(engine)
    assert {last, held} <= set(done)


def test_calls_ahead_of_a_schedule():
    from kvshare.serve.engine.admission import calls_ahead

    assert calls_ahead(None) == calls_ahead({}) == 0
    assert calls_ahead({"b": 1, "c": 2, "d": 3}) == 3  # a chain
    assert calls_ahead({**{f"map{i}": 1 for i in range(7)}, "reduce": 2}) == 8  # seven at once, then one
    assert calls_ahead({"a": 4}) == 4  # three calls of others before it


def test_held_calls_never_crowd_a_running_workflow_out_of_the_queue(base, tokenizer):
    """The server's queue is full of a new workflow's held call: a call of a running workflow
    still gets in (and runs); one of another new workflow is refused."""
    import asyncio

    from kvshare.serve.driver.engine_thread import AsyncEngine, Overloaded

    engine = LLMEngine(base, workflow_admission=True, **SETTINGS)
    for i, w in enumerate(["w0", "w1"]):
        engine.add_request(_context(tokenizer, i), PARAMS, hints=_hints(w, "a", "b"))
    _run(engine)  # both running: agent b is due next
    engine.add_request(_context(tokenizer, 2), PARAMS, hints=_hints("w2", "a", "b"))  # held
    assert engine.num_held() == 1 and engine.workflow_running("w0") and not engine.workflow_running("w2")
    engine.step()
    metrics = ServerMetrics(engine).render().decode()
    assert "kvshare_admission_held_waiting 1.0" in metrics and "kvshare_admission_holds_total 1.0" in metrics
    runner = AsyncEngine(engine, max_waiting=1)

    async def call(workflow):
        stream = runner.generate(_context(tokenizer, 0), PARAMS, hints=_hints(workflow, "b", "a"))  # w0 goes on
        return [out async for out in stream][-1]

    try:
        assert runner.has_room(workflow_id="w0") and not runner.has_room(workflow_id="w3") and not runner.has_room()
        assert len(asyncio.run(call("w0")).token_ids) == PARAMS.max_tokens
        assert engine.num_held() == 1  # w2's call: still held behind w0 and w1
        with pytest.raises(Overloaded):
            asyncio.run(call("w3"))
        # nothing runs and the held call waits: the engine thread waits too, it does not spin
        # (each empty step counts one hold; spinning counted thousands a second)
        holds = engine.stats()["admission_holds"]
        time.sleep(0.5)
        assert engine.stats()["admission_holds"] - holds <= 20
    finally:
        runner.shutdown()



def test_co_located_engines_admit_by_the_blocks_they_hold_now(base, tokenizer):
    """Co-located engines are built with one block and given their share of the arena after:
    admission sizes the pool when it decides, not when the engine was built (it held every
    second workflow back behind the first)."""
    from kvshare.serve.driver.colocation import colocate
    from kvshare.serve.config import EngineConfig

    config = EngineConfig(block_size=4, compile="off", workflow_admission=True)
    colo = colocate([(str(base), [], config.updated(kv_cache_tokens=256), "a"),
                     (str(base), [], config.updated(kv_cache_tokens=64), "b")], lending=True)
    engine = colo.engines["a"]
    ids = [colo.add_request("a", _context(tokenizer, i), PARAMS, hints=_hints(w, "a", "b"))
           for i, w in enumerate(["w0", "w1"])]
    colo.step()
    assert not engine._scheduler.waiting and engine.stats()["admission_holds"] == 0, ids
    while colo.has_unfinished():
        colo.step()


def test_forget_workflows_starts_admission_afresh(base, tokenizer):
    """What a benchmark calls between points: the footprints learned at one point must not
    decide who waits at the next."""
    engine = LLMEngine(base, workflow_admission=True, **SETTINGS)
    engine.add_request(_context(tokenizer, 0), PARAMS, hints=_hints("w0", "a", "b"))
    with pytest.raises(KvshareError, match="in the engine"):
        engine.forget_workflows()
    _run(engine)
    engine.add_request(_context(tokenizer, 0), PARAMS, hints=_hints("w0", "b", None))
    _run(engine)
    engine.add_request(_context(tokenizer, 1), PARAMS, hints=_hints("w1", "a", None))  # admitting it sees w0 ended
    _run(engine)
    admission = engine._scheduler.admission
    assert admission.ended and admission.workflows
    engine.forget_workflows()
    assert not admission.ended and not admission.workflows
