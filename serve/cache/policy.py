"""Eviction policies: which unreferenced cached block the pool gives up first.

A policy only orders candidates; the block manager decides what is a candidate (cached and
unreferenced) and does the eviction. Small strategy classes picked by name, as in SGLang's
``evict_policy.py``; KVFlow's step-aware policy (``step``) ranks blocks by the agents that read them.
"""

from __future__ import annotations

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

    def bind(self, rank: Callable[[int], tuple], is_leaf: Callable[[int], bool]) -> None:
        """Receive the block manager's view of a block: its rank (lower goes first) and
        whether no cached block descends from it. Policies that ignore both need not care."""

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

    The rank of a block changes as hints arrive, so it is computed when a victim is chosen
    (a scan over the idle blocks: a few thousand at most, once per evicted block)."""

    def __init__(self):
        self._released: dict[int, int] = {}  # block id -> release counter (recency)
        self._clock = itertools.count()
        self._rank: Callable[[int], tuple] = lambda block_id: ()
        self._is_leaf: Callable[[int], bool] = lambda block_id: True

    def bind(self, rank, is_leaf) -> None:
        self._rank, self._is_leaf = rank, is_leaf

    def add(self, block_id: int) -> None:
        self._released[block_id] = next(self._clock)

    def remove(self, block_id: int) -> None:
        self._released.pop(block_id, None)

    def _victim(self) -> tuple[tuple, int]:
        leaves = [b for b in self._released if self._is_leaf(b)] or list(self._released)
        return min((self._rank(b) + (self._released[b],), b) for b in leaves)

    def pop_victim(self) -> int:
        block_id = self._victim()[1]
        del self._released[block_id]
        return block_id

    def peek_rank(self) -> tuple | None:
        return self._victim()[0][:-1] if self._released else None

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._released

    def __len__(self) -> int:
        return len(self._released)


POLICIES: dict[str, type[EvictionPolicy]] = {"lru": LRUPolicy, "step": StepAwarePolicy}


def make_policy(name: str) -> EvictionPolicy:
    if name not in POLICIES:
        raise KvshareError(f"unknown eviction policy {name!r} (known: {', '.join(POLICIES)})")
    return POLICIES[name]()
