"""The scheduler alone (block manager + scheduler, no model): who gets the step's budget and
the pool, in what order, and that no request waits for ever on one behind it."""

from __future__ import annotations

import pytest
import torch

from kvshare.kinds import FORKKV_LORA, AdapterKind, kind_spec
from kvshare.serve.engine.admission import WorkflowAdmission
from kvshare.serve.cache import BlockManager, HostTier
from kvshare.serve.cache.block_manager import PrefixLoading
from kvshare.serve.cache.residual import ResidualCache
from kvshare.serve.hints import AgentHints
from kvshare.serve.sampling_params import SamplingParams
from kvshare.serve.engine.scheduler import Scheduler
from kvshare.serve.sequence import Sequence, Status

BS = 2
_clock = iter(range(1, 10_000))


def seq(tokens, name, max_tokens=1, spec=None, digest=None, hints=None) -> Sequence:
    """A request that arrives after every one made before it."""
    s = Sequence(name, list(tokens), SamplingParams(max_tokens=max_tokens), arrival=float(next(_clock)))
    if spec is not None:
        s.spec, s.adapter_digest = spec, digest
    if hints is not None:
        s.hints = hints
    return s


def planned(plan) -> list[str]:
    return [p.seq.request_id for p in plan]


def running(scheduler: Scheduler, manager: BlockManager, *sequences: Sequence) -> None:
    """Put already-allocated sequences in the running list, as if admitted earlier."""
    for s in sequences:
        if not s.block_table:
            manager.allocate(s)
        s.status = Status.RUNNING
        scheduler.running.append(s)


def decoding(s: Sequence, output: int = 9) -> Sequence:
    """A sequence whose prompt is computed and that sampled one token: it decodes next."""
    s.num_computed, s.output = len(s.prompt), [output]
    return s


def test_a_new_workflow_waits_behind_an_earlier_held_one():
    """First come, first served among new workflows: a small one arriving later does not take
    the room a large held one waits for; calls of admitted workflows still go first."""
    manager = BlockManager(64, 4, "sha256:base")
    admission = WorkflowAdmission(lambda: 64, 4)
    scheduler = Scheduler(manager, 512, 16, admission=admission)
    ahead = {"b": 1}
    scheduler.add(seq(range(150), "w0-a", 10, hints=AgentHints("w0", "a", steps_to_execution=ahead)))
    scheduler.postprocess(scheduler.schedule(), [], lambda q: None)
    assert admission.running("w0")
    scheduler.add(seq(range(1000, 1100), "w1-a", 10, hints=AgentHints("w1", "a", steps_to_execution=ahead)))
    scheduler.add(seq(range(2000, 2020), "w2-a", 4, hints=AgentHints("w2", "a", steps_to_execution=ahead)))
    scheduler.add(seq(range(3000, 3008), "w0-b", 4, hints=AgentHints("w0", "b", steps_to_execution={})))
    plan = scheduler.schedule()
    assert not admission.running("w1") and not admission.running("w2")
    assert "w0-b" in planned(plan) and "w2-a" not in planned(plan)


def test_a_request_waiting_on_a_shared_prefix_holds_nobody_up():
    """The second of two same-prompt requests waits for the first's blocks to be published;
    a different request behind it is admitted meanwhile, and the second then shares them."""
    manager = BlockManager(16, BS, "sha256:base")
    scheduler = Scheduler(manager, 64, 8)
    first, second, other = seq(range(1, 9), "first"), seq(range(1, 9), "second"), seq([100, 101, 102], "other")
    for s in (first, second, other):
        scheduler.add(s)
    plan = scheduler.schedule()
    assert planned(plan) == ["first", "other"]
    scheduler.postprocess(plan, [], lambda q: None)  # the model ran: their prompts are computed
    scheduler.schedule()
    assert second in scheduler.running and second.num_computed == 8  # all eight prompt tokens reused


def test_running_requests_get_the_leftover_budget_before_waiting_ones():
    """An ICaRus decode needs two rows; with one left it waits, and the younger plain decode
    behind it (one row) gets the row, not a newly arrived request."""
    manager = BlockManager(32, BS, "sha256:base")
    scheduler = Scheduler(manager, 4, 8)
    oldest = seq([20, 21, 22], "oldest")
    icarus = seq([10, 11, 12, 13], "icarus", spec=kind_spec(AdapterKind.ICARUS), digest="sha256:ic")
    younger = seq([30], "younger")
    running(scheduler, manager, oldest, icarus, younger)
    decoding(oldest)
    decoding(younger)
    icarus.num_computed = 3  # one prompt token left: it samples, so it takes the adapter's row too
    scheduler.add(seq([40], "new"))
    scheduler.max_batched_tokens = 2  # one row left after the oldest's decode
    plan = scheduler.schedule()
    assert planned(plan) == ["oldest", "younger"]
    assert scheduler.waiting[0].request_id == "new"


def test_a_prompt_chunk_short_of_its_end_takes_every_row_left():
    """An ICaRus prompt's read-only adapter row comes with its last position only: a chunk
    that stops short of it spends the whole budget on tokens."""
    manager = BlockManager(32, BS, "sha256:base")
    scheduler = Scheduler(manager, 5, 8)
    icarus = seq(range(1, 11), "icarus", spec=kind_spec(AdapterKind.ICARUS), digest="sha256:ic")
    scheduler.add(icarus)
    plan = scheduler.schedule()
    assert [(p.n_compute, p.num_rows) for p in plan] == [(5, 5)]
    scheduler.max_batched_tokens = 6  # the 5 tokens left, each a row, and the adapter's sampling row
    icarus.num_computed = 5
    assert [(p.n_compute, p.num_rows) for p in scheduler.schedule()] == [(5, 6)]


def test_a_short_residual_pool_stalls_only_forkkv_requests():
    """ForkKV's residual pool is full: its newest ForkKV request waits, and the plain request
    younger than it (which needs no residual block) still runs this step, as does a plain
    request that arrives now; a ForkKV one that arrives now waits."""
    manager = BlockManager(32, BS, "sha256:base", residual=ResidualCache(4, BS, "sha256:base"))
    scheduler = Scheduler(manager, 64, 8)
    first = seq([1, 2, 3], "first", spec=FORKKV_LORA, digest="sha256:a")
    second = seq([4, 5, 6, 7], "second", spec=FORKKV_LORA, digest="sha256:a")
    plain = seq([50], "plain")
    running(scheduler, manager, first, second, plain)
    scheduler.add(seq([70], "late-forkkv", spec=FORKKV_LORA, digest="sha256:a"))
    scheduler.add(seq([60, 61], "late-plain"))
    decoding(first)
    decoding(second)  # a fifth token: a third residual block, none left
    plan = scheduler.schedule()
    assert planned(plan) == ["first", "plain", "late-plain"]
    assert second.status == Status.WAITING and second.preemptions == 1


def _publish(manager: BlockManager, tokens, name: str) -> None:
    s = seq(tokens, name)
    manager.allocate(s)
    s.num_computed = len(s)
    manager.register_computed(s)
    manager.free(s)


def test_pins_of_a_request_behind_never_starve_the_first_in_line():
    """Two waiting requests load their prefixes back from the host tier; once landed, the
    first is short of blocks because the second's pins hold them. Nothing runs that would
    release them: the first takes them back and runs."""
    kv = torch.zeros(6, 1, 2, BS, 1, 4)  # (blocks, layers, K/V, block size, kv heads, head dim)
    manager = BlockManager(6, BS, "sha256:base", host_tier=HostTier(kv, 16, bandwidth_gbps=1e6))
    _publish(manager, [1, 2, 3, 4], "a")
    _publish(manager, [20, 21, 22, 23], "b")
    _publish(manager, range(30, 42), "c")  # six blocks: a's and b's go to the host tier
    scheduler = Scheduler(manager, 64, 8)
    first, behind = seq(range(1, 12), "first"), seq([20, 21, 22, 23, 24, 25], "behind")
    scheduler.add(first)
    scheduler.add(behind)
    assert scheduler.schedule() == []  # both wait on loads
    while manager.loads_in_flight():
        manager.wait_for_loads(1.0)
        manager.poll_loads()
    assert "first" in planned(scheduler.schedule())
    assert first.num_computed == 4  # its loaded-back prefix



def _land(manager: BlockManager) -> None:
    while manager.loads_in_flight():
        manager.wait_for_loads(1.0)
        manager.poll_loads()


_evictions = iter(range(1000, 100_000, 100))


def _evict_all(manager: BlockManager) -> None:
    """Six blocks of a new prompt: every idle block of the six goes to the host tier."""
    start = next(_evictions)
    _publish(manager, range(start, start + 12), f"evict{start}")


def _host_tier_manager() -> BlockManager:
    """Six device blocks; the prompt [1, 2, 3, 4] (two blocks) pushed out to the host tier."""
    kv = torch.zeros(6, 1, 2, BS, 1, 4)  # (blocks, layers, K/V, block size, kv heads, head dim)
    manager = BlockManager(6, BS, "sha256:base", host_tier=HostTier(kv, 16, bandwidth_gbps=1e6))
    _publish(manager, [1, 2, 3, 4], "a")
    _evict_all(manager)
    return manager


def test_host_hits_count_the_loaded_blocks_a_request_resumes_from_once():
    """A request whose pins were given back before it ran loads its prefix again: every load
    used to count, and host hits came out above all hits."""
    manager = _host_tier_manager()
    s = seq([1, 2, 3, 4, 5], "s")
    for _ in range(2):
        with pytest.raises(PrefixLoading):
            manager.allocate(s)
        manager.release_pins()  # room needed elsewhere: its pins go before it is admitted
        _land(manager)
        _evict_all(manager)  # its landed blocks leave again
    with pytest.raises(PrefixLoading):
        manager.allocate(s)
    _land(manager)
    manager.allocate(s)
    assert s.num_computed == 4
    assert manager.stats.hit_tokens == 4 and manager.stats.host_hit_tokens == 4


def test_a_failed_copy_back_is_recomputed_and_the_tier_lives_on(monkeypatch):
    """A copy from the host that raised killed the tier's thread: the request waited on it
    forever. Now its keys leave the tier, the request computes the prefix, and loads work."""
    manager = _host_tier_manager()
    tier = manager.tier
    copy = tier._copy_in
    monkeypatch.setattr(tier, "_copy_in", lambda transfer: (_ for _ in ()).throw(RuntimeError("link down")))
    s = seq([1, 2, 3, 4, 5], "s")
    with pytest.raises(PrefixLoading):
        manager.allocate(s)
    _land(manager)
    assert tier.stats.loaded_blocks == 0
    manager.allocate(s)  # nothing left to load: computed from its first block
    assert s.num_computed == 0 and manager.stats.host_hit_tokens == 0
    s.num_computed = len(s)
    manager.register_computed(s)
    manager.free(s)
    assert manager.pool.num_referenced() == 0
    monkeypatch.setattr(tier, "_copy_in", copy)
    _evict_all(manager)
    again = seq([1, 2, 3, 4, 6], "again")
    with pytest.raises(PrefixLoading):
        manager.allocate(again)
    _land(manager)
    manager.allocate(again)
    assert again.num_computed == 4 and tier.stats.loaded_blocks == 2


def test_an_aborted_request_waiting_on_anothers_loads_is_forgotten():
    """It pinned nothing (the other request's loads fill every block it needs) but was listed
    as waiting on pins; removing it left it there, prompt and all."""
    manager = _host_tier_manager()
    scheduler = Scheduler(manager, 64, 8)
    first, second = seq([1, 2, 3, 4, 5], "first"), seq([1, 2, 3, 4, 6], "second")
    scheduler.add(first)
    scheduler.add(second)
    assert scheduler.schedule() == []
    assert "second" in manager.pinned_seqs and not second.pinned
    scheduler.remove(second)
    assert "second" not in manager.pinned_seqs
    _land(manager)
    assert planned(scheduler.schedule()) == ["first"]
