"""Eviction policies: which unreferenced cached block the pool gives up first.

A policy only orders candidates; the block manager decides what is a candidate (cached and
unreferenced) and does the eviction. Small strategy classes picked by name, as in SGLang's
``evict_policy.py``; KVFlow's step-aware policy (``step``) ranks blocks by the agents that read them.
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections import OrderedDict
from typing import Callable

from ...errors import KvshareError


class EvictionPolicy(ABC):
    """The set of evictable blocks, in the order they should go."""

    @abstractmethod
    def add(self, block_id: int) -> None:
        """A cached block lost its last reference: it may be evicted from now on."""

    @abstractmethod
    def remove(self, block_id: int) -> None:
        """The block is referenced again (a prefix hit): no longer evictable."""

    @abstractmethod
    def pop_victim(self) -> int:
        """Take the block to evict next (the set is not empty)."""

    @abstractmethod
    def __contains__(self, block_id: int) -> bool: ...

    @abstractmethod
    def __len__(self) -> int: ...

    def bind(self, rank: Callable[[int], tuple], is_leaf: Callable[[int], bool],
             version: Callable[[], object] | None = None) -> None:
        """Receive the block manager's view of a block: its rank (lower goes first), whether
        no cached block descends from it, and a value that changes whenever ranks may have
        changed. Policies that ignore them need not care."""

    def peek_rank(self) -> tuple | None:
        """The rank of the block :meth:`pop_victim` would take (None: unranked policy)."""
        return None


class LRUPolicy(EvictionPolicy):
    """Least recently released first."""

    def __init__(self):
        self._order: OrderedDict[int, None] = OrderedDict()

    def add(self, block_id: int) -> None:
        self._order[block_id] = None

    def remove(self, block_id: int) -> None:
        self._order.pop(block_id, None)

    def pop_victim(self) -> int:
        return self._order.popitem(last=False)[0]

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._order

    def __len__(self) -> int:
        return len(self._order)


class StepAwarePolicy(EvictionPolicy):
    """KVFlow's order: dynamic suffixes first, then fixed-prompt blocks of the agents whose
    next call is furthest away, least recently released as the tie-break; only blocks with
    no cached descendant are candidates (evicting an inner block would strand its subtree).

    Candidates sit in a heap keyed by (rank, release order). An idle block's rank changes only
    when the agents' steps do, which the block manager reports through its ``version``; the
    heap is rebuilt then (once per request, not per eviction), so choosing a
    victim costs O(log n) instead of a scan of every idle block. Removed blocks leave stale
    entries that are skipped when they surface; inner blocks met on the way are set aside and
    pushed back, since evicting their last child makes them candidates."""

    def __init__(self):
        self._released: dict[int, int] = {}  # block id -> release counter (recency)
        self._clock = itertools.count()
        self._rank: Callable[[int], tuple] = lambda block_id: ()
        self._is_leaf: Callable[[int], bool] = lambda block_id: True
        self._version: Callable[[], object] = lambda: None
        self._heap: list[tuple[tuple, int, int]] = []  # (rank, release counter, block id)
        self._heap_version: object = None

    def bind(self, rank, is_leaf, version=None) -> None:
        self._rank, self._is_leaf = rank, is_leaf
        if version is not None:
            self._version = version
        self._heap_version = object()  # unlike any version: rebuild on first use

    def add(self, block_id: int) -> None:
        counter = next(self._clock)
        self._released[block_id] = counter
        heapq.heappush(self._heap, (self._rank(block_id), counter, block_id))

    def remove(self, block_id: int) -> None:
        self._released.pop(block_id, None)  # its heap entry goes stale

    def _rebuild_if_stale(self) -> None:
        version = self._version()
        if version != self._heap_version or len(self._heap) > 4 * len(self._released) + 64:
            self._heap = [(self._rank(b), c, b) for b, c in self._released.items()]
            heapq.heapify(self._heap)
            self._heap_version = version

    def _victim(self) -> tuple[tuple, int, int] | None:
        """The heap entry of the block to evict next (left in the heap), or None if empty."""
        self._rebuild_if_stale()
        heap, inner, found = self._heap, [], None
        while heap:
            entry = heap[0]
            if self._released.get(entry[2]) != entry[1]:
                heapq.heappop(heap)  # removed, or re-added since with a newer counter
            elif self._is_leaf(entry[2]):
                found = entry
                break
            else:
                inner.append(heapq.heappop(heap))
        if found is None and inner:
            found = inner[0]  # no leaf at all: the lowest-ranked block (as a plain scan would)
        for entry in inner:
            heapq.heappush(heap, entry)
        return found

    def pop_victim(self) -> int:
        block_id = self._victim()[2]
        del self._released[block_id]
        return block_id

    def peek_rank(self) -> tuple | None:
        entry = self._victim()
        return None if entry is None else entry[0]

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._released

    def __len__(self) -> int:
        return len(self._released)


POLICIES: dict[str, type[EvictionPolicy]] = {"lru": LRUPolicy, "step": StepAwarePolicy}


def make_policy(name: str) -> EvictionPolicy:
    if name not in POLICIES:
        raise KvshareError(f"unknown eviction policy {name!r} (known: {', '.join(POLICIES)})")
    return POLICIES[name]()
