"""Which pool and which owner each block of a sequence gets.

Today there is one pool of full K/V heads shared by every kind; the owner in a block's key
comes from the request's kind spec (None = base KV, else the adapter's content digest).
ForkKV will map a ``lora`` request to two pools (shared base part, private residual) here,
without the block manager or the scheduler learning about kinds.
"""

from __future__ import annotations

from ..sequence import Sequence


class KVLayout:
    pools = ("kv",)

    def block_owner(self, seq: Sequence, block_end: int) -> str | None:
        """Owner of the full block of ``seq`` that ends before position ``block_end``."""
        return seq.spec.kv_owner(seq.adapter_digest, block_end, seq.invocation_start)
