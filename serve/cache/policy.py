"""Eviction policies: which unreferenced cached block the pool gives up first.

A policy only orders candidates; the block manager decides what is a candidate (cached and
unreferenced) and does the eviction. Small strategy classes picked by name, as in SGLang's
``evict_policy.py``; KVFlow's step-aware policy will be another entry of ``POLICIES``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict

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


POLICIES: dict[str, type[EvictionPolicy]] = {"lru": LRUPolicy}


def make_policy(name: str) -> EvictionPolicy:
    if name not in POLICIES:
        raise KvshareError(f"unknown eviction policy {name!r} (known: {', '.join(POLICIES)})")
    return POLICIES[name]()
