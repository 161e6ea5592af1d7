"""Which pool and which owner each block of a sequence gets.

The pool of full K/V heads is shared by every kind; the owner in a block's key comes from
the request's kind spec (None = base KV, else the adapter's content digest). A ForkKV
request's blocks in that pool hold only the base part of its K/V, under an owner of their
own (:data:`FORKKV_BASE`: any ForkKV agent's, never an exact kind's), and its rank-r
residual goes to the residual pool (:mod:`.residual`), keyed by the adapter's digest.
"""

from __future__ import annotations

from ...kinds import ShareScope
from ..sequence import Sequence


FORKKV_BASE = "forkkv-base"  # owner of base parts computed by ForkKV agents: a namespace of its own
FULL_REUSE = "lora-full-reuse"  # owner of whole lora K/V shared as-is (ForkKV's quality baseline)


class KVLayout:
    pools = ("kv", "forkkv_residual")
    # what a prefix-cache hit reused: base KV read by the base or an ICaRus adapter, base KV
    # read by an aLoRA before its invocation, KV an adapter owns (LoRA, aLoRA after it), or
    # the shared base part read by a ForkKV agent (approximate past layer 0)
    reuse_kinds = ("shared_base", "alora_pre_invocation", "lora_private", "forkkv_base", "lora_full_reuse")

    def block_owner(self, seq: Sequence, block_end: int) -> str | None:
        """Owner of the full block of ``seq`` that ends before position ``block_end``."""
        if seq.forkkv:
            return FORKKV_BASE
        if seq.spec.kv_layout == "full_reuse":
            return FULL_REUSE
        return seq.spec.kv_owner(seq.adapter_digest, block_end, seq.invocation_start)

    def reads_exact_base(self, seq: Sequence) -> bool:
        """ForkKV agents may also read exact base blocks as their base part (never write them)."""
        return seq.forkkv

    def reuse_kind(self, seq: Sequence, owner: str | None) -> str:
        """Which of :attr:`reuse_kinds` a hit of ``seq`` on a block owned by ``owner`` is."""
        if seq.forkkv:
            return "forkkv_base"
        if owner == FULL_REUSE:
            return "lora_full_reuse"
        if owner is not None:
            return "lora_private"
        if seq.spec.scope is ShareScope.BEFORE_INVOCATION:
            return "alora_pre_invocation"
        return "shared_base"
