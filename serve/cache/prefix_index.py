"""The prefix index: a hash chain over full blocks, as in vLLM, plus the pending table.

A hash chain rather than SGLang's radix tree: one dict lookup per block is enough for exact
reuse, and chaining makes a block's key depend on everything before it (base fingerprint,
earlier tokens and their owners) without a tree to maintain. Only full blocks are indexed;
a sequence's partly filled last block is always private.

A key is ``sha256(parent key + owner + tokens)``; the root is the base fingerprint (and the
request's ``cache_salt``, if any), so two bases, or two tenants with their own salts, never
share keys. ``pending`` holds keys whose block is allocated but not computed
yet, so a second request with the same prefix waits and reuses it instead of recomputing.
"""

from __future__ import annotations

import hashlib


class PrefixIndex:
    def __init__(self, base_fingerprint: str, namespace: str = "kvshare-kv"):
        self.root = hashlib.sha256(f"{namespace}:{base_fingerprint}".encode()).digest()
        self.clear()

    def clear(self) -> None:
        self.cached: dict[bytes, int] = {}  # key -> block id holding that KV
        self.pending: dict[bytes, int] = {}  # key -> block id: allocated, KV not computed yet

    def root_for(self, cache_salt: str | None) -> bytes:
        """The chain's root for a request: with a ``cache_salt`` (vLLM's per-tenant field) the
        salt is hashed into it, so every key of the chain differs and requests with different
        salts never share a block (nor learn, through cached-token counts, what others sent)."""
        if cache_salt is None:
            return self.root
        return hashlib.sha256(self.root + b"cache_salt:" + cache_salt.encode()).digest()

    @staticmethod
    def block_key(parent: bytes, owner: str | None, tokens: list[int]) -> bytes:
        payload = f"{owner or ''}|{','.join(map(str, tokens))}".encode()
        return hashlib.sha256(parent + payload).digest()

    def lookup(self, key: bytes) -> int | None:
        return self.cached.get(key)

    def is_pending(self, key: bytes) -> bool:
        return key in self.pending

    def mark_pending(self, key: bytes, block_id: int) -> None:
        self.pending.setdefault(key, block_id)

    def publish(self, key: bytes, block_id: int) -> bool:
        """The block now holds this key's KV (no longer pending). False if another block
        already serves the key (the caller keeps its block private)."""
        if self.pending.get(key) == block_id:
            del self.pending[key]
        if key in self.cached:
            return False
        self.cached[key] = block_id
        return True

    def forget(self, key: bytes) -> None:
        del self.cached[key]

    def drop_pending_of(self, block_ids: set[int]) -> None:
        for key in [k for k, b in self.pending.items() if b in block_ids]:
            del self.pending[key]
