"""The FastAPI app: :func:`create_app` wires the shared state, the middleware, the error
handlers and each module's routes; what a route does is in its own module."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException

from ..driver.colocation import Colocation
from ..config import ServerLimits
from ..engine.llm_engine import LLMEngine
from . import admin, chat, completions, models, status, tokenize
from .errors import ApiError, api_error, http_error, unexpected_error, validation_error
from .middleware import ApiKeyGuard, BodyLimit, UnicodeCheckedRoute
from .state import start_state

# (method, path, handler), in the order they are matched. Registered on the app itself (not
# through APIRouters) so that every route is an APIRoute of the app's UnicodeCheckedRoute class;
# response_model=None: each handler's dict or Response is sent as it is (no model validates it)
ROUTES = [
    ("GET", "/health", status.health),
    ("GET", "/metrics", status.metrics),
    ("GET", "/v1/models", models.models),
    ("GET", "/v1/models/{model:path}", models.model_card),
    ("GET", "/version", status.version),
    ("POST", "/tokenize", tokenize.tokenize),
    ("POST", "/detokenize", tokenize.detokenize),
    ("POST", "/v1/completions", completions.completions),
    ("POST", "/v1/chat/completions", chat.chat),
]
# vLLM's runtime LoRA updating: only with enable_lora_loading (without, these are 404, as in vLLM)
LORA_ADMIN_ROUTES = [
    ("POST", "/v1/load_lora_adapter", admin.load_lora_adapter),
    ("POST", "/v1/unload_lora_adapter", admin.unload_lora_adapter),
]


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    """On shutdown, stop the engine thread and the workers."""
    yield
    app.state.kvshare.shutdown()


def create_app(engine: LLMEngine | Colocation, *, api_key: str | None = None,
               served_model_name: str | list[str] | None = None, max_waiting: int | None = None,
               limits: ServerLimits | None = None, enable_lora_loading: bool = False,
               generation_config: str = "auto", lora_root: str | Path | None = None,
               allow_runtime_replace_startup_adapters: bool = False) -> FastAPI:
    """The app over ``engine``, or over co-located engines (a :class:`Colocation`, served under
    its names; a request's ``model`` picks the engine); ``max_waiting`` overrides
    ``limits.max_waiting`` (a bound per model). One engine answers to every name in
    ``served_model_name`` (vLLM's flag; default: the engine's model name), each of which the
    model list shows (as vLLM's). ``enable_lora_loading`` adds vLLM's ``/v1/load_lora_adapter``
    and ``/v1/unload_lora_adapter``: ``lora_root`` is the folder the adapters they load must lie
    in (symlinks followed), and the adapters loaded before the app is made stay unless
    ``allow_runtime_replace_startup_adapters`` (:mod:`.lora_scope`). Engines whose config asks
    for ``warm_up`` compile their steps here, with their adapters loaded, before the app
    answers. ``generation_config``: "auto" (vLLM's default) takes the sampling a request leaves
    out from each model's ``generation_config.json``; "vllm" leaves it off (temperature 1, no
    top-p/k/min-p, no penalty)."""
    state = start_state(engine, served_model_name=served_model_name, max_waiting=max_waiting, limits=limits,
                        generation_config=generation_config, lora_root=lora_root,
                        allow_runtime_replace_startup_adapters=allow_runtime_replace_startup_adapters)
    app = FastAPI(title="kvshare", version="1", lifespan=_lifespan)
    app.router.route_class = UnicodeCheckedRoute  # every route: bodies that are not Unicode are 400
    app.state.kvshare = state  # the routes' shared state (state.get_state)
    app.state.engine_thread = state.engine_thread  # the engine thread, for health checks and tests

    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(HTTPException, http_error)  # routing, unparsable bodies
    app.add_exception_handler(Exception, unexpected_error)  # a bug of ours; logged by Starlette
    app.add_exception_handler(RequestValidationError, validation_error)

    app.add_middleware(BodyLimit, limit=state.limits.max_request_bytes)
    if api_key:  # added last, so it runs first: no key, no body read
        app.add_middleware(ApiKeyGuard, api_key=api_key)

    for method, path, handler in ROUTES + (LORA_ADMIN_ROUTES if enable_lora_loading else []):
        app.add_api_route(path, handler, methods=[method], response_model=None)
    return app
