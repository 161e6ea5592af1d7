"""Which requests need the API key, and whether one has it: the rule the single server's
middleware and the Ray gateway both apply (here, apart from the server, so that the gateway
does not load the engine to use it)."""

from __future__ import annotations

import hmac

# beside /v1/*: these read an adapter's names and training system prompt; /health, /metrics
# and /version stay open
GUARDED = frozenset({"/tokenize", "/detokenize"})


def authorized(path: str, headers: list[tuple[bytes, bytes]], expected: bytes | None) -> bool:
    """``Authorization: Bearer KEY`` (``expected``, None: no key) on /v1/* and :data:`GUARDED`,
    compared in constant time; other paths are open."""
    if expected is None or not (path.startswith("/v1/") or path in GUARDED):
        return True
    return hmac.compare_digest(dict(headers).get(b"authorization", b""), expected)
