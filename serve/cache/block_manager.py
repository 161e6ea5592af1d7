"""The block manager: the one object the scheduler asks for KV blocks.

It composes a :class:`BlockPool` (ids and references), a :class:`PrefixIndex` (which block
holds which prefix) and an :class:`EvictionPolicy` (which idle cached block goes first); each
sequence's :class:`~..kv_layout.KVLayout` names the owner in its blocks' keys. Blocks that are
cached and unreferenced stay reusable until the policy gives them up.

With an :class:`AgentTable` each block also knows which agents' fixed prompts pass through
it (its *readers*; a shared block collects every agent that reads it) and whether it holds
a dynamic suffix, which is what the step-aware policy ranks by. With a :class:`HostTier`,
an evicted block worth keeping goes to host memory, and a prompt whose prefix is there is
loaded back (the request is skipped until its blocks land) instead of recomputed.

A ForkKV request (:mod:`.residual`) takes blocks in both pools at once: its base part here
(the longest prefix found under ForkKV's owner or as exact base KV), its residual there. It
resumes from the shorter of the two cached prefixes and rewrites neither cached part.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ...errors import KvshareError
from ..kv_layout import REUSE_KINDS
from ..sequence import Sequence
from .agents import AgentKey, AgentTable
from .host_tier import HostTier
from .policy import EvictionPolicy, LRUPolicy
from .pool import BlockPool, OutOfBlocks
from .prefix_index import PrefixIndex
from .residual import ResidualCache


class PrefixPending(Exception):
    """The next block of this prompt is being computed for another request: wait, then reuse it."""


class PrefixLoading(Exception):
    """Blocks of this prompt are being loaded back from the host tier: skip it for now."""


@dataclass
class CacheStats:
    hit_tokens: int = 0  # prompt tokens served from the prefix cache (device or host tier)
    queried_tokens: int = 0  # prompt tokens looked up
    evictions: int = 0
    host_hit_tokens: int = 0  # of hit_tokens, those loaded back from the host tier
    # prompt tokens whose ForkKV base part was read from the cache, resumed from or not (a
    # ForkKV agent reading another's base part still computes its own residual there)
    forkkv_base_read_tokens: int = 0
    # of hit_tokens, by the kind of KV reused (KVLayout.reuse_kind): what sharing saved
    hit_tokens_by_kind: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REUSE_KINDS, 0))


@dataclass
class BlockInfo:
    key: bytes | None = None  # set once the block is full, computed and published
    owner: str | None = None
    parent: bytes | None = None  # key of the block before it in its chain
    readers: set[AgentKey] = field(default_factory=set)  # agents whose fixed prompt passes through it
    dynamic: bool = False  # a hinted request's dynamic suffix (or output), read by no fixed prompt
    loaded_for: str | None = None  # the request whose demand loaded it back from the host tier


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, base_fingerprint: str,
                 policy: EvictionPolicy | None = None,
                 agents: AgentTable | None = None, host_tier: HostTier | None = None,
                 residual: ResidualCache | None = None):
        self.block_size = block_size
        self.residual = residual  # ForkKV's residual pool, when the engine has one
        self.index = PrefixIndex(base_fingerprint)
        self.policy = policy if policy is not None else LRUPolicy()  # an empty policy is falsy
        self.agents = agents if agents is not None else AgentTable()
        self.tier = host_tier
        self.reset(num_blocks)

    def reset(self, num_blocks: int | None = None, owned: list[int] | None = None) -> None:
        """Forget every cached block and zero the statistics (no sequence may hold blocks).
        ``num_blocks``: the ids the KV view addresses (default: as before); ``owned``: those
        this engine may use (default: the same as before, or all of a new view)."""
        if hasattr(self, "pool") and self.pool.num_referenced():
            raise RuntimeError("cannot reset the KV pool while requests hold blocks")
        if owned is None and num_blocks is None:
            owned = [b for b, mine in enumerate(self.pool.owned) if mine]
        capacity = num_blocks or self.pool.capacity
        if self.tier is not None:
            self.tier.clear()
        self.pool = BlockPool(capacity, owned=owned)
        self.blocks = [BlockInfo() for _ in range(capacity)]
        self.children: dict[bytes, int] = {}  # key -> cached blocks whose parent it is
        self.loading: dict[bytes, int] = {}  # key -> device block a load is filling
        self.pinned_by: dict[int, int] = {}  # block -> how many waiting requests hold it
        self.pinned_seqs: dict[str, Sequence] = {}
        self.demanded_by: dict[int, str] = {}  # device block a demand load fills -> the request that asked
        self.index.clear()
        self.policy = type(self.policy)()  # a fresh policy of the engine's kind
        self.policy.bind(self.rank, self.is_leaf, self.rank_version)
        self.stats = CacheStats()
        if self.residual is not None:
            self.residual.reset()

    # what the policy ranks by ---------------------------------------------------------------
    def rank(self, block_id: int) -> tuple:
        """Lower goes first: (0, 0) for a block no fixed prompt reads, else (1, -steps) with
        steps = the nearest next call of the agents that read it."""
        readers = self.blocks[block_id].readers
        if not readers:
            return (0, 0.0)
        return (1, -min(self.agents.steps_of(agent) for agent in readers))

    def rank_version(self) -> int:
        """Changes whenever an idle block's rank may have changed: only the agents' steps can
        (a block gains readers only on a hit, which takes it out of the policy first)."""
        return self.agents.version

    def is_leaf(self, block_id: int) -> bool:
        """No cached block continues this one's chain (so evicting it strands nothing)."""
        return not self.children.get(self.blocks[block_id].key)

    # keys -------------------------------------------------------------------------------
    def _keys(self, seq: Sequence, upto_tokens: int, start: int = 0, parent: bytes | None = None,
              exact_base: bool = False):
        """(block index, owner, key) for the full blocks among the first ``upto_tokens``,
        from block ``start`` on (``parent`` is then the key of block ``start - 1``);
        ``exact_base``: the keys the same tokens have as exact base KV."""
        parent = parent or self.index.root_for(seq.params.cache_salt)
        tokens, bs, layout = seq.tokens, self.block_size, seq.layout
        for index in range(start, upto_tokens // bs):
            end = (index + 1) * bs
            owner = None if exact_base else layout.block_owner(seq, end)
            parent = self.index.block_key(parent, self._key_owner(seq, owner, end), tokens[end - bs:end])
            yield index, owner, parent

    def _key_owner(self, seq: Sequence, owner: str | None, block_end: int) -> str | None:
        """The owner as a key names it: where an aLoRA's KV starts mid-block, the offset too.
        The same tokens can hold the last invocation at two places in one block (an invocation,
        then the beginning of another that ends in the next block): base KV before the start,
        adapter KV after it, so the two blocks differ."""
        start = seq.invocation_start
        if owner is not None and owner == seq.adapter_digest and start is not None \
                and block_end - self.block_size < start < block_end:
            return f"{owner}@{start - (block_end - self.block_size)}"
        return owner

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
        self._evict(block_id)
        self.pool.ref(block_id)
        return block_id

    def _evict(self, block_id: int) -> None:
        """Drop a cached idle block from the device index; keep a copy in the host tier
        unless it is a dynamic suffix nobody will ask for again."""
        info = self.blocks[block_id]
        if self.tier is not None and not info.dynamic:
            self.tier.offload(info.key, block_id, (info.owner, info.parent, set(info.readers)))
        self.index.forget(info.key)
        self._unlink(info)
        self.blocks[block_id] = BlockInfo()
        self.stats.evictions += 1

    def _link(self, block_id: int, key: bytes, owner: str | None, parent: bytes | None,
              readers: set[AgentKey], dynamic: bool, loaded_for: str | None = None) -> None:
        self.blocks[block_id] = BlockInfo(key, owner, parent, readers, dynamic, loaded_for)
        if parent is not None:
            self.children[parent] = self.children.get(parent, 0) + 1

    def _unlink(self, info: BlockInfo) -> None:
        if info.parent is not None:
            left = self.children[info.parent] - 1
            if left:
                self.children[info.parent] = left
            else:
                del self.children[info.parent]

    # sequence lifecycle -----------------------------------------------------------------
    def allocate(self, seq: Sequence) -> None:
        """Give a new sequence its blocks: reuse cached prefix blocks, fresh ones for the rest.

        All-or-nothing: raises OutOfBlocks without changing anything if the pool is short,
        PrefixPending if the next block is being computed for another request, and
        PrefixLoading (after starting the loads) if part of its prefix is in the host tier.
        """
        length = len(seq)
        chain = list(self._keys(seq, length))
        keys = [key for _, _, key in chain]
        exact = [key for _, _, key in self._keys(seq, length, exact_base=True)] \
            if seq.layout.reads_exact_base else None
        if seq.agent is not None and seq.fixed_blocks is None:  # once: retries must not relearn
            seq.fixed_blocks = self.agents.fixed_blocks(seq.agent, keys[:len(seq.prompt) // self.block_size],
                                                        seq.hints.fixed_prefix_tokens, self.block_size)
        hits: list[int] = []
        hit_keys: list[bytes] = []  # the key each hit is stored under (ForkKV: its own or the exact base's)
        for index, key in enumerate(keys):
            block_id, stored_under_now = self.index.lookup(key), key
            if block_id is None and exact is not None:
                block_id, stored_under_now = self.index.lookup(exact[index]), exact[index]  # read, never write
            if block_id is None:
                if self.index.is_pending(key):
                    raise PrefixPending  # same prefix admitted just before: share it once computed
                if self.tier is not None:
                    rest = keys[index:] if exact is None else \
                        [self._held_key(own, base) for own, base in zip(keys[index:], exact[index:])]
                    if rest[0] in self.loading or rest[0] in self.tier:
                        self._load_back(seq, rest, hits)  # raises PrefixLoading if it started loads
                break
            hits.append(block_id)
            hit_keys.append(stored_under_now)
        fresh = self.blocks_needed(length) - len(hits)
        reusable_evictable = sum(1 for b in hits if b in self.policy)
        if fresh > self.num_free - reusable_evictable:
            raise OutOfBlocks
        res_hits = []
        if seq.layout.uses_residual_pool:
            res_hits = self.residual.match(seq)
            if not self.residual.can_take(self.residual.fresh_needed(seq, res_hits), res_hits):
                raise OutOfBlocks
        for index, block_id in enumerate(hits):
            self.policy.remove(block_id)
            self.pool.ref(block_id)
            self._mark_read(seq, index, block_id)
            if self.tier is not None:
                self.tier.touch(hit_keys[index])  # a hit refreshes recency in both tiers
        self.unpin(seq)  # its own references replace the pins
        seq.block_table = hits + [self._take() for _ in range(fresh)]
        for index in range(len(hits), len(keys)):
            self.index.mark_pending(keys[index], seq.block_table[index])
        seq.num_computed = len(hits) * self.block_size
        if seq.layout.uses_residual_pool:  # resume where both parts are cached; rewrite neither
            state = self.residual.allocate(seq, res_hits)
            state.base_cached = seq.num_computed
            seq.num_computed = state.resume_at
        seq.hashed_blocks = len(hits)
        seq.chain_key = keys[len(hits) - 1] if hits else None
        seq.parent_key = hit_keys[-1] if hits else None
        if seq.waiting_on_loads_since is not None:
            seq.load_wait_s += time.perf_counter() - seq.waiting_on_loads_since
            seq.waiting_on_loads_since = None
        if seq.preemptions:  # admitted again: its prompt was counted once, and its hits now are its own
            return
        prompt = len(seq.prompt)
        self.stats.queried_tokens += prompt
        self.stats.hit_tokens += min(seq.num_computed, prompt)
        if seq.residual is not None:
            self.stats.forkkv_base_read_tokens += min(seq.residual.base_cached, prompt)
        # the hits it resumes from (not all it found): by whose KV they reused, and those its own
        # demand loaded back from the host tier
        for index, owner, _ in chain[:seq.num_computed // self.block_size]:
            tokens = min((index + 1) * self.block_size, prompt) - index * self.block_size
            if tokens > 0:
                self.stats.hit_tokens_by_kind[seq.layout.reuse_kind(seq, owner)] += tokens
                if self.blocks[hits[index]].loaded_for == seq.request_id:
                    self.stats.host_hit_tokens += tokens

    def _held_key(self, own: bytes, exact_base: bytes) -> bytes:
        """The key a ForkKV request reads a block under: its own, else the exact base's (read,
        never written), whichever the device, a load or the host tier holds."""
        if self.index.lookup(own) is not None or own in self.loading or own in self.tier:
            return own
        return exact_base

    def _mark_read(self, seq: Sequence, index: int, block_id: int) -> None:
        """Record that ``seq``'s agent reads this block as part of its fixed prompt."""
        if seq.agent is not None and index < seq.fixed_blocks:
            info = self.blocks[block_id]
            info.readers.add(seq.agent)
            info.dynamic = False

    def _load_back(self, seq: Sequence, keys: list[bytes], hits: list[int]) -> None:
        """The prompt continues in the host tier: pin the chain's blocks on the device for this
        request, start loading the ones on host (in chain order) and raise PrefixLoading.
        Returns (pinning nothing) when nothing can load or the whole request would not fit
        once loaded: the rest is then recomputed. Pins keep the chain from being evicted
        (by other loads, a prefetch, this request's own loads) until it is admitted."""
        on_device, loading, to_load = list(hits), 0, []
        for key in keys:
            block_id = self.index.lookup(key)
            if block_id is not None:
                on_device.append(block_id)
            elif key in self.loading:
                loading += 1
            elif key in self.tier and not self.index.is_pending(key):
                to_load.append(key)
            else:
                break  # the chain ends here (or a request computes it now): recompute from this block on
        if not loading and not to_load:
            self.unpin(seq)
            return
        held = set(seq.pinned)  # from earlier attempts (landed loads included): keep them
        for block_id in on_device:
            if block_id not in held:
                self._pin(seq, block_id)
        if self.blocks_needed(len(seq)) - len(on_device) - loading > self.num_free:
            self.unpin(seq)  # could not be admitted even once loaded: recompute instead
            return
        for key in keys:
            if key in self.loading:
                self.tier.promote(key)
        for i, key in enumerate(to_load):
            block_id = self._start_load(key, demand=True, keep=to_load[i:])
            self.pinned_by[block_id] = self.pinned_by.get(block_id, 0) + 1  # the load's reference is the pin
            seq.pinned.append(block_id)
            self.demanded_by[block_id] = seq.request_id
        self.pinned_seqs[seq.request_id] = seq
        if seq.waiting_on_loads_since is None:
            seq.waiting_on_loads_since = time.perf_counter()
        raise PrefixLoading

    def _pin(self, seq: Sequence, block_id: int) -> None:
        self.policy.remove(block_id)
        self.pool.ref(block_id)
        self.pinned_by[block_id] = self.pinned_by.get(block_id, 0) + 1
        seq.pinned.append(block_id)
        self.pinned_seqs[seq.request_id] = seq

    def unpin(self, seq: Sequence) -> None:
        """Drop the blocks held for a waiting request (it was admitted, aborted or gave up)."""
        self.pinned_seqs.pop(seq.request_id, None)
        for block_id in seq.pinned:
            self.pinned_by[block_id] -= 1
            if not self.pinned_by[block_id]:
                del self.pinned_by[block_id]
            if self.blocks[block_id].key is None and block_id in self.loading.values():
                continue  # still loading: the landing drops the load's reference
            self._unref(block_id)
        seq.pinned = []

    def release_pins(self, keep: Sequence | None = None) -> bool:
        """Give every pinned block back, but those of ``keep`` (a running request, or the first
        in line, needs room); False if none was."""
        held = [seq for seq in self.pinned_seqs.values() if seq is not keep]
        for seq in held:
            self.unpin(seq)
        return bool(held)

    def _unref(self, block_id: int) -> None:
        if self.pool.unref(block_id):
            if self.blocks[block_id].key is not None:
                self.policy.add(block_id)
            else:
                self.pool.release(block_id)

    def _start_load(self, key: bytes, demand: bool, keep: list[bytes] = ()) -> int:
        """Take a device block and start loading ``key`` into it. Taking it may evict (and
        offload) another block; ``key`` and ``keep`` (the next loads) stay on the host meanwhile."""
        self.tier.kept.update((key, *keep))
        try:
            block_id = self._take()
        finally:
            self.tier.kept.clear()
        self.loading[key] = block_id
        self.tier.load(key, block_id, demand)
        return block_id

    def poll_loads(self) -> int:
        """Publish the blocks whose loads landed (the engine calls this every step); they
        become idle cached blocks, found by the next lookup. Returns how many landed."""
        if self.tier is None:
            return 0
        landed = self.tier.landed()
        for transfer in landed:
            block_id = self.loading.pop(transfer.key)
            asked_by = self.demanded_by.pop(block_id, None)
            owner, parent, readers = self.tier.meta.get(transfer.key, (None, None, set()))
            if transfer.error is None and self.index.publish(transfer.key, block_id):
                self._link(block_id, transfer.key, owner, parent, set(readers), False, loaded_for=asked_by)
            if block_id not in self.pinned_by:  # a prefetch, or its request gave up: idle cached
                self._unref(block_id)  # (a failed copy: nothing published, the block goes free)
        return len(landed)

    def loads_in_flight(self) -> int:
        return len(self.loading)

    def wait_for_loads(self, timeout: float) -> None:
        if self.tier is not None and self.loading:
            self.tier.wait(timeout)

    def land_loads(self, why: str, timeout: float = 60.0) -> None:
        """Let the host tier's loads in flight land and be collected (a prefetch the last step
        started: each holds a block until then), before ``why`` changes the pool under them."""
        deadline = time.monotonic() + timeout
        while self.loads_in_flight():
            if time.monotonic() > deadline:
                raise KvshareError(f"{why}: host-tier loads did not land within {timeout:g} s")
            self.wait_for_loads(1.0)
            self.poll_loads()

    def prefetch(self, within: int, reserve: int = 0) -> int:
        """Load back the fixed prompts of the agents due within ``within`` steps, nearest
        first, into free blocks or in place of blocks the policy ranks below them (never
        evicting what a nearer agent needs), leaving ``reserve`` blocks for the requests in
        flight (a demand outranks a prefetch). Returns how many loads it started."""
        if self.tier is None or within < 1:
            return 0
        started = 0
        for steps, agent in self.agents.due(within):
            for key in self.agents.fixed_keys.get(agent, ()):
                if self.index.lookup(key) is not None or key in self.loading or self.index.is_pending(key):
                    continue  # there, on its way, or being computed by a request
                if key not in self.tier:
                    break  # the rest of the chain is not there to load
                if self.num_free <= reserve:
                    return started
                if not self.pool.num_free:
                    victim = self.policy.peek_rank()
                    if victim is None or victim >= (1, -steps):
                        return started  # what is left on the device is needed as soon
                self._start_load(key, demand=False)
                started += 1
        return started

    def ensure_capacity(self, seq: Sequence, n_tokens: int) -> None:
        """Make the block table hold ``n_tokens`` tokens (raises OutOfBlocks if it cannot)."""
        need = self.blocks_needed(n_tokens) - len(seq.block_table)
        if need > self.num_free:
            raise OutOfBlocks
        if seq.layout.uses_residual_pool:
            self.residual.ensure_capacity(seq, n_tokens)  # checks before it takes
        for _ in range(need):
            seq.block_table.append(self._take())

    def register_computed(self, seq: Sequence) -> None:
        """Publish the sequence's newly completed full blocks in the prefix index."""
        if seq.layout.uses_residual_pool:
            self.residual.register_computed(seq)
        full = seq.num_computed // self.block_size
        if full <= seq.hashed_blocks:
            return
        # continue the chain from the last published block instead of hashing from the root
        for index, owner, key in self._keys(seq, full * self.block_size, seq.hashed_blocks, seq.chain_key):
            block_id = seq.block_table[index]  # freshly computed here, so never published before
            if self.index.publish(key, block_id):
                fixed = seq.agent is not None and index < seq.fixed_blocks
                self._link(block_id, key, owner, seq.parent_key, {seq.agent} if fixed else set(),
                           dynamic=seq.agent is not None and not fixed)
            seq.chain_key = seq.parent_key = key
        seq.hashed_blocks = full

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references; cached blocks stay reusable until evicted."""
        self.unpin(seq)
        self.index.drop_pending_of(set(seq.block_table))
        for block_id in reversed(seq.block_table):
            self._unref(block_id)
        if seq.residual is not None:
            self.residual.free(seq)
        seq.block_table = []
        seq.num_computed = 0
        seq.hashed_blocks = 0
        seq.chain_key = seq.parent_key = None

    # lending (SwiftCache) ------------------------------------------------------------------
    def grant(self, block_ids: list[int]) -> None:
        """Blocks of the shared arena this engine may use from now on."""
        self.pool.grant(block_ids)

    def busy(self, block_ids: list[int]) -> list[int]:
        """Those of ``block_ids`` that a request holds (running, pinned or loading into)."""
        return [b for b in block_ids if self.pool.ref_count[b]]

    def loading_into(self, block_ids: list[int]) -> list[int]:
        """Those of ``block_ids`` a host-tier load is filling."""
        loading = set(self.loading.values())
        return [b for b in block_ids if b in loading]

    def withdraw(self, block_ids: list[int]) -> None:
        """Give blocks back to the arena; none may be held. Cached idle ones leave the prefix
        index first (to the host tier, if any), so no later lookup finds KV that is gone."""
        if self.busy(block_ids):
            raise ValueError(f"blocks {self.busy(block_ids)} are in use")
        for block_id in block_ids:
            if block_id in self.policy:
                self.policy.remove(block_id)
                self._evict(block_id)
                self.pool.release(block_id)
        self.pool.withdraw(block_ids)

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
