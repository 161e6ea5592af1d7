"""``kvshare serve``'s process: build the engines, make the app (:mod:`kvshare.serve.http`),
run it under uvicorn.

The HTTP layer itself (routes, request models, streaming, logprobs) lives in
:mod:`kvshare.serve.http`; its public names are re-exported here for the code and tests that
import them from this module.
"""

from __future__ import annotations

from ...errors import KvshareError
from ..driver.colocation import ModelSpec, build_colocation
from ..config import EngineConfig, ServerLimits
from ..engine.llm_engine import LLMEngine
from . import ApiError, ServerState, create_app
from .protocol import ChatMessage, ChatRequest, CompletionRequest

__all__ = ["ApiError", "ChatMessage", "ChatRequest", "CompletionRequest", "ServerState", "check_port_free",
           "create_app", "serve"]


def serve(model: str, adapters: list[str], *, host: str = "127.0.0.1", port: int = 8000,
          api_key: str | None = None, config: EngineConfig | None = None,
          limits: ServerLimits | None = None, lora_modules: list[tuple[str, str]] = (),
          served_model_name: list[str] | None = None, enable_lora_loading: bool = False,
          colocate: list[ModelSpec] = (), lending: bool = False, generation_config: str = "auto",
          lora_root: str | None = None, allow_runtime_replace_startup_adapters: bool = False) -> None:
    """Serve ``model`` with ``adapters`` (under their manifest names) and ``lora_modules``
    ((name, path): vLLM's ``--lora-modules``, served under ``name``), and beside it the
    ``colocate`` models in the same process (with ``lending``, they lend each other KV blocks).
    ``lora_root`` and ``allow_runtime_replace_startup_adapters``: as :func:`create_app`'s."""
    import uvicorn

    check_port_free(host, port)  # before minutes of loading models, not after
    if colocate or lending:
        if served_model_name and len(served_model_name) > 1:
            raise KvshareError("co-located models take one served name each (no aliases)")
        name = (served_model_name or [model])[0]
        colocation = build_colocation([(model, list(adapters), config or EngineConfig(), name), *colocate], lending)
        for lora_name, path in lora_modules:
            colocation.load_adapter(name, path, lora_name)
        app = create_app(colocation, api_key=api_key, limits=limits, enable_lora_loading=enable_lora_loading,
                         generation_config=generation_config, lora_root=lora_root,
                         allow_runtime_replace_startup_adapters=allow_runtime_replace_startup_adapters)
    else:
        engine = LLMEngine(model, adapters, config)
        for lora_name, path in lora_modules:
            engine.load_adapter(path, lora_name)
        app = create_app(engine, api_key=api_key, limits=limits, served_model_name=served_model_name,
                         enable_lora_loading=enable_lora_loading, generation_config=generation_config,
                         lora_root=lora_root,
                         allow_runtime_replace_startup_adapters=allow_runtime_replace_startup_adapters)
    try:
        uvicorn.run(app, host=host, port=port, log_level="info")
    except SystemExit as stop:  # uvicorn logs why it could not start, then exits
        if stop.code not in (0, None):
            raise KvshareError(f"the server could not start on {host}:{port} (uvicorn's log above says why)") from None
        raise


def check_port_free(host: str, port: int) -> None:
    """A one-line error when ``host:port`` cannot be listened on (in use, not this machine's
    address, a privileged port), as uvicorn would bind it (``SO_REUSEADDR``)."""
    import socket

    if port == 0:  # any free port
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as err:
        raise KvshareError(f"cannot listen on {host}:{port}: {err.strerror}") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as err:
            raise KvshareError(f"cannot listen on {host}:{port}: {err.strerror}") from None
