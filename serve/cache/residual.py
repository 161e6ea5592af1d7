"""ForkKV's residual pool: each agent's rank-r ``x A_k``, ``x A_v``, with its own index and eviction.

A ForkKV request keeps the base part of its K/V in the main pool (shared among ForkKV agents)
and only the low-rank residual here, keyed by (tokens, adapter content digest): two agents
never read each other's residual, and the same adapter over the same prefix reuses its own.
The pool has its own hash chain and its own LRU policy, so the two parts are evicted apart
(ForkKV's decoupled eviction): a request whose residual survived but whose base part did not
(or the reverse) recomputes those tokens and writes only the part that is missing.

Kept separate from :class:`~.block_manager.BlockManager` rather than a second instance of it
because the residual pool has none of its waiting machinery (pending prefixes, host tier,
agent ranks): a residual block that is not cached is simply recomputed.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..kv_layout import ResidualState
from ..sequence import Sequence
from .policy import LRUPolicy
from .pool import BlockPool, OutOfResidualBlocks
from .prefix_index import PrefixIndex


@dataclass
class ResidualStats:
    hit_tokens: int = 0  # prompt tokens whose residual came from the cache
    evictions: int = 0


class ResidualCache:
    def __init__(self, num_blocks: int, block_size: int, base_fingerprint: str):
        self.block_size = block_size
        self.index = PrefixIndex(base_fingerprint, namespace="kvshare-forkkv-residual")
        self.reset(num_blocks)

    def reset(self, num_blocks: int | None = None) -> None:
        num_blocks = num_blocks or self.pool.num_blocks
        self.pool = BlockPool(num_blocks, name="forkkv_residual")
        self.keys_of: list[bytes | None] = [None] * num_blocks  # block -> its key once published
        self.policy = LRUPolicy()
        self.index.clear()
        self.stats = ResidualStats()

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free(self) -> int:
        return self.pool.num_free + len(self.policy)

    def keys(self, seq: Sequence, upto_tokens: int, start: int = 0, parent: bytes | None = None):
        """(block index, key) of the full residual blocks among the first ``upto_tokens``."""
        parent = parent or self.index.root_for(seq.params.cache_salt)
        tokens, bs = seq.tokens, self.block_size
        for index in range(start, upto_tokens // bs):
            parent = self.index.block_key(parent, seq.adapter_digest, tokens[index * bs:(index + 1) * bs])
            yield index, parent

    def match(self, seq: Sequence) -> list[int]:
        """The cached residual blocks of the sequence's longest cached prefix (not taken yet)."""
        hits = []
        for _, key in self.keys(seq, len(seq)):
            block_id = self.index.lookup(key)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def fresh_needed(self, seq: Sequence, hits: list[int]) -> int:
        return (len(seq) + self.block_size - 1) // self.block_size - len(hits)

    def can_take(self, fresh: int, hits: list[int]) -> bool:
        return fresh <= self.num_free - sum(1 for b in hits if b in self.policy)

    def allocate(self, seq: Sequence, hits: list[int]) -> ResidualState:
        """Take the hit blocks and fresh ones for the rest (the caller checked :meth:`can_take`):
        the sequence's :class:`ResidualState`, which it holds from now on."""
        fresh = self.fresh_needed(seq, hits)
        for block_id in hits:
            self.policy.remove(block_id)
            self.pool.ref(block_id)
        seq.residual = state = ResidualState(hits + [self._take() for _ in range(fresh)], len(hits),
                                             self.keys_of[hits[-1]] if hits else None, len(hits) * self.block_size)
        if not seq.preemptions:  # admitted again after a preemption: its hits now are its own blocks
            self.stats.hit_tokens += min(state.cached, len(seq.prompt))
        return state

    def _take(self) -> int:
        if self.pool.num_free:
            return self.pool.take_free()
        if not len(self.policy):
            raise OutOfResidualBlocks
        block_id = self.policy.pop_victim()
        self.index.forget(self.keys_of[block_id])
        self.keys_of[block_id] = None
        self.stats.evictions += 1
        self.pool.ref(block_id)
        return block_id

    def ensure_capacity(self, seq: Sequence, n_tokens: int) -> None:
        table = seq.residual.table
        need = (n_tokens + self.block_size - 1) // self.block_size - len(table)
        if need > self.num_free:
            raise OutOfResidualBlocks
        for _ in range(need):
            table.append(self._take())

    def register_computed(self, seq: Sequence) -> None:
        """Publish the sequence's newly completed full residual blocks."""
        state, full = seq.residual, seq.num_computed // self.block_size
        if full <= state.hashed_blocks:
            return
        for index, key in self.keys(seq, full * self.block_size, state.hashed_blocks, state.chain_key):
            block_id = state.table[index]
            if self.keys_of[block_id] is None and self.index.publish(key, block_id):
                self.keys_of[block_id] = key
            state.chain_key = key
        state.hashed_blocks = full

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's residual blocks (cached ones stay reusable) and its state."""
        for block_id in reversed(seq.residual.table):
            if self.pool.unref(block_id):
                if self.keys_of[block_id] is not None:
                    self.policy.add(block_id)
                else:
                    self.pool.release(block_id)
        seq.residual = None

    def usage(self) -> dict:
        in_use = sum(1 for r in self.pool.ref_count if r > 0)
        return {"blocks_total": self.num_blocks, "blocks_in_use": in_use, "blocks_cached_idle": len(self.policy)}

    @property
    def num_holding(self) -> int:
        return self.pool.num_blocks - self.pool.num_free
