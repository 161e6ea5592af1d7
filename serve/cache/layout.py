"""Which pool and which owner each block of a sequence gets.

Today there is one pool of full K/V heads shared by every kind; the owner in a block's key
comes from the request's kind spec (None = base KV, else the adapter's content digest).
ForkKV will map a ``lora`` request to two pools (shared base part, private residual) here,
without the block manager or the scheduler learning about kinds.
"""

from __future__ import annotations

from ...kinds import ShareScope
from ..sequence import Sequence


class KVLayout:
    pools = ("kv",)
    # what a prefix-cache hit reused: base KV read by the base or an ICaRus adapter, base KV
    # read by an aLoRA before its invocation, or KV an adapter owns (LoRA, aLoRA after it)
    reuse_kinds = ("shared_base", "alora_pre_invocation", "lora_private")

    def block_owner(self, seq: Sequence, block_end: int) -> str | None:
        """Owner of the full block of ``seq`` that ends before position ``block_end``."""
        return seq.spec.kv_owner(seq.adapter_digest, block_end, seq.invocation_start)

    def reuse_kind(self, seq: Sequence, owner: str | None) -> str:
        """Which of :attr:`reuse_kinds` a hit of ``seq`` on a block owned by ``owner`` is."""
        if owner is not None:
            return "lora_private"
        if seq.spec.scope is ShareScope.BEFORE_INVOCATION:
            return "alora_pre_invocation"
        return "shared_base"
