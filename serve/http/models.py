"""``/v1/models``: vLLM's model cards, each base under each of its served names, then its adapters."""

from __future__ import annotations

import time

from fastapi import Depends

from .errors import ApiError
from .state import ServerState, get_state

async def models(state: ServerState = Depends(get_state)) -> dict:
    """vLLM's model cards: ``root`` is where the weights came from, ``parent`` the base an
    adapter runs on (None for the base)."""
    return {"object": "list", "data": model_cards(state)}


async def model_card(model: str, state: ServerState = Depends(get_state)) -> dict:
    """OpenAI's retrieve-model: one card of :func:`models`, or a 404 naming the model."""
    card = next((c for c in model_cards(state) if c["id"] == model), None)
    if card is None:
        raise ApiError(404, f"The model '{model}' does not exist", kind="not_found_error", param="model")
    return card


def model_cards(state: ServerState) -> list[dict]:
    """Every card; an adapter's ``kv_sharing`` is how it is served (ForkKV: "forkkv")."""
    now, data = int(time.time()), []
    for base_name, engine in state.colocation.engines.items():
        for name in [base_name, *(alias for alias, target in state.aliases.items() if target == base_name)]:
            data.append({"id": name, "object": "model", "created": now, "owned_by": "kvshare",
                         "root": str(engine.model_dir), "parent": None, "max_model_len": engine.max_model_len,
                         "kind": "base"})
        for adapter in engine.adapters():
            data.append({"id": adapter.name, "object": "model", "created": now, "owned_by": "kvshare",
                         "root": str(adapter.path), "parent": base_name, "kind": adapter.kind.value,
                         "kv_sharing": adapter.spec.scope.value})
    return data
