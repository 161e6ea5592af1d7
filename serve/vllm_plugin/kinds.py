"""Which kvshare kind a vLLM LoRA request's folder holds, read once per folder.

vLLM's ``LoRARequest`` carries only a name, an id and a path, so the kind comes from the
folder: kvshare's ``kvshare.json`` says ICaRus, PEFT's ``adapter_config.json`` holds aLoRA's
``alora_invocation_tokens``. A path that is not a readable folder (vLLM's warm-up uses made-up
ones) is a plain LoRA. Read once per path, as vLLM loads an adapter once per path.
"""

from __future__ import annotations

import json
import sys
from functools import lru_cache
from pathlib import Path

from ...kinds import find_invocation_start


def _folder_json(lora_path: str | None, name: str) -> dict:
    """``name`` in the adapter folder, or {} where there is none to read."""
    try:
        data = json.loads((Path(lora_path) / name).read_text()) if lora_path else {}
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


@lru_cache(maxsize=1024)
def is_icarus(lora_path: str | None) -> bool:
    """Whether the folder is a kvshare ICaRus adapter (its ``kvshare.json`` says so)."""
    return _folder_json(lora_path, "kvshare.json").get("kind") == "icarus"


@lru_cache(maxsize=1024)
def invocation_tokens(lora_path: str | None) -> tuple[int, ...] | None:
    """The aLoRA invocation tokens of the adapter at ``lora_path``; None for any other adapter."""
    tokens = _folder_json(lora_path, "adapter_config.json").get("alora_invocation_tokens")
    return tuple(int(t) for t in tokens) if tokens else None


NEVER = sys.maxsize  # an aLoRA whose prompt lacks the invocation adapts nothing (PEFT's rule)


def activation_start(prompt: list[int] | None, lora_path: str | None) -> int | None:
    """The first position whose K/V an adapter computes, for the kinds that share the base's
    K/V: aLoRA, where the invocation last starts in the prompt (:data:`NEVER` when the prompt
    lacks it); ICaRus, :data:`NEVER` (its K/V are always the base's). None for other adapters."""
    if is_icarus(lora_path):
        return NEVER
    invocation = invocation_tokens(lora_path)
    if invocation is None:
        return None
    start = find_invocation_start(list(prompt or []), list(invocation))
    return NEVER if start is None else start


_UNSET = object()


def request_activation_start(request) -> int | None:
    """:func:`activation_start` of a vLLM request (the engine core's ``Request`` or the worker's
    ``CachedRequestState``: both carry ``prompt_token_ids`` and ``lora_request``), computed once
    and kept on it."""
    start = getattr(request, "_kvshare_activation_start", _UNSET)
    if start is _UNSET:
        lora = request.lora_request
        start = activation_start(request.prompt_token_ids, lora.lora_path) if lora is not None else None
        request._kvshare_activation_start = start
    return start
