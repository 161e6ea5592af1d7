"""Adapter kinds and the KV-sharing rule each one implies.

This module is the single place where a kind's sharing rule is written down; the manifest,
the export checks and (later) the serving engine's prefix-cache keys all read it from here.
See BRIEF.md, "Three adapter kinds, three sharing rules".
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from .errors import KvshareError


class AdapterKind(str, Enum):
    LORA = "lora"
    ALORA = "alora"
    ICARUS = "icarus"


class ShareScope(str, Enum):
    """Which cached KV of a sequence may be reused across adapters."""

    NONE = "none"  # every token's KV is the adapter's own: cache key = (adapter, tokens)
    BEFORE_INVOCATION = "before_invocation"  # base KV up to the invocation start
    ALL = "all"  # keys and values always come from the frozen base


@dataclass(frozen=True)
class SharingRule:
    kind: AdapterKind
    scope: ShareScope
    description: str
    forbidden_target_modules: tuple[str, ...] = ()

    def to_json(self) -> dict:
        return {"scope": self.scope.value, "description": self.description}


SHARING_RULES: dict[AdapterKind, SharingRule] = {
    AdapterKind.LORA: SharingRule(
        AdapterKind.LORA,
        ShareScope.NONE,
        "Conventional LoRA changes the keys and values of every token: its KV is private, "
        "cache key = (adapter, tokens); nothing is shared with the base or other adapters.",
    ),
    AdapterKind.ALORA: SharingRule(
        AdapterKind.ALORA,
        ShareScope.BEFORE_INVOCATION,
        "Activated LoRA applies only from the start of the last occurrence of its invocation "
        "tokens: KV before that point is the base's and is shared with the base and every "
        "other adapter in both directions; KV from the invocation on is the adapter's own.",
    ),
    AdapterKind.ICARUS: SharingRule(
        AdapterKind.ICARUS,
        ShareScope.ALL,
        "ICaRus decoder-only LoRA never writes KV: keys and values always come from the "
        "frozen base, for prompt and generated tokens alike, so every cached token is "
        "shared with the base and every other ICaRus adapter.",
        # LoRA on k_proj/v_proj would change the KV and break sharing (and is dead weight).
        forbidden_target_modules=("k_proj", "v_proj"),
    ),
}


def parse_kind(value: str) -> AdapterKind:
    """Turn a user string into an AdapterKind, with a clear error for anything else."""
    try:
        return AdapterKind(value)
    except ValueError:
        known = ", ".join(k.value for k in AdapterKind)
        raise KvshareError(f"unknown adapter kind {value!r} (expected one of: {known})") from None


def sharing_rule(kind: AdapterKind | str) -> SharingRule:
    return SHARING_RULES[parse_kind(kind) if isinstance(kind, str) else kind]


def kv_owner(kind: AdapterKind | None, adapter: str | None, block_end: int,
             invocation_start: int | None) -> str | None:
    """Whose KV a full cache block holds, for prefix-cache keys: None = the base's (shared).

    ``block_end`` is the position after the block's last token; ``invocation_start`` is where
    an aLoRA's last invocation begins in the prompt (None: not found, so the request behaves
    as the base). This is the one place the engine turns a kind's rule into cache keys.
    """
    if kind is None or kind is AdapterKind.ICARUS:
        return None  # base KV: the base's own requests, or ICaRus (K/V always from the base)
    if kind is AdapterKind.LORA:
        return adapter
    if invocation_start is None or block_end <= invocation_start:
        return None  # aLoRA before its invocation computes exactly the base's KV
    return adapter
