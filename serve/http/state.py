"""What every route shares: one :class:`ServerState` per app, made by :func:`start_state`
and handed to route handlers as a FastAPI dependency (:func:`get_state`).

It holds the served engines (a :class:`~kvshare.serve.driver.colocation.Colocation`, one or several
bases) and the names they answer to, the server's limits, the engine thread, the two worker
threads that keep CPU-bound work off the event loop, the metrics and the runtime-LoRA scope.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from fastapi import Request

from ...errors import KvshareError
from ..driver.engine_thread import AsyncEngine
from ..driver.colocation import Colocation, UnknownModel
from ..config import ServerLimits
from ..engine.llm_engine import LLMEngine, RequestOutput
from .errors import ApiError
from .lora_scope import RuntimeLoraScope
from .metrics import ServerMetrics

T = TypeVar("T")


@dataclass
class ServerState:
    """The app's shared state; ``aliases`` maps each further served name of the one base to it."""

    colocation: Colocation
    aliases: dict[str, str]
    limits: ServerLimits
    generation_config: str  # "auto": a request's missing sampling from generation_config.json; "vllm": off
    engine_thread: AsyncEngine  # steps the engines on its own thread
    tokenize_pool: ThreadPoolExecutor  # tokenising, chat templates and reply encoding
    lora_pool: ThreadPoolExecutor  # runtime LoRA loads read and check their files here
    metrics: ServerMetrics
    lora_scope: RuntimeLoraScope

    async def off_loop(self, work: Callable[..., T], *args: Any) -> T:
        """Run CPU-bound ``work`` (tokenising, chat templates) on the tokenizer thread."""
        return await asyncio.get_running_loop().run_in_executor(self.tokenize_pool, work, *args)

    def resolve(self, model: str | None) -> tuple[str, LLMEngine, str | None]:
        """The request's ``model`` -> (served base name, its engine, adapter or None); 404 if
        unknown. None: the first served base, as vLLM (0.8+) serves a request without one."""
        if model is None:
            model = next(iter(self.colocation.engines))
        try:
            return self.colocation.resolve(self.aliases.get(model, model))
        except UnknownModel as err:
            raise ApiError(404, str(err), kind="not_found_error", param="model") from None

    def observe(self, out: RequestOutput, base: str) -> None:
        """A finished request's latencies, for ``/metrics``."""
        self.metrics.observe(out, base)

    def shutdown(self) -> None:
        """Stop the engine thread and drop the workers' queued work (the app's shutdown)."""
        self.engine_thread.shutdown()
        self.tokenize_pool.shutdown(wait=False, cancel_futures=True)
        self.lora_pool.shutdown(wait=False, cancel_futures=True)


def get_state(request: Request) -> ServerState:
    """FastAPI dependency: the state of the app serving ``request``."""
    return request.app.state.kvshare


def start_state(engine: LLMEngine | Colocation, *, served_model_name: str | list[str] | None,
                max_waiting: int | None, limits: ServerLimits | None, generation_config: str,
                lora_root: str | Path | None, allow_runtime_replace_startup_adapters: bool) -> ServerState:
    """Check the arguments of :func:`~.app.create_app`, warm the engines up (before the engine
    thread starts: it owns them then) and start the engine thread and the workers."""
    if generation_config not in ("auto", "vllm"):
        raise KvshareError(f"generation_config must be 'auto' or 'vllm', not {generation_config!r}")
    limits = limits or ServerLimits()
    max_waiting = limits.max_waiting if max_waiting is None else max_waiting
    colocation, aliases = _served(engine, served_model_name)
    lora_scope = RuntimeLoraScope(lora_root, {a.name for each in colocation.engines.values() for a in each.adapters()},
                                  allow_runtime_replace_startup_adapters)  # what is loaded now: the start-up adapters
    for each in colocation.engines.values():
        if each.config.warm_up:
            each.warm_up_all()
    engine_thread = AsyncEngine(colocation, max_waiting=max_waiting)
    # one tokenizer worker (as in vLLM), so a huge prompt costs one core, not every core
    tokenize_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvshare-tokenize")
    # runtime LoRA loads one at a time, while the engine steps
    lora_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvshare-lora-load")
    return ServerState(colocation, aliases, limits, generation_config, engine_thread, tokenize_pool, lora_pool,
                       ServerMetrics(colocation), lora_scope)


def _served(engine: LLMEngine | Colocation,
            served_model_name: str | list[str] | None) -> tuple[Colocation, dict[str, str]]:
    """The engines by served name, and the further names (aliases) of a single engine."""
    base_names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name or [])
    if isinstance(engine, Colocation):
        if base_names:
            raise KvshareError("co-located models are served under their Colocation names, not served_model_name")
        colocation = engine
    else:
        colocation = Colocation.of(engine, (base_names or [None])[0])
    aliases = {alias: base_names[0] for alias in base_names[1:]}
    hidden = sorted(set(aliases) & {a.name for each in colocation.engines.values() for a in each.adapters()})
    if hidden:  # the alias would win: requests for the adapter would run on the base
        raise KvshareError(f"served model name {hidden[0]!r} is also an adapter's name")
    return colocation, aliases
