"""One object per KV layout: how a lora adapter's keys and values are kept and shared.

As :mod:`kvshare.kinds` gives each adapter kind one :class:`~kvshare.kinds.KindSpec`, each
layout is one :class:`KVLayout` row here: the owner its blocks' keys name, what a prefix-cache
hit of it reuses, whether it may read exact base KV, and which LoRA projections it keeps out of
K/V (ForkKV's rank-r residual, in a pool of its own). Users name a layout by its string
(``EngineConfig.kv_layout``, ``load_adapter(kv_layout=...)``, ``--kv-layout``);
:func:`layout_named` turns the string into the row once, where it comes in, and the batch
planner, block manager, scheduler and engine ask the row, never compare names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from ..errors import KvshareError
from ..kinds import KindSpec, ShareScope


class KeyedRequest(Protocol):
    """What a layout reads of a sequence to key its blocks (a :class:`~.sequence.Sequence`)."""

    spec: KindSpec
    adapter_digest: str | None
    invocation_start: int | None


FORKKV_BASE = "forkkv-base"  # owner of base parts computed by ForkKV agents: a namespace of its own
FULL_REUSE_OWNER = "lora-full-reuse"  # owner of whole lora K/V shared as-is (ForkKV's quality baseline)
# what a prefix-cache hit reused: base KV read by the base or an ICaRus adapter, base KV read
# by an aLoRA before its invocation, KV an adapter owns (LoRA, aLoRA after it), the shared
# base part read by a ForkKV agent (approximate past layer 0), or whole lora K/V read as-is
REUSE_KINDS = ("shared_base", "alora_pre_invocation", "lora_private", "forkkv_base", "lora_full_reuse")


@dataclass(frozen=True)
class KVLayout:
    """What one KV layout means for the cache and the batch.

    ``shared_owner``: the owner every block key of the layout names (a namespace its agents
    share; None: the kind's own rule, :meth:`KindSpec.kv_owner`); ``hit_kind``: the
    :data:`REUSE_KINDS` entry of its prefix hits (None: by the block's owner and the kind);
    ``residual_projections``: the projections whose LoRA is kept out of K/V and goes to the
    residual pool as ``x A`` (ForkKV).
    """

    name: str
    description: str
    shared_owner: str | None = None
    hit_kind: str | None = None
    reads_exact_base: bool = False  # may read exact base blocks as its base part (never writes them)
    residual_projections: tuple[str, ...] = ()

    @property
    def uses_residual_pool(self) -> bool:
        """Its sequences hold blocks in the residual pool beside those of the KV pool."""
        return bool(self.residual_projections)

    def block_owner(self, seq: KeyedRequest, block_end: int) -> str | None:
        """Owner of the full block of ``seq`` that ends before position ``block_end``."""
        if self.shared_owner is not None:
            return self.shared_owner
        return seq.spec.kv_owner(seq.adapter_digest, block_end, seq.invocation_start)

    def reuse_kind(self, seq: KeyedRequest, owner: str | None) -> str:
        """Which of :data:`REUSE_KINDS` a hit of ``seq`` on a block owned by ``owner`` is."""
        if self.hit_kind is not None:
            return self.hit_kind
        if owner is not None:
            return "lora_private"
        if seq.spec.scope is ShareScope.BEFORE_INVOCATION:
            return "alora_pre_invocation"
        return "shared_base"


EXACT = KVLayout("exact", "K/V as the weights compute it; who may read it follows from the kind.")
# ForkKV: the base part x W of each token's K/V is shared by every ForkKV agent
# (and may be read from exact base KV), the rank-r x A_k, x A_v is private, in its own pool
FORKKV = KVLayout("forkkv", "Base part of K/V shared among ForkKV agents; rank-r residual private.",
                  shared_owner=FORKKV_BASE, hit_kind="forkkv_base", reads_exact_base=True,
                  residual_projections=("k_proj", "v_proj"))
# the baseline ForkKV is measured against: wrong by construction, in a namespace of its own
FULL_REUSE = KVLayout("full_reuse", "Whole lora K/V shared as-is with every other full-reuse agent.",
                      shared_owner=FULL_REUSE_OWNER, hit_kind="lora_full_reuse")
LAYOUTS: dict[str, KVLayout] = {layout.name: layout for layout in (EXACT, FORKKV, FULL_REUSE)}


def layout_named(name: str) -> KVLayout:
    """The layout a user names (``"exact"``, ``"forkkv"``, ``"full_reuse"``); a clear error else."""
    try:
        return LAYOUTS[name]
    except KeyError:
        raise KvshareError(f"unknown kv_layout {name!r} (expected one of: {', '.join(LAYOUTS)})") from None


def layout_of(spec: KindSpec) -> KVLayout:
    """The layout a request served under ``spec`` keeps its KV in."""
    return LAYOUTS[spec.kv_layout]


@dataclass
class ResidualState:
    """A ForkKV sequence's part of the residual pool, while it holds one: made when the pool
    admits the sequence, dropped when it frees it (or preempts it)."""

    table: list[int]  # residual-pool blocks
    hashed_blocks: int = 0  # leading blocks registered in the residual index
    chain_key: bytes | None = None  # residual-index key of the last of those
    cached: int = 0  # leading tokens whose residual came from the cache (not rewritten)
    base_cached: int = 0  # leading tokens whose base part came from the cache (not rewritten)

    @property
    def resume_at(self) -> int:
        """Where the sequence resumes: both parts are cached before it, so it rewrites neither."""
        return min(self.base_cached, self.cached)

    def write_slots(self, start: int, end: int, block_size: int) -> list[int]:
        """The residual-pool slot of each position in ``[start, end)``; -1 where the cached
        residual stays."""
        return [self.table[p // block_size] * block_size + p % block_size if p >= self.cached else -1
                for p in range(start, end)]
