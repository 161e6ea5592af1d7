"""Paged KV blocks with a prefix cache keyed by each adapter kind's sharing rule.

A hash chain over full blocks, as in vLLM, rather than SGLang's radix tree: one dict lookup
per block, reference counts per block, and an LRU of unreferenced cached blocks are enough
for exact reuse, and the chain makes the key of a block depend on everything before it
(base fingerprint, earlier tokens and their owners) without a tree to maintain. Only full
blocks are shared; the partly filled last block of a sequence is always private.

A block's key is (parent key, owner, tokens), where the owner comes from
:func:`kvshare.sharing.kv_owner`: None for base KV (shared by base, ICaRus and aLoRA-before-
invocation requests alike), the adapter's name for KV only that adapter computes.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

from ..sharing import kv_owner
from .sequence import Sequence


class OutOfBlocks(Exception):
    """The pool cannot supply the blocks asked for (the scheduler preempts and retries)."""


class PrefixPending(Exception):
    """The next block of this prompt is being computed for another request: wait, then reuse it."""


@dataclass
class Block:
    id: int
    ref_count: int = 0
    key: bytes | None = None  # set once the block is full, computed and registered
    owner: str | None = None


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, base_fingerprint: str):
        self.root = hashlib.sha256(f"kvshare-kv:{base_fingerprint}".encode()).digest()
        self.block_size = block_size
        self.reset(num_blocks)

    def reset(self, num_blocks: int | None = None) -> None:
        """Forget every cached block (no sequence may hold blocks)."""
        if hasattr(self, "blocks") and any(b.ref_count for b in self.blocks):
            raise RuntimeError("cannot reset the KV pool while requests hold blocks")
        num_blocks = num_blocks or len(self.blocks)
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_ids: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() takes the lowest
        self.cached: dict[bytes, int] = {}  # key -> block id
        self.evictable: OrderedDict[int, None] = OrderedDict()  # unreferenced cached blocks, LRU first
        self.pending: dict[bytes, int] = {}  # key -> block id: allocated, KV not computed yet
        self.stats = {"hit_tokens": 0, "queried_tokens": 0, "evictions": 0}

    # keys -------------------------------------------------------------------------------
    def block_key(self, parent: bytes, owner: str | None, tokens: list[int]) -> bytes:
        payload = f"{owner or ''}|{','.join(map(str, tokens))}".encode()
        return hashlib.sha256(parent + payload).digest()

    def _keys(self, seq: Sequence, upto_tokens: int, start: int = 0, parent: bytes | None = None):
        """(block index, owner, key) for the full blocks among the first ``upto_tokens``,
        from block ``start`` on (``parent`` is then the key of block ``start - 1``)."""
        parent = parent or self.root
        tokens = seq.tokens
        for index in range(start, upto_tokens // self.block_size):
            end = (index + 1) * self.block_size
            owner = kv_owner(seq.kind, seq.adapter, end, seq.invocation_start)
            parent = self.block_key(parent, owner, tokens[end - self.block_size:end])
            yield index, owner, parent

    # capacity ---------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self.free_ids) + len(self.evictable)

    def blocks_needed(self, n_tokens: int) -> int:
        return (n_tokens + self.block_size - 1) // self.block_size

    def _take(self) -> int:
        if self.free_ids:
            block_id = self.free_ids.pop()
        elif self.evictable:
            block_id, _ = self.evictable.popitem(last=False)
            block = self.blocks[block_id]
            del self.cached[block.key]
            block.key, block.owner = None, None
            self.stats["evictions"] += 1
        else:
            raise OutOfBlocks
        self.blocks[block_id].ref_count = 1
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
            block_id = self.cached.get(key)
            if block_id is None:
                if key in self.pending:
                    raise PrefixPending  # same prefix admitted just before: share it once computed
                break
            hits.append(block_id)
        fresh = self.blocks_needed(length) - len(hits)
        reusable_evictable = sum(1 for b in hits if b in self.evictable)
        if fresh > len(self.free_ids) + len(self.evictable) - reusable_evictable:
            raise OutOfBlocks
        for block_id in hits:
            self.evictable.pop(block_id, None)
            self.blocks[block_id].ref_count += 1
        seq.block_table = hits + [self._take() for _ in range(fresh)]
        for index in range(len(hits), len(keys)):
            self.pending.setdefault(keys[index], seq.block_table[index])
        seq.num_computed = len(hits) * self.block_size
        seq.hashed_blocks = len(hits)
        seq.chain_key = keys[len(hits) - 1] if hits else None
        self.stats["queried_tokens"] += len(seq.prompt)
        self.stats["hit_tokens"] += min(seq.num_computed, len(seq.prompt))

    def ensure_capacity(self, seq: Sequence, n_tokens: int) -> None:
        """Make the block table hold ``n_tokens`` tokens (raises OutOfBlocks if it cannot)."""
        need = self.blocks_needed(n_tokens) - len(seq.block_table)
        if need > self.num_free:
            raise OutOfBlocks
        for _ in range(need):
            seq.block_table.append(self._take())

    def register_computed(self, seq: Sequence) -> None:
        """Publish the sequence's newly completed full blocks in the prefix cache."""
        full = seq.num_computed // self.block_size
        if full <= seq.hashed_blocks:
            return
        # continue the chain from the last registered block instead of hashing from the root
        for index, owner, key in self._keys(seq, full * self.block_size, seq.hashed_blocks, seq.chain_key):
            block = self.blocks[seq.block_table[index]]
            if self.pending.get(key) == block.id:
                del self.pending[key]
            if key not in self.cached and block.key is None:
                block.key, block.owner = key, owner
                self.cached[key] = block.id
            seq.chain_key = key
        seq.hashed_blocks = full

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references; cached blocks stay reusable until evicted."""
        owned = set(seq.block_table)
        for key in [k for k, b in self.pending.items() if b in owned]:
            del self.pending[key]
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.key is not None:
                    self.evictable[block_id] = None
                else:
                    self.free_ids.append(block_id)
        seq.block_table = []
        seq.num_computed = 0
        seq.hashed_blocks = 0
        seq.chain_key = None

    @property
    def num_holding_kv(self) -> int:
        """Blocks that hold KV: in use by a request or kept in the prefix cache."""
        return len(self.blocks) - len(self.free_ids)

    def usage(self) -> dict:
        in_use = [b for b in self.blocks if b.ref_count > 0]
        return {
            "blocks_total": len(self.blocks),
            "blocks_in_use": len(in_use),
            "blocks_in_use_shared": sum(1 for b in in_use if b.key is not None and b.owner is None),
            "blocks_in_use_private": sum(1 for b in in_use if b.key is not None and b.owner is not None),
            "blocks_in_use_unsealed": sum(1 for b in in_use if b.key is None),
            "blocks_cached_idle": len(self.evictable),
        }
