"""One engine's side of SwiftCache lending, and the arena its engines start in.

The lending policy (:class:`~.lending.Lending`) moves exchange units of a shared
:class:`~..cache.arena.KVArena` between co-located engines; it asks each engine, through the
:class:`EngineLender` the co-location holds for it, how many blocks it needs now, which of a
unit's blocks its requests hold, and has it take blocks in or give them back (preempting
requests if asked). These are the lender half of an engine, kept out of the
:class:`~..engine.llm_engine.LLMEngine` facade that serves requests: a lender works on the engine's block
manager, scheduler and runner directly, the one module besides the engine that does.
"""

from __future__ import annotations

import math

from ...errors import KvshareError
from ..cache.arena import KVArena
from .lending import FLOOR_FRACTION, KVDemand
from ..config import EngineConfig
from ..engine.llm_engine import LLMEngine


class EngineLender:
    def __init__(self, engine: LLMEngine):
        self.engine = engine

    @property
    def block_size(self) -> int:
        return self.engine.block_size

    @property
    def max_kv_blocks(self) -> int | None:
        """The most blocks the engine may hold with every loan (None: not set yet)."""
        return self.engine.max_kv_blocks

    def home_blocks(self, config: EngineConfig) -> int:
        """Blocks of the KV memory ``config`` gives the engine: its home share in an arena."""
        return self.engine.runner.pool_blocks(config.kv_cache_tokens, config.kv_cache_bytes)

    def limit_kv_blocks(self, lendable: int) -> None:
        """The engine may hold ``lendable`` blocks at most (its requests are refused past them);
        a layer-streaming engine no more than its buffer's rows."""
        stream = self.engine.runner.stream
        self.engine.max_kv_blocks = min(lendable, stream.buffer_rows) if stream is not None else lendable

    def join_arena(self, arena: KVArena, name: str, stream_rows: int = 0) -> None:
        """Move the engine's KV into ``arena`` (which it shares with co-located engines) and
        start with the blocks of the units ``name`` holds there. ``stream_rows``: keep only a
        layer buffer of that many one-layer blocks locally and stream every layer from the
        arena (SwiftCache's layer-stream cache). Needs an idle engine."""
        engine = self.engine
        blocks, runner = engine._blocks, engine.runner
        if engine.sequences:
            raise KvshareError("join_arena needs an idle engine")
        blocks.land_loads("join_arena")  # a prefetch's loads write the old memory
        if stream_rows and blocks.residual is not None:  # before anything moves
            raise KvshareError("the layer-stream cache does not serve ForkKV adapters")
        view = arena.view(name)
        runner.use_kv_memory(view)
        if stream_rows:
            runner.stream_kv(stream_rows, engine.config.stream_bandwidth_gbps)
        blocks.reset(view.shape[0], owned=arena.owned_blocks(name))
        if blocks.tier is not None:  # only now: its loads wrote the old pool's block ids
            blocks.tier.device_kv = view
        if blocks.residual is not None and engine.config.forkkv_residual_tokens is None:
            blocks.residual = None  # its default size: from the blocks held now, not those it was built with
            engine._ensure_residual_pool()

    def kv_demand(self) -> KVDemand:
        """Blocks the engine's requests need to take their next step: the running ones (the
        distinct blocks they hold, a shared prefix once, and those each needs for one more
        token) and the oldest waiting one (its whole prompt, cached prefixes counted as if
        absent)."""
        scheduler, need = self.engine._scheduler, self.engine._blocks.blocks_needed
        held = {b for s in scheduler.running for b in s.block_table}
        running = len(held) + sum(max(0, need(len(s) + 1) - len(s.block_table)) for s in scheduler.running)
        if not scheduler.waiting:
            return KVDemand(running)
        head = scheduler.waiting[0]
        return KVDemand(running, need(len(head) + 1), min(s.arrival for s in scheduler.waiting))

    def kv_blocks_owned(self) -> int:
        return self.engine.num_kv_blocks

    def stream_stats(self) -> dict:
        """The layer-stream cache's loads, write-backs and stalls (nothing without one)."""
        stream = self.engine.runner.stream
        return {} if stream is None else {"stream_" + k: v for k, v in vars(stream.stats).items()}

    def grant_kv_blocks(self, block_ids: list[int]) -> None:
        """Blocks of the arena the engine may use from now on (lent, or given back)."""
        self.engine._blocks.grant(block_ids)

    def kv_blocks_busy(self, block_ids: list[int]) -> list[int]:
        """Those of ``block_ids`` a request holds now."""
        return self.engine._blocks.busy(block_ids)

    def release_kv_blocks(self, block_ids: list[int], preempt: bool) -> int | None:
        """Give blocks back to the arena; returns how many requests were preempted for it, or
        None when nothing was released. Idle cached blocks are evicted; requests holding one
        are preempted (recomputed later) if ``preempt``, else nothing is released. None also
        when some stay held (e.g. by a host-tier load in flight): try again later."""
        blocks, preempted = self.engine._blocks, 0
        if blocks.busy(block_ids):
            if not preempt or blocks.loading_into(block_ids):
                return None  # a load in flight would keep its block after the preemptions
            preempted = self.engine._scheduler.evacuate(block_ids)
            if blocks.busy(block_ids):
                return None
        blocks.withdraw(block_ids)
        return preempted


def lenders_of(engines: dict[str, LLMEngine]) -> dict[str, EngineLender]:
    return {name: EngineLender(engine) for name, engine in engines.items()}


def build_arena(lenders: dict[str, EngineLender], home_blocks: dict[str, int],
                stream_rows: dict[str, int] | None = None) -> KVArena:
    """Put idle engines into one arena, each starting with ``home_blocks`` of its own
    blocks' bytes (its static partition) as whole exchange units; an engine with
    ``stream_rows`` keeps a layer buffer of that many rows and streams its KV from the arena."""
    stream_rows = stream_rows or {}
    devices = {str(lender.engine.device) for lender in lenders.values()}
    if len(devices) != 1:
        raise KvshareError(f"co-located engines must share one device, not {', '.join(sorted(devices))}")
    shapes = {name: lender.engine.block_shape for name, lender in lenders.items()}
    arena = KVArena(shapes, {name: home_blocks[name] * shapes[name].block_bytes for name in lenders},
                    next(iter(lenders.values())).engine.device)
    for name, lender in lenders.items():
        lender.join_arena(arena, name, stream_rows.get(name, 0))
    return arena


def stream_split(engines: dict[str, LLMEngine], home_blocks: dict[str, int], name: str) -> tuple[int, int]:
    """(home blocks in the arena, layer-buffer rows) of a layer-streaming engine whose local
    memory is ``home_blocks[name]`` whole blocks, i.e. ``blocks x layers`` one-layer rows.
    Every block it serves streams through a row; a home block costs ``layers`` rows of
    local memory, a block the others lend none, so the split that serves the most,
    ``rows = home + lent``, gives ``home = (rows_total - lent) / (layers + 1)``: SwiftCache's
    capacity rule (:func:`..cache.layer_stream.stream_capacity`), sized for the most the others
    can lend (their homes above their floors). All local memory as buffer, as before, served
    no more blocks than the others lent, whatever the buffer's rows."""
    shape = engines[name].block_shape
    lendable = sum(home_blocks[other] * engines[other].block_shape.block_bytes
                   for other in engines if other != name) * (1 - FLOOR_FRACTION)
    lent = int(lendable // shape.block_bytes)
    total_rows = home_blocks[name] * shape.layers
    per_unit = math.lcm(*(e.block_shape.block_bytes for e in engines.values())) // shape.block_bytes
    home = max(0, (total_rows - lent) // (shape.layers + 1)) // per_unit * per_unit  # whole exchange units
    return home, total_rows - home * shape.layers
