"""The block manager: the one object the scheduler asks for KV blocks.

It composes a :class:`BlockPool` (ids and references), a :class:`PrefixIndex` (which block
holds which prefix), an :class:`EvictionPolicy` (which idle cached block goes first) and a
:class:`KVLayout` (the owner each block's key names). Blocks that are cached and
unreferenced stay reusable until the policy gives them up.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..sequence import Sequence
from .layout import KVLayout
from .policy import EvictionPolicy, LRUPolicy
from .pool import BlockPool, OutOfBlocks
from .prefix_index import PrefixIndex


class PrefixPending(Exception):
    """The next block of this prompt is being computed for another request: wait, then reuse it."""


@dataclass
class CacheStats:
    hit_tokens: int = 0  # prompt tokens served from the prefix cache
    queried_tokens: int = 0  # prompt tokens looked up
    evictions: int = 0


@dataclass
class BlockInfo:
    key: bytes | None = None  # set once the block is full, computed and published
    owner: str | None = None


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, base_fingerprint: str,
                 policy: EvictionPolicy | None = None, layout: KVLayout | None = None):
        self.block_size = block_size
        self.index = PrefixIndex(base_fingerprint)
        self.layout = layout or KVLayout()
        self.policy = policy or LRUPolicy()
        self.reset(num_blocks)

    def reset(self, num_blocks: int | None = None) -> None:
        """Forget every cached block and zero the statistics (no sequence may hold blocks)."""
        if hasattr(self, "pool") and self.pool.num_referenced():
            raise RuntimeError("cannot reset the KV pool while requests hold blocks")
        num_blocks = num_blocks or self.pool.num_blocks
        self.pool = BlockPool(num_blocks)
        self.blocks = [BlockInfo() for _ in range(num_blocks)]
        self.index.clear()
        self.policy = type(self.policy)()  # a fresh policy of the engine's kind
        self.stats = CacheStats()

    # keys -------------------------------------------------------------------------------
    def _keys(self, seq: Sequence, upto_tokens: int, start: int = 0, parent: bytes | None = None):
        """(block index, owner, key) for the full blocks among the first ``upto_tokens``,
        from block ``start`` on (``parent`` is then the key of block ``start - 1``)."""
        parent = parent or self.index.root
        tokens, bs = seq.tokens, self.block_size
        for index in range(start, upto_tokens // bs):
            end = (index + 1) * bs
            owner = self.layout.block_owner(seq, end)
            parent = self.index.block_key(parent, owner, tokens[end - bs:end])
            yield index, owner, parent

    # capacity ---------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free(self) -> int:
        """Blocks a request could get now: never used, or cached and idle (evictable)."""
        return self.pool.num_free + len(self.policy)

    def blocks_needed(self, n_tokens: int) -> int:
        return (n_tokens + self.block_size - 1) // self.block_size

    def _take(self) -> int:
        if self.pool.num_free:
            return self.pool.take_free()
        if not len(self.policy):
            raise OutOfBlocks
        block_id = self.policy.pop_victim()
        info = self.blocks[block_id]
        self.index.forget(info.key)
        info.key, info.owner = None, None
        self.stats.evictions += 1
        self.pool.ref(block_id)
        return block_id

    # sequence lifecycle -----------------------------------------------------------------
    def allocate(self, seq: Sequence) -> None:
        """Give a new sequence its blocks: reuse cached prefix blocks, fresh ones for the rest.

        All-or-nothing: raises OutOfBlocks without changing anything if the pool is short.
        """
        length = len(seq)
        hits: list[int] = []
        keys = [key for _, _, key in self._keys(seq, length)]
        for key in keys:
            block_id = self.index.lookup(key)
            if block_id is None:
                if self.index.is_pending(key):
                    raise PrefixPending  # same prefix admitted just before: share it once computed
                break
            hits.append(block_id)
        fresh = self.blocks_needed(length) - len(hits)
        reusable_evictable = sum(1 for b in hits if b in self.policy)
        if fresh > self.num_free - reusable_evictable:
            raise OutOfBlocks
        for block_id in hits:
            self.policy.remove(block_id)
            self.pool.ref(block_id)
        seq.block_table = hits + [self._take() for _ in range(fresh)]
        for index in range(len(hits), len(keys)):
            self.index.mark_pending(keys[index], seq.block_table[index])
        seq.num_computed = len(hits) * self.block_size
        seq.hashed_blocks = len(hits)
        seq.chain_key = keys[len(hits) - 1] if hits else None
        self.stats.queried_tokens += len(seq.prompt)
        self.stats.hit_tokens += min(seq.num_computed, len(seq.prompt))

    def ensure_capacity(self, seq: Sequence, n_tokens: int) -> None:
        """Make the block table hold ``n_tokens`` tokens (raises OutOfBlocks if it cannot)."""
        need = self.blocks_needed(n_tokens) - len(seq.block_table)
        if need > self.num_free:
            raise OutOfBlocks
        for _ in range(need):
            seq.block_table.append(self._take())

    def register_computed(self, seq: Sequence) -> None:
        """Publish the sequence's newly completed full blocks in the prefix index."""
        full = seq.num_computed // self.block_size
        if full <= seq.hashed_blocks:
            return
        # continue the chain from the last published block instead of hashing from the root
        for index, owner, key in self._keys(seq, full * self.block_size, seq.hashed_blocks, seq.chain_key):
            block_id = seq.block_table[index]  # freshly computed here, so never published before
            if self.index.publish(key, block_id):
                self.blocks[block_id].key, self.blocks[block_id].owner = key, owner
            seq.chain_key = key
        seq.hashed_blocks = full

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references; cached blocks stay reusable until evicted."""
        self.index.drop_pending_of(set(seq.block_table))
        for block_id in reversed(seq.block_table):
            if self.pool.unref(block_id):
                if self.blocks[block_id].key is not None:
                    self.policy.add(block_id)
                else:
                    self.pool.release(block_id)
        seq.block_table = []
        seq.num_computed = 0
        seq.hashed_blocks = 0
        seq.chain_key = None

    # statistics -------------------------------------------------------------------------
    @property
    def num_holding_kv(self) -> int:
        """Blocks that hold KV: in use by a request or kept in the prefix cache."""
        return self.pool.num_blocks - self.pool.num_free

    def usage(self) -> dict:
        in_use = [info for info, refs in zip(self.blocks, self.pool.ref_count) if refs > 0]
        return {
            "blocks_total": self.pool.num_blocks,
            "blocks_in_use": len(in_use),
            "blocks_in_use_shared": sum(1 for b in in_use if b.key is not None and b.owner is None),
            "blocks_in_use_private": sum(1 for b in in_use if b.key is not None and b.owner is not None),
            "blocks_in_use_unsealed": sum(1 for b in in_use if b.key is None),
            "blocks_cached_idle": len(self.policy),
        }
