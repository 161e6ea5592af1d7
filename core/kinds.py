"""One spec per adapter kind: everything a kind means, for train, export, serve and eval.

A kind decides which projections a LoRA may adapt, how a chat is laid out for it, whose
weights compute each token's keys and values, and whose weights compute each token's
query path (the logits). Everything else - which KV may be shared, which rows a serving
step needs, the owner in a prefix-cache key - follows from those two per-position answers,
so no caller branches on the kind's name (PEFT's variant table is the model: adding a kind
is one row here). See BRIEF.md, "Three adapter kinds, three sharing rules".
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from .errors import KvshareError


def find_invocation_start(tokens: list[int], invocation: list[int]) -> int | None:
    """PEFT's rule: the start of the last exact occurrence of the invocation tokens."""
    n = len(invocation)
    for start in range(len(tokens) - n, -1, -1):
        if list(tokens[start:start + n]) == list(invocation):
            return start
    return None


class AdapterKind(str, Enum):
    LORA = "lora"
    ALORA = "alora"
    ICARUS = "icarus"


class ShareScope(str, Enum):
    """Which cached KV of a sequence may be reused across adapters."""

    NONE = "none"  # every token's KV is the adapter's own: cache key = (adapter, tokens)
    BEFORE_INVOCATION = "before_invocation"  # base KV up to the invocation start
    ALL = "all"  # keys and values always come from the frozen base
    FORKKV = "forkkv"  # base part of K/V shared among ForkKV agents (approximate); rank-r residual private
    FULL_REUSE = "full_reuse"  # whole lora K/V shared as-is (ForkKV's quality baseline)


ALL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
DECODER_ONLY_PROJECTIONS = ("q_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class KindSpec:
    """What one kind of adapter (or the bare base, ``kind=None``) means.

    ``kv_adapted`` / ``query_adapted`` say where the adapter's weights compute a token's
    K/V and its query path: ``"never"``, ``"always"`` or ``"from_invocation"`` (from the start
    of the last invocation on; nowhere when the prompt lacks it, as in PEFT).
    """

    kind: AdapterKind | None
    scope: ShareScope
    description: str
    kv_adapted: str
    query_adapted: str
    default_targets: tuple[str, ...] = ()
    forbidden_targets: tuple[str, ...] = ()
    needs_invocation: bool = False  # chat layout: conversation + invocation, no assistant header
    kv_layout: str = "exact"  # "exact": KV as the weights compute it; "forkkv": base part + residual

    @property
    def name(self) -> str:
        return self.kind.value if self.kind is not None else "base"

    @staticmethod
    def _adapted(rule: str, position: int, invocation_start: int | None) -> bool:
        if rule == "always":
            return True
        if rule == "from_invocation":
            return invocation_start is not None and position >= invocation_start
        return False

    @property
    def base_kv_only(self) -> bool:
        """The adapter computes queries over K/V that always come from the frozen base
        (ICaRus): training attends to the base's K/V, serving pairs a base row with an
        adapter row."""
        return self.kv_adapted == "never" and self.query_adapted != "never"

    def kv_from_adapter(self, position: int, invocation_start: int | None = None) -> bool:
        """Whether the adapter's weights compute the K/V of the token at ``position``."""
        return self._adapted(self.kv_adapted, position, invocation_start)

    def query_from_adapter(self, position: int, invocation_start: int | None = None) -> bool:
        """Whether the adapter's weights compute the logits at ``position``."""
        return self._adapted(self.query_adapted, position, invocation_start)

    def kv_owner(self, adapter_digest: str | None, block_end: int,
                 invocation_start: int | None) -> str | None:
        """Whose KV a full cache block (positions ``< block_end``) holds: None = the base's.

        The adapter's *content digest*, never its name, names adapter KV: another adapter
        loaded later under the same name must not hit these blocks.
        """
        if adapter_digest is not None and self.kv_from_adapter(block_end - 1, invocation_start):
            return adapter_digest
        return None

    def to_json(self) -> dict:
        return {"scope": self.scope.value, "description": self.description}


BASE = KindSpec(None, ShareScope.ALL, "The frozen base: its KV is shared with every kind that reads base KV.",
                kv_adapted="never", query_adapted="never")

KINDS: dict[AdapterKind, KindSpec] = {
    AdapterKind.LORA: KindSpec(
        AdapterKind.LORA, ShareScope.NONE,
        "Conventional LoRA changes the keys and values of every token: its KV is private, "
        "cache key = (adapter, tokens); nothing is shared with the base or other adapters.",
        kv_adapted="always", query_adapted="always", default_targets=ALL_PROJECTIONS,
    ),
    AdapterKind.ALORA: KindSpec(
        AdapterKind.ALORA, ShareScope.BEFORE_INVOCATION,
        "Activated LoRA applies only from the start of the last occurrence of its invocation "
        "tokens: KV before that point is the base's and is shared with the base and every "
        "other adapter in both directions; KV from the invocation on is the adapter's own.",
        kv_adapted="from_invocation", query_adapted="from_invocation",
        default_targets=("q_proj", "k_proj", "v_proj"), needs_invocation=True,
    ),
    AdapterKind.ICARUS: KindSpec(
        AdapterKind.ICARUS, ShareScope.ALL,
        "ICaRus decoder-only LoRA never writes KV: keys and values always come from the "
        "frozen base, for prompt and generated tokens alike, so every cached token is "
        "shared with the base and every other ICaRus adapter.",
        kv_adapted="never", query_adapted="always", default_targets=DECODER_ONLY_PROJECTIONS,
        # LoRA on k_proj/v_proj would change the KV and break sharing (and is dead weight).
        forbidden_targets=("k_proj", "v_proj"),
    ),
}


# A conventional LoRA served with ForkKV's disaggregated KV (BRIEF.md, "ForkKV"): its K/V
# projections are split into the base part x W (shared by every ForkKV agent through a pool
# in its own namespace, never readable by exact kinds) and the rank-r x A (private, keyed by
# the adapter's digest). Approximate past layer 0: the shared part was computed from another
# agent's hidden states. Opt-in per engine or adapter; the kind's default stays exact.
FORKKV_LORA = KindSpec(
    AdapterKind.LORA, ShareScope.FORKKV,
    "Conventional LoRA served with ForkKV: the base part of each token's K/V (x W_k after "
    "RoPE, x W_v) is shared with every other ForkKV agent over the same tokens and may be read "
    "from exact base KV; only x A_k and x A_v (rank r) are private, keyed by (tokens, adapter). "
    "Approximate past layer 0 when another agent computed the shared part.",
    kv_adapted="always", query_adapted="always", default_targets=ALL_PROJECTIONS, kv_layout="forkkv",
)
# "Full reuse", the baseline ForkKV is measured against (the paper's Table 2): a lora agent
# reads the whole K/V of whichever lora agent computed the tokens first, adapter deltas
# included. Wrong by construction; kept in a namespace of its own and served only when asked.
FULL_REUSE_LORA = KindSpec(
    AdapterKind.LORA, ShareScope.FULL_REUSE,
    "Conventional LoRA whose whole K/V is shared as-is with every other full-reuse lora agent "
    "(a quality baseline for ForkKV, not a serving mode: another adapter's K/V is read unchanged).",
    kv_adapted="always", query_adapted="always", default_targets=ALL_PROJECTIONS, kv_layout="full_reuse",
)
KV_LAYOUTS = ("exact", "forkkv", "full_reuse")


def serving_spec(kind: AdapterKind | str | None, kv_layout: str = "exact") -> KindSpec:
    """The spec a request of ``kind`` is served under with ``kv_layout`` ("exact" or
    "forkkv"; ForkKV exists for conventional LoRA only, whose K/V the adapter changes)."""
    if kv_layout not in KV_LAYOUTS:
        raise KvshareError(f"unknown kv_layout {kv_layout!r} (expected one of: {', '.join(KV_LAYOUTS)})")
    spec = kind_spec(kind)
    if kv_layout == "exact":
        return spec
    if spec.kind is not AdapterKind.LORA:
        raise KvshareError(f"kv_layout {kv_layout!r} is for lora adapters; a {spec.name} adapter "
                           f"{'already shares base KV' if spec.kind else 'has no residual'}")
    return FORKKV_LORA if kv_layout == "forkkv" else FULL_REUSE_LORA


def parse_kind(value: str) -> AdapterKind:
    """Turn a user string into an AdapterKind, with a clear error for anything else."""
    try:
        return AdapterKind(value)
    except ValueError:
        known = ", ".join(k.value for k in AdapterKind)
        raise KvshareError(f"unknown adapter kind {value!r} (expected one of: {known})") from None


def kind_spec(kind: AdapterKind | str | None) -> KindSpec:
    """The spec of a kind (a name or an AdapterKind); ``None`` is the bare base."""
    if kind is None:
        return BASE
    return KINDS[parse_kind(kind) if isinstance(kind, str) else kind]
