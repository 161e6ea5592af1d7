"""A pool of KV blocks: ids, reference counts and a free list; the tensor lives elsewhere.

The pool hands out block *ids* into a tensor view owned by the model runner. The view may be
larger than the pool: with co-located engines (SwiftCache, :mod:`kvshare.serve.driver.lending`) it spans a whole
shared arena, and the pool owns only some of its blocks; :meth:`grant` and :meth:`withdraw`
move blocks in and out, changing the free list, never the data.
"""

from __future__ import annotations

from collections.abc import Iterable


class OutOfBlocks(Exception):
    """The pool cannot supply the blocks asked for (the scheduler preempts and retries)."""


class OutOfResidualBlocks(OutOfBlocks):
    """ForkKV's residual pool is short: only a ForkKV sequence's preemption frees its blocks."""


class BlockPool:
    def __init__(self, capacity: int, name: str = "kv", owned: Iterable[int] | None = None):
        """``capacity``: block ids the view addresses; ``owned``: those this pool may use
        (default: all of them)."""
        self.name = name
        self.ref_count = [0] * capacity
        owned = range(capacity) if owned is None else sorted(set(owned))
        self.owned = [False] * capacity
        for block_id in owned:
            self.owned[block_id] = True
        self._num_owned = len(owned)
        self.free_ids: list[int] = sorted(owned, reverse=True)  # pop() takes the lowest

    @property
    def capacity(self) -> int:
        return len(self.ref_count)

    @property
    def num_blocks(self) -> int:
        """Blocks this pool owns now."""
        return self._num_owned

    @property
    def num_free(self) -> int:
        return len(self.free_ids)

    def take_free(self) -> int:
        """A never-cached free block with one reference (raises OutOfBlocks if none)."""
        if not self.free_ids:
            raise OutOfBlocks
        block_id = self.free_ids.pop()
        self.ref_count[block_id] = 1
        return block_id

    def ref(self, block_id: int) -> None:
        self.ref_count[block_id] += 1

    def unref(self, block_id: int) -> bool:
        """Drop a reference; True when the block is now unreferenced."""
        self.ref_count[block_id] -= 1
        return self.ref_count[block_id] == 0

    def release(self, block_id: int) -> None:
        """Return an unreferenced block to the free list."""
        self.free_ids.append(block_id)

    def num_referenced(self) -> int:
        return sum(1 for r in self.ref_count if r > 0)

    def grant(self, block_ids: Iterable[int]) -> None:
        """Blocks this pool may use from now on (free; their old contents are never read)."""
        block_ids = sorted(block_ids, reverse=True)
        for block_id in block_ids:
            if self.owned[block_id]:
                raise ValueError(f"block {block_id} is already in pool {self.name!r}")
            self.owned[block_id] = True
        self._num_owned += len(block_ids)
        self.free_ids = sorted(self.free_ids + block_ids, reverse=True)

    def withdraw(self, block_ids: Iterable[int]) -> None:
        """Give up blocks; each must be free (unreferenced and uncached)."""
        gone = set(block_ids)
        free = set(self.free_ids)
        for block_id in gone:
            if not self.owned[block_id] or block_id not in free:
                raise ValueError(f"block {block_id} of pool {self.name!r} is not free")
        for block_id in gone:
            self.owned[block_id] = False
        self._num_owned -= len(gone)
        self.free_ids = [b for b in self.free_ids if b not in gone]
