"""Elastic lending between co-located engines (SwiftCache's elastic cache).

Between steps the driver calls :meth:`Lending.rebalance`, which moves exchange units of the
shared :class:`~..cache.arena.KVArena` (ownership only; no bytes move):

- **reclaim**: an engine short of blocks first takes back its own (home) units from
  whoever borrowed them, preempting the borrower's requests that hold them (they are
  recomputed later, as any preemption);
- **scale-up**: then it borrows units the others hold but do not need, keeping each
  lender at or above its floor and its recent peak demand;
- **scale-down**: a borrower hands back borrowed units it has not needed for a window of
  steps (only whole idle units; cached blocks in them are evicted from its prefix index).

Demand is each engine's :meth:`Lender.kv_demand`: the blocks of the running requests (one
more token each) and of the next waiting one. The lender's own requests never wait for a
borrower: up to its floor it never lends, and within its home share a reclaim wins over any
loan. This module is the policy alone: it sees each engine through its :class:`Lender`
(:class:`~.lender.EngineLender`, which the co-location layer builds), never the engine.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from ..cache.arena import KVArena


@dataclass(frozen=True)
class KVDemand:
    """Blocks an engine needs now: its running requests (the distinct blocks they hold and one
    more token each) and the next waiting one (its whole prompt, as if nothing were cached)."""

    running: int
    next: int = 0
    next_arrival: float = math.inf  # when the oldest waiting request arrived (inf: none waits)

    @property
    def total(self) -> int:
        return self.running + self.next


@dataclass
class LendingStats:
    units_lent: int = 0  # loans made (scale-up)
    units_reclaimed: int = 0  # taken back by their home engine while lent
    units_returned: int = 0  # handed back by a borrower (scale-down)
    preempted: int = 0  # borrower requests preempted by reclaims
    log: deque = field(default_factory=lambda: deque(maxlen=256))  # (event, unit, from, to)


FLOOR_FRACTION = 0.25  # the share of its home units an engine never lends (the default)


class Lender(Protocol):
    """What the policy asks of one co-located engine (:class:`~.lender.EngineLender`)."""

    block_size: int
    max_kv_blocks: int | None

    def limit_kv_blocks(self, lendable: int) -> None: ...

    def kv_demand(self) -> KVDemand: ...

    def kv_blocks_owned(self) -> int: ...

    def kv_blocks_busy(self, block_ids: list[int]) -> list[int]: ...

    def release_kv_blocks(self, block_ids: list[int], preempt: bool) -> int | None: ...

    def grant_kv_blocks(self, block_ids: list[int]) -> None: ...


class Lending:
    def __init__(self, arena: KVArena, lenders: dict[str, Lender], floor_fraction: float = FLOOR_FRACTION,
                 peak_window: int = 32):
        """``lenders``: each engine's :class:`Lender`, by name; ``floor_fraction``: the share
        of its home units an engine never lends; ``peak_window``: the rounds over which an
        engine's peak running demand keeps what it holds (lent or borrowed)."""
        if not 0 <= floor_fraction <= 1 or peak_window < 1:
            raise ValueError("floor_fraction must be in [0, 1] and peak_window at least 1")
        self.arena, self.lenders = arena, lenders
        homes = {name: arena.home.count(name) for name in lenders}
        self.floor_units = {name: math.ceil(floor_fraction * n) for name, n in homes.items()}
        self.peaks = {name: deque(maxlen=peak_window) for name in lenders}
        self.counters = LendingStats()
        self._moved: set[int] = set()  # units moved this round (each moves at most once)
        for name, engine in lenders.items():  # the most each may hold: all but the others' floors
            others = sum(u for other, u in self.floor_units.items() if other != name)
            engine.limit_kv_blocks((arena.num_units - others) * arena.blocks_per_unit(name))

    # what each engine needs ------------------------------------------------------------------
    def _units(self, name: str, blocks: int) -> int:
        return math.ceil(blocks / self.arena.blocks_per_unit(name))

    def _keep_units(self, name: str) -> int:
        """Units ``name`` keeps: its floor, and enough for its running requests' peak of the
        window (waiting requests protect nothing: an engine whose queue head does not fit
        must not sit on idle blocks another engine could run with)."""
        return max(self.floor_units[name], self._units(name, max(self.peaks[name], default=0)))

    def _home_held(self, name: str) -> int:
        """How many of its own (home) units ``name`` holds."""
        return sum(1 for unit in self.arena.units_held(name) if self.arena.home[unit] == name)

    def _idle(self, name: str, unit: int) -> bool:
        return not self.lenders[name].kv_blocks_busy(self.arena.blocks(name, unit))

    # moving units ----------------------------------------------------------------------------
    def _move(self, unit: int, to: str, event: str, preempt: bool) -> bool:
        holder = self.arena.holder[unit]
        preempted = self.lenders[holder].release_kv_blocks(self.arena.blocks(holder, unit), preempt=preempt)
        if preempted is None:
            return False
        self.counters.preempted += preempted
        self.arena.move(unit, to)
        self.lenders[to].grant_kv_blocks(self.arena.blocks(to, unit))
        self.counters.log.append((event, unit, holder, to))
        self._moved.add(unit)
        return True

    def rebalance(self) -> None:
        """One round of reclaim, scale-up and scale-down (call between steps). Short engines
        go in the order their oldest unserved request arrived (first come, first served
        across engines, so that engines each waiting for more than they hold cannot
        deadlock), and a unit moves at most once a round."""
        self._moved.clear()
        demand = {name: engine.kv_demand() for name, engine in self.lenders.items()}
        for name, d in demand.items():
            self.peaks[name].append(d.running)
        short = [name for name, d in demand.items() if d.total > self.lenders[name].kv_blocks_owned()]
        for name in sorted(short, key=lambda n: demand[n].next_arrival):
            self._grow(name, demand[name])
        for name in self.lenders:
            self._shrink(name, demand[name])

    def _grow(self, name: str, demand: KVDemand) -> None:
        arena = self.arena
        engine = self.lenders[name]
        room = (engine.max_kv_blocks - engine.kv_blocks_owned()) // arena.blocks_per_unit(name)
        short = min(room, self._units(name, demand.total - engine.kv_blocks_owned()))
        # 1. reclaim its own units: the idle ones first, then, preempting the borrower, only
        # for what is within its home share (a request larger than its share borrows like
        # anyone else)
        within_home = demand.total <= arena.home.count(name) * arena.blocks_per_unit(name)
        for preempt in (False, True) if within_home else (False,):
            for unit, home in enumerate(arena.home):
                if short and home == name and arena.holder[unit] != name and unit not in self._moved \
                        and self._move(unit, name, "reclaim", preempt=preempt):
                    self.counters.units_reclaimed += 1
                    short -= 1
        for lender in self.lenders:  # 2. borrow idle units the others hold beyond what they keep
            if lender == name:
                continue
            spare = len(arena.units_held(lender)) - self._keep_units(lender)
            spare_home = self._home_held(lender) - self.floor_units[lender]
            # the lender's borrowed units go first, then its own from the top down
            candidates = sorted(arena.units_held(lender), key=lambda u: (arena.home[u] == lender, -u))
            for unit in candidates:
                if not short or spare <= 0:
                    break
                own = arena.home[unit] == lender
                if own and spare_home <= 0:
                    break  # the floor: never lend the last of its own units
                if unit not in self._moved and self._idle(lender, unit) and self._move(unit, name, "lend", False):
                    self.counters.units_lent += 1
                    short, spare, spare_home = short - 1, spare - 1, spare_home - own

    def _shrink(self, name: str, demand: KVDemand) -> None:
        """Hand back borrowed units that neither the window's peak nor the request waiting
        for them (a long prompt gathering blocks over several rounds) needs."""
        arena = self.arena
        extra = len(arena.units_held(name)) - max(self._keep_units(name), self._units(name, demand.total))
        for unit in sorted(arena.units_held(name), reverse=True):
            if extra <= 0:
                return
            if arena.home[unit] != name and unit not in self._moved and self._idle(name, unit) \
                    and self._move(unit, arena.home[unit], "return", False):
                self.counters.units_returned += 1
                extra -= 1

    # what /metrics shows -----------------------------------------------------------------------
    def stats(self) -> dict[str, dict[str, int]]:
        """Per engine: blocks owned now, lent out (its home units others hold), borrowed."""
        arena, out = self.arena, {}
        for name, engine in self.lenders.items():
            per = arena.blocks_per_unit(name)
            lent = sum(1 for u, home in enumerate(arena.home) if home == name and arena.holder[u] != name)
            borrowed = sum(1 for u, holder in enumerate(arena.holder) if holder == name and arena.home[u] != name)
            out[name] = {"owned_blocks": engine.kv_blocks_owned(), "lent_blocks": lent * per,
                         "borrowed_blocks": borrowed * per, "block_size": engine.block_size,
                         "floor_blocks": self.floor_units[name] * per}
        return out

