"""vLLM's runtime LoRA updating, ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``:
only routed when the server enables it (without, they are 404, as in vLLM).

What a load may read and which adapters a client may replace is :mod:`.lora_scope`'s to say;
an adapter's files are read and checked on the load worker while the engine steps, and only
the install runs on the engine thread, between steps.
"""

from __future__ import annotations

import asyncio

from fastapi import Depends
from fastapi.responses import PlainTextResponse

from ...errors import KvshareError
from ..driver.colocation import UnknownModel
from .errors import ApiError
from .lora_scope import StartupAdapterLocked
from .protocol import LoadLoraRequest, UnloadLoraRequest
from .state import ServerState, get_state

def _refuse_if_startup(state: ServerState, name: str) -> None:
    """403, naming the flag that allows it, for unloading or replacing a start-up adapter."""
    try:
        state.lora_scope.check_replaceable(name)
    except StartupAdapterLocked as err:
        raise ApiError(403, str(err), kind="permission_error", param="lora_name") from None


def _target_base(state: ServerState, req: LoadLoraRequest) -> str:
    """The served base a load goes onto (default: the first); 400 for a base's own name as
    ``lora_name`` or a base not served here."""
    engines = state.colocation.engines
    if req.lora_name in engines or req.lora_name in state.aliases:
        raise ApiError(400, f"{req.lora_name!r} is a base model's name", param="lora_name")
    base = state.aliases.get(req.base_model_name, req.base_model_name) or next(iter(engines))
    if base not in engines:
        raise ApiError(400, f"base_model_name {req.base_model_name!r} is not a base model served here "
                       f"({', '.join(map(repr, engines))})", param="base_model_name")
    return base


async def load_lora_adapter(req: LoadLoraRequest, state: ServerState = Depends(get_state)) -> PlainTextResponse:
    """Load an exported adapter under ``lora_name``, with the checks of ``--adapter``
    (manifest, files, base fingerprint, finite weights), onto the base ``base_model_name``
    names (default: the first served base). Paths are scoped and refused as :mod:`.lora_scope` says."""
    base = _target_base(state, req)
    if any(a.name == req.lora_name for a in state.colocation.engines[base].adapters()):
        _refuse_if_startup(state, req.lora_name)  # else: refused below as already loaded (unload it first)
    colocation = state.colocation
    try:
        adapter = await asyncio.get_running_loop().run_in_executor(
            state.lora_pool, state.lora_scope.prepare, colocation, base, req.lora_path, req.lora_name)
        await state.engine_thread.call(lambda _: colocation.install_adapter(base, adapter))
    except KvshareError as err:  # AdapterPathRefused among them: one message, whatever the reason
        raise ApiError(400, str(err), param="lora_path") from None
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")


async def unload_lora_adapter(req: UnloadLoraRequest, state: ServerState = Depends(get_state)) -> PlainTextResponse:
    """Unload an adapter; refused (409) while requests use it, and (403) when it was given
    at start-up, unless the server allows that."""
    try:
        _, engine, adapter = state.colocation.resolve(req.lora_name)
    except UnknownModel:
        adapter = None
    if adapter is None:
        raise ApiError(404, f"The lora adapter '{req.lora_name}' cannot be found.",
                       kind="not_found_error", param="lora_name")
    _refuse_if_startup(state, req.lora_name)
    try:
        await state.engine_thread.call(lambda _: engine.unload_adapter(req.lora_name))
    except KvshareError as err:
        raise ApiError(409, f"{err}: unload it when they have finished", kind="conflict_error",
                       param="lora_name") from None
    state.lora_scope.unloaded(req.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")
