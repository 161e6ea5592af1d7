"""A pool of KV blocks: ids, reference counts and a free list; the tensor lives elsewhere.

The pool hands out block *ids* into a tensor view owned by the model runner, so resizing a
pool later (SwiftCache's lending) changes the free list, never the data.
"""

from __future__ import annotations


class OutOfBlocks(Exception):
    """The pool cannot supply the blocks asked for (the scheduler preempts and retries)."""


class BlockPool:
    def __init__(self, num_blocks: int, name: str = "kv"):
        self.name = name
        self.ref_count = [0] * num_blocks
        self.free_ids: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() takes the lowest

    @property
    def num_blocks(self) -> int:
        return len(self.ref_count)

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
