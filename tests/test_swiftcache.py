"""SwiftCache's elastic cache: co-located engines in one block-major arena lend each other
idle blocks. Lending moves ownership, never bytes; a block is never used by two engines;
outputs from borrowed memory equal those from a private pool, for every adapter kind, also
when the lender takes its blocks back mid-generation (the borrower recomputes)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from kvshare.errors import KvshareError
from kvshare.serve import LLMEngine, SamplingParams
from kvshare.serve.cache.arena import BlockShape, KVArena
from kvshare.serve.driver.lending import Lending
from kvshare.serve.driver.colocation import colocate
from kvshare.serve.config import EngineConfig
from kvshare.serve.driver.lender import EngineLender, build_arena, lenders_of

from test_engine import adapters, base, invocation, prompts_for, tokenizer  # noqa: F401

GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)


def engines_in_arena(base, adapters, homes: dict[str, int], block_sizes: dict[str, int] | None = None,
                     lending: bool = True, **lend_args) -> tuple[dict[str, LLMEngine], KVArena, Lending | None]:
    """Engines of the tiny model (each with every adapter) sharing one arena; ``homes``: each
    one's static share in its own blocks."""
    block_sizes = block_sizes or {}
    engines = {name: LLMEngine(base, list(adapters.values()), kv_cache_tokens=16,
                               block_size=block_sizes.get(name, 4)) for name in homes}
    lenders = lenders_of(engines)
    arena = build_arena(lenders, homes)
    return engines, arena, (Lending(arena, lenders, **lend_args) if lending else None)


def drive(engines: dict[str, LLMEngine], lending: Lending | None, check=None) -> dict[tuple[str, str], list[int]]:
    """Step every engine (one at a time, rebalancing first) until all are done; token ids of
    every finished request by (engine, request id)."""
    done = {}
    while any(e.has_unfinished() for e in engines.values()):
        if lending is not None:
            lending.rebalance()
        for name, engine in engines.items():
            if engine.has_unfinished():
                done.update({(name, o.request_id): o.token_ids for o in engine.step() if o.finished})
            if check is not None:
                check()
    return done


def private_outputs(base, adapters, requests) -> list[list[int]]:
    engine = LLMEngine(base, list(adapters.values()), kv_cache_tokens=4096, block_size=4)
    ids = [engine.add_request(p, params, adapter=a) for p, a, params in requests]
    done = drive({"solo": engine}, None)
    return [done["solo", i] for i in ids]


def assert_no_block_in_two_engines(engines: dict[str, LLMEngine], arena: KVArena) -> None:
    """Every block an engine uses or caches lies in a unit it holds, so no two engines' live
    blocks overlap in bytes."""
    spans = []
    for name, engine in engines.items():
        blocks = engine._blocks
        held = set(arena.units_held(name))
        for block_id, (refs, info) in enumerate(zip(blocks.pool.ref_count, blocks.blocks)):
            if refs or info.key is not None:
                start, end = arena.byte_range(name, block_id)
                assert start // arena.unit_bytes in held and (end - 1) // arena.unit_bytes in held, (name, block_id)
                spans.append((start, end, name))
        assert all(blocks.pool.owned[b] for b in arena.owned_blocks(name))
        assert blocks.num_blocks == len(arena.owned_blocks(name))
    spans.sort()
    for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
        assert end <= start, (a, b)


def long_prompt(tokenizer, n_tokens: int) -> list[int]:
    text = " ".join(f"item {i} weighs {i * 7 % 13} kg." for i in range(n_tokens))
    return tokenizer.encode(text, add_special_tokens=False)[:n_tokens]


# the arena ------------------------------------------------------------------------------------
def test_exchange_unit_is_the_lcm_of_block_bytes_and_every_view_is_the_same_memory():
    small = BlockShape(layers=2, kv_heads=2, head_dim=8, block_size=4, dtype=torch.float32)  # 1024 bytes
    other = BlockShape(layers=3, kv_heads=1, head_dim=8, block_size=4, dtype=torch.float32)  # 768 bytes
    arena = KVArena({"a": small, "b": other}, {"a": 3 * 3072, "b": 2 * 3072 + 100})
    assert arena.unit_bytes == math.lcm(1024, 768) == 3072
    assert arena.home == ["a"] * 3 + ["b"] * 2 and arena.blocks_per_unit("a") == 3 and arena.blocks_per_unit("b") == 4
    va, vb = arena.view("a"), arena.view("b")
    assert va.data_ptr() == vb.data_ptr() == arena.memory.data_ptr() and va.shape[0] == 15 and vb.shape[0] == 20
    for name in ("a", "b"):  # a unit is exactly its blocks' bytes
        blocks = arena.blocks(name, 3)
        assert arena.byte_range(name, blocks[0])[0] == 3 * 3072 and arena.byte_range(name, blocks[-1])[1] == 4 * 3072
    va[arena.blocks("a", 4)[0]].fill_(1.0)  # a write through one engine's view is the other's bytes
    assert vb[arena.blocks("b", 4)[0]].abs().sum() > 0 and vb[arena.blocks("b", 3)].abs().sum() == 0
    with pytest.raises(KvshareError, match="exchange unit"):
        KVArena({"a": small, "b": other}, {"a": 3000, "b": 10_000})


def test_a_layer_view_of_the_block_major_arena_reads_and_writes_by_slot():
    from kvshare.kernels.attention import gather_slots, write_kv_ref

    kv = torch.randn(6, 3, 2, 4, 2, 5)  # (blocks, layers, 2, block_size, heads, dim)
    k, v = kv[:, 1, 0], kv[:, 1, 1]
    slots = torch.tensor([0, 5, 23, 9])
    want = torch.stack([kv[s // 4, 1, 0, s % 4] for s in slots.tolist()])
    torch.testing.assert_close(gather_slots(k, slots), want, rtol=0, atol=0)
    new_k, new_v = torch.randn(4, 2, 5), torch.randn(4, 2, 5)
    before = kv.clone()
    write_kv_ref(k, v, new_k, new_v, slots)
    for row, s in enumerate(slots.tolist()):
        assert torch.equal(kv[s // 4, 1, 0, s % 4], new_k[row]) and torch.equal(kv[s // 4, 1, 1, s % 4], new_v[row])
        before[s // 4, 1, 0, s % 4], before[s // 4, 1, 1, s % 4] = new_k[row], new_v[row]
    assert torch.equal(kv, before)  # nothing else moved: other layers' bytes sit between the slots


# lending ----------------------------------------------------------------------------------------
def test_lending_moves_no_bytes_and_the_lenders_cache_survives(base, adapters, tokenizer):
    engines, arena, lending = engines_in_arena(base, adapters, {"big": 24, "small": 24})
    small, big = engines["small"], engines["big"]
    prompt = prompts_for(tokenizer, 1)[0] * 2
    request = small.add_request(prompt, GREEDY)
    cached_tokens = drive(engines, lending)["small", request]
    kept = [b for b, info in enumerate(small._blocks.blocks) if info.key is not None]
    snapshot = arena.memory.clone()
    address = arena.memory.data_ptr()
    big.add_request(long_prompt(tokenizer, 120), GREEDY)  # 33 blocks: more than its 24
    drive(engines, lending)
    assert lending.counters.units_lent > 0 and arena.units_moved > 0
    assert arena.memory.data_ptr() == address  # no new memory, no copy
    for block in kept:  # the lender's cached blocks are untouched and still hit
        start, end = arena.byte_range("small", block)
        assert torch.equal(arena.memory[start:end], snapshot[start:end])
    again = small.add_request(prompt, GREEDY)
    out = drive(engines, lending)["small", again]
    assert out == cached_tokens and small.stats()["prefix_hit_tokens"] >= len(prompt) // 4 * 4


@pytest.mark.parametrize("adapter", [None, "lora-a", "icarus-a", "alora-a"])
def test_borrowed_memory_gives_the_private_pools_tokens(base, adapters, tokenizer, invocation, adapter):
    prompt = long_prompt(tokenizer, 90) + (invocation + prompts_for(tokenizer, 1)[0] if adapter == "alora-a" else [])
    want = private_outputs(base, adapters, [(prompt, adapter, GREEDY)])
    engines, arena, lending = engines_in_arena(base, adapters, {"big": 12, "small": 36})
    request = engines["big"].add_request(prompt, GREEDY, adapter=adapter)  # needs ~29 blocks
    got = drive(engines, lending, check=lambda: assert_no_block_in_two_engines(engines, arena))
    assert got["big", request] == want[0]
    assert lending.stats()["big"]["borrowed_blocks"] > 0 or lending.counters.units_returned > 0


def test_reclaim_preempts_the_borrower_and_every_output_stays_exact(base, adapters, tokenizer):
    long = (long_prompt(tokenizer, 70), "lora-a", SamplingParams(max_tokens=24, ignore_eos=True))
    chats = [(p, "icarus-a", GREEDY) for p in prompts_for(tokenizer, 3)] * 3
    want = private_outputs(base, adapters, [long] + chats)
    engines, arena, lending = engines_in_arena(base, adapters, {"big": 8, "small": 28}, floor_fraction=0.25)
    long_id = engines["big"].add_request(long[0], long[2], adapter=long[1])
    for _ in range(3):  # the long request borrows and starts decoding
        lending.rebalance()
        engines["big"].step()
    assert lending.stats()["big"]["borrowed_blocks"] > 0
    chat_ids = [engines["small"].add_request(p, params, adapter=a) for p, a, params in chats]
    got = drive(engines, lending, check=lambda: assert_no_block_in_two_engines(engines, arena))
    assert lending.counters.units_reclaimed > 0 and lending.counters.preempted > 0
    assert [got["big", long_id]] + [got["small", i] for i in chat_ids] == want


def test_a_reclaim_takes_idle_units_before_preempting_anyone(base):
    """The borrower's busy blocks sit in the lowest units (its free list hands out the lowest
    id first): a reclaim that walked units in order would preempt it needlessly."""
    engines = {name: LLMEngine(base, kv_cache_tokens=16, block_size=4) for name in ("big", "small")}
    lenders = lenders_of(engines)
    arena = build_arena(lenders, {"big": 2, "small": 24})
    lending = Lending(arena, lenders)
    big, small = engines["big"], engines["small"]
    big.add_request(list(range(10, 70)), SamplingParams(max_tokens=2, ignore_eos=True))  # borrows, ends soon
    big.add_request(list(range(100, 110)), SamplingParams(max_tokens=60, ignore_eos=True))  # keeps decoding
    for _ in range(4):
        lending.rebalance()
        for engine in engines.values():
            if engine.has_unfinished():
                engine.step()
    assert big.num_running() == 1 and lending.stats()["big"]["borrowed_blocks"] > 4
    small.add_request(list(range(200, 252)), SamplingParams(max_tokens=4, ignore_eos=True))  # 4 units short
    lending.rebalance()
    assert lending.counters.units_reclaimed == 4 and lending.counters.preempted == 0 and big.num_running() == 1


def test_borrowed_units_go_home_after_the_peak_window(base, adapters, tokenizer):
    engines, arena, lending = engines_in_arena(base, adapters, {"big": 12, "small": 36}, peak_window=4)
    engines["big"].add_request(long_prompt(tokenizer, 90), GREEDY)
    drive(engines, lending)
    assert lending.stats()["big"]["borrowed_blocks"] > 0
    for _ in range(5):
        lending.rebalance()
    assert lending.stats()["big"]["borrowed_blocks"] == 0 and lending.counters.units_returned > 0
    assert arena.holder == arena.home


def test_random_load_never_puts_a_block_in_two_engines_and_floors_hold(base, adapters, tokenizer):
    rng = random.Random(0)
    homes = {"a": 12, "b": 8, "c": 16}
    engines, arena, lending = engines_in_arena(base, adapters, homes, block_sizes={"a": 4, "b": 8, "c": 4},
                                               floor_fraction=0.5, peak_window=3)
    kinds = [None, "lora-a", "lora-b", "icarus-a", "icarus-b"]
    pieces = [long_prompt(tokenizer, 24)] + prompts_for(tokenizer, 3)
    for step in range(60):
        if rng.random() < 0.5:
            name = rng.choice(list(engines))
            prompt = sum((rng.choice(pieces) for _ in range(rng.randint(1, 3))), [])
            engines[name].add_request(prompt, SamplingParams(max_tokens=rng.randint(1, 12), ignore_eos=True),
                                      adapter=rng.choice(kinds))
        lending.rebalance()
        for name, engine in engines.items():
            assert sum(arena.home[u] == name for u in arena.units_held(name)) >= lending.floor_units[name]
            if engine.has_unfinished():
                engine.step()
            assert_no_block_in_two_engines(engines, arena)
    drive(engines, lending, check=lambda: assert_no_block_in_two_engines(engines, arena))
    assert lending.counters.units_lent > 0


def test_a_request_longer_than_every_lendable_block_is_a_clear_error(base, adapters, tokenizer):
    engines, arena, lending = engines_in_arena(base, adapters, {"big": 8, "small": 8}, floor_fraction=0.5)
    assert engines["big"].max_kv_blocks == 12  # its 8 and the small one's 8 above its floor of 4
    with pytest.raises(KvshareError, match="co-located engines may lend"):
        engines["big"].add_request(long_prompt(tokenizer, 60), GREEDY)


def test_colocate_builds_engines_over_one_arena_and_serves_through_the_driver(base, adapters, tokenizer):

    config = EngineConfig(block_size=4)
    colo = colocate([(str(base), [], config.updated(kv_cache_tokens=48), "long"),
                     (str(base), [str(adapters["icarus-a"])], config.updated(kv_cache_tokens=160), "agents")],
                    lending=True)
    assert colo.stats()["long"]["owned_blocks"] == 12 and colo.stats()["agents"]["owned_blocks"] == 40
    prompt = long_prompt(tokenizer, 90)  # more than the long model's own 12 blocks
    want = private_outputs(base, adapters, [(prompt, None, GREEDY)])[0]
    long_id = colo.add_request("long", prompt, GREEDY)
    chat_id = colo.add_request("agents", prompts_for(tokenizer, 1)[0], GREEDY, adapter="icarus-a")
    done = {}
    while colo.has_unfinished():
        done.update({o.request_id: o.token_ids for o in colo.step() if o.finished})
    assert done[long_id] == want and len(done[chat_id]) == GREEDY.max_tokens
    assert colo.lending.counters.units_lent > 0
    with pytest.raises(KvshareError, match="served as 'long'"):
        colocate([(str(base), [], config, "long"), (str(base), [], config, "long")], lending=True)


# the layer-stream cache -------------------------------------------------------------------------
def test_stream_capacity_reproduces_the_papers_worked_example():
    from kvshare.serve.cache.layer_stream import stream_capacity

    streamed, regular = stream_capacity(local_layer_blocks=100, layers=10, lent_blocks=9 + 8)
    assert (streamed, regular, streamed + regular) == (17, 8, 25)
    assert stream_capacity(100, 10, 0) == (0, 10)  # no lending: 100 / 10 whole blocks
    assert stream_capacity(100, 10, 500) == (100, 0)  # the buffer is the limit


@pytest.mark.parametrize("adapter", [None, "lora-a", "icarus-a", "alora-a"])
def test_a_layer_streaming_engine_gives_the_private_pools_tokens(base, adapters, tokenizer, invocation, adapter,
                                                                  monkeypatch):
    """The tokens of private pools; every write-back to lent memory runs on the link's thread, as loads do."""
    import threading

    from kvshare.serve.cache import layer_stream

    writers = []
    write = layer_stream.write_kv_ref
    monkeypatch.setattr(layer_stream, "write_kv_ref",
                        lambda *args: writers.append(threading.current_thread().name) or write(*args))

    prompt = long_prompt(tokenizer, 60) + (invocation + prompts_for(tokenizer, 1)[0] if adapter == "alora-a" else [])
    want = private_outputs(base, adapters, [(prompt, adapter, GREEDY)])[0]
    config = EngineConfig(block_size=4)
    paths = [str(p) for p in adapters.values()]
    # the long model keeps 12 blocks' bytes locally: a buffer of 24 rows (the tiny model has 2 layers)
    colo = colocate([(str(base), paths, config.updated(kv_cache_tokens=48, kv_stream=True), "long"),
                     (str(base), [], config.updated(kv_cache_tokens=160), "agents")], lending=True)
    long = colo.engines["long"]
    assert long.runner.stream.buffer_rows == 24 and long.max_kv_blocks == 24 and long.num_kv_blocks == 0
    request = colo.add_request("long", prompt, GREEDY, adapter=adapter)  # 18-23 blocks: more than 12 whole ones
    chat = colo.add_request("agents", prompts_for(tokenizer, 1)[0], GREEDY)
    done = {}
    while colo.has_unfinished():
        done.update({o.request_id: o.token_ids for o in colo.step() if o.finished})
    assert done[request] == want and len(done[chat]) == GREEDY.max_tokens
    stats = colo.lenders["long"].stream_stats()
    assert stats["stream_layers_loaded"] > 0 and stats["stream_bytes_written_back"] > 0
    assert writers and set(writers) == {"kvshare-layer-stream"}
    with pytest.raises(KvshareError, match="co-located engines may lend"):
        colo.add_request("long", long_prompt(tokenizer, 90), GREEDY)  # more than the buffer's 24 rows


def test_a_co_located_forkkv_engine_sizes_its_residual_pool_from_its_share(base, adapters, tokenizer):
    """Co-located engines are built with one block; ForkKV's residual pool (default: 4x the
    KV pool) was sized from that block and refused any request of more than 4 blocks."""

    config = EngineConfig(block_size=4, compile="off")
    colo = colocate([(str(base), [str(adapters["lora-a"])], config.updated(kv_cache_tokens=160, kv_layout="forkkv"),
                      "agents"), (str(base), [], config.updated(kv_cache_tokens=48), "long")], lending=True)
    engine = colo.engines["agents"]
    assert engine._blocks.residual.num_blocks == 4 * 40
    prompt = (prompts_for(tokenizer, 1)[0] * 4)[:40]  # 10 blocks
    rid = colo.add_request("agents", prompt, GREEDY, adapter="lora-a")
    done = {}
    while colo.has_unfinished():
        done.update({o.request_id: o for o in colo.step() if o.finished})
    assert done[rid].finish_reason == "length"


def test_a_streaming_engine_with_more_local_memory_than_is_lent_keeps_the_rest_as_streamed_home(base, tokenizer):
    """SwiftCache's capacity rule: local memory beyond what the others can lend is worth more
    as home blocks (streamed like lent ones) than as buffer rows nothing fills. All of it as
    buffer served no more blocks than the others lent (9 here, of 80 rows)."""

    config = EngineConfig(block_size=4)
    # long: 40 blocks' bytes locally = 80 one-layer rows (2 layers); agents: 12 blocks, 9 above their floor
    colo = colocate([(str(base), [], config.updated(kv_cache_tokens=160, kv_stream=True), "long"),
                     (str(base), [], config.updated(kv_cache_tokens=48), "agents")], lending=True)
    long = colo.engines["long"]
    # home = (80 - 9) // 3 = 23 blocks (46 rows' bytes), buffer = 34 rows; it may hold 23 + 9 = 32 blocks
    assert long.num_kv_blocks == 23 and long.runner.stream.buffer_rows == 34 and long.max_kv_blocks == 32
    prompt = long_prompt(tokenizer, 110)  # 28 blocks with its output: more than all 12 the agents have
    want = private_outputs(base, {}, [(prompt, None, GREEDY)])[0]
    request = colo.add_request("long", prompt, GREEDY)
    done = {}
    while colo.has_unfinished():
        done.update({o.request_id: o.token_ids for o in colo.step() if o.finished})
    assert done[request] == want and colo.lenders["long"].stream_stats()["stream_layers_loaded"] > 0


def test_a_failed_streaming_step_lands_its_write_back_before_its_blocks_are_freed(base, tokenizer, monkeypatch):
    """A step that fails after a layer's write-back started: the write lands before the failed
    request's blocks are freed (a lender may take them back and write its own KV there)."""
    import time

    from kvshare.serve.cache import layer_stream

    events = []
    write, layer = layer_stream.write_kv_ref, layer_stream.LayerStream.layer

    def slow_write(*args):
        time.sleep(0.3)
        events.append("written")
        return write(*args)

    def failing(self, i):
        if i == 1:
            raise RuntimeError("simulated failure in layer 1")
        return layer(self, i)

    monkeypatch.setattr(layer_stream, "write_kv_ref", slow_write)
    monkeypatch.setattr(layer_stream.LayerStream, "layer", failing)
    config = EngineConfig(block_size=4)
    colo = colocate([(str(base), [], config.updated(kv_cache_tokens=48, kv_stream=True), "long"),
                     (str(base), [], config.updated(kv_cache_tokens=160), "agents")], lending=True)
    long = colo.engines["long"]
    free = long._blocks.free
    monkeypatch.setattr(long._blocks, "free", lambda seq: (events.append("freed"), free(seq))[1])
    request = colo.add_request("long", long_prompt(tokenizer, 20), GREEDY)
    done = {}
    while colo.has_unfinished():
        done.update({o.request_id: o for o in colo.step() if o.finished})
    assert done[request].finish_reason == "error"
    assert "written" in events and events.index("written") < events.index("freed")


def test_demand_counts_a_shared_prefix_once(base):
    """Three running requests over one cached 2-block prefix hold 2 + 3 blocks and need one
    more each: 8, not 3 x 4 (a lender counted so lost its reclaim within its home share)."""
    engine = LLMEngine(base, kv_cache_tokens=64 * 4, block_size=4)
    prefix = list(range(10, 18))
    engine.add_request(prefix, SamplingParams(max_tokens=1, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    for i in range(3):
        engine.add_request(prefix + [100 + i, 110 + i, 120 + i, 130 + i], SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()
    assert engine.num_running() == 3 and engine._blocks.pool.num_referenced() == 5
    assert EngineLender(engine).kv_demand().total == 8
