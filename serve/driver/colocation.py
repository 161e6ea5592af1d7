"""Several base models (each with its adapters) in one process, stepped by one thread.

``kvshare serve --colocate`` serves more than one base: each is its own :class:`LLMEngine`
(weights, KV pool, scheduler), and a :class:`Colocation` is what the driver thread steps.
One thread steps them all, one engine after another, so two forwards never run at once (on
a small CPU two torch threads only fight over the cores). Without lending every engine keeps
its own fixed pool, a static partition of the memory; with a lending object (SwiftCache,
:mod:`.lending`) idle blocks move between the pools between steps, each engine taking
part through the :class:`~.lender.EngineLender` the co-location holds for it. Building the
engines of a co-location (:func:`build_colocation`, :func:`colocate`) happens here too.
"""

from __future__ import annotations

import itertools
import logging
from pathlib import Path
from typing import Protocol

from ...errors import KvshareError
from ..exec.adapters import LoadedAdapter
from .lending import Lending as SwiftCacheLending
from ..config import EngineConfig
from ..engine.llm_engine import LLMEngine, RequestOutput
from ..hints import AgentHints
from .lender import EngineLender, build_arena, lenders_of, stream_split
from ..engine.output import error_output
from ..sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# (model name or folder, adapter folders, engine settings, served name): one co-located model
ModelSpec = tuple[str, list[str], EngineConfig, str]


class UnknownModel(KvshareError):
    """A request names neither a served base nor a loaded adapter (the server's 404)."""


class Lending(Protocol):
    """What the driver needs of a lending policy (:mod:`.lending`)."""

    def rebalance(self) -> None: ...

    def stats(self) -> dict[str, dict[str, int]]: ...


class Colocation:
    def __init__(self, engines: dict[str, LLMEngine], lending: Lending | None = None):
        """``engines`` by served base name; ``lending`` moves KV blocks between their pools
        (None: each keeps its own). Adapter names must be unique across the engines and
        differ from the base names, so that a request's ``model`` names one thing."""
        if not engines:
            raise KvshareError("a co-location needs at least one model")
        self.engines = dict(engines)
        self.lenders: dict[str, EngineLender] = lenders_of(self.engines)  # each engine's side of lending
        self.lending = lending
        self._owner: dict[str, str] = {}  # request id -> served base name, to route aborts
        self._ids = itertools.count()
        for base, engine in self.engines.items():
            for adapter in engine.adapters():
                self._check_free(adapter.name, base)

    @classmethod
    def of(cls, engine: LLMEngine | Colocation, name: str | None = None) -> Colocation:
        """``engine`` as a co-location: a Colocation as it is, else one engine served as
        ``name`` (default: its model name). What takes either (the driver, metrics, the
        server) goes through here."""
        if isinstance(engine, Colocation):
            return engine
        return cls({name or engine.model_name: engine})

    def _check_free(self, name: str, base: str) -> None:
        """Refuse ``name`` as an adapter of ``base`` if it names a base or another engine's adapter."""
        if name in self.engines:
            raise KvshareError(f"adapter name {name!r} (on {base!r}) is also a served base model's name")
        for other, engine in self.engines.items():
            if other != base and any(a.name == name for a in engine.adapters()):
                raise KvshareError(f"adapter name {name!r} is served by both {other!r} and {base!r}: adapter "
                                   "names must be unique across co-located models")

    # routing ---------------------------------------------------------------------------------
    def resolve(self, model: str) -> tuple[str, LLMEngine, str | None]:
        """A request's ``model`` -> (served base name, its engine, adapter name or None)."""
        if model in self.engines:
            return model, self.engines[model], None
        for base, engine in self.engines.items():
            if any(a.name == model for a in engine.adapters()):
                return base, engine, model
        raise UnknownModel(f"model {model!r} does not exist")

    def _engine(self, model: str | None) -> tuple[str, LLMEngine]:
        if model is None:
            if len(self.engines) > 1:
                raise KvshareError(f"name the model: {len(self.engines)} are co-located")
            model = next(iter(self.engines))
        if model not in self.engines:
            raise UnknownModel(f"model {model!r} does not exist")
        return model, self.engines[model]

    def load_adapter(self, model: str | None, path: str | Path, name: str | None = None) -> str:
        """Load an adapter onto base ``model`` (None: the only one), refusing a name that
        another co-located model already serves. Call it on the driver thread."""
        return self.install_adapter(model, self.prepare_adapter(model, path, name))

    def prepare_adapter(self, model: str | None, path: str | Path, name: str | None = None) -> LoadedAdapter:
        """Read and check an adapter for base ``model`` (:meth:`LLMEngine.prepare_adapter`):
        safe on any thread, so the driver keeps stepping while a file is read."""
        base, engine = self._engine(model)
        if name is not None:
            self._check_free(name, base)
        adapter = engine.prepare_adapter(path, name)
        self._check_free(adapter.name, base)  # named by its manifest: known only now
        return adapter

    def install_adapter(self, model: str | None, adapter: LoadedAdapter) -> str:
        """Serve a prepared adapter on base ``model``; on the driver thread (its name is checked
        again: another load may have taken it meanwhile)."""
        base, engine = self._engine(model)
        self._check_free(adapter.name, base)
        return engine.install_adapter(adapter)

    # what the driver calls -------------------------------------------------------------------
    def add_request(self, model: str | None, prompt: str | list[int], params: SamplingParams | None = None,
                    adapter: str | None = None, request_id: str | None = None,
                    hints: dict | AgentHints | None = None) -> str:
        """Queue a request on base ``model`` (None: the only one); ids are unique across engines."""
        base, engine = self._engine(model)
        request_id = request_id or f"colo-{next(self._ids)}"
        if request_id in self._owner:
            raise KvshareError(f"request id {request_id!r} is already in use")
        engine.add_request(prompt, params, adapter=adapter, request_id=request_id, hints=hints)
        self._owner[request_id] = base
        return request_id

    def abort(self, request_id: str) -> bool:
        base = self._owner.pop(request_id, None)
        return base is not None and self.engines[base].abort(request_id)

    def has_unfinished(self) -> bool:
        return any(engine.has_unfinished() for engine in self.engines.values())

    def num_waiting(self) -> int:
        return sum(engine.num_waiting() for engine in self.engines.values())

    def num_held(self) -> int:
        return sum(engine.num_held() for engine in self.engines.values())

    def num_running(self) -> int:
        return sum(engine.num_running() for engine in self.engines.values())

    def workflow_running(self, workflow_id: str | None) -> bool:
        return any(engine.workflow_running(workflow_id) for engine in self.engines.values())

    def step(self) -> list[RequestOutput]:
        """Rebalance KV (with lending), then one step of each engine with work, in a fixed
        order. An engine whose step fails fails its own requests only (finish reason
        ``"error"``); the other models' requests go on."""
        if self.lending is not None:
            try:
                self.lending.rebalance()
            except Exception:  # a lending bug must not fail every model's requests: no moves this round
                logger.exception("lending: rebalancing failed; the engines step with the blocks they hold")
        outputs: list[RequestOutput] = []
        for base, engine in self.engines.items():
            if not engine.has_unfinished():
                continue
            try:
                outs = engine.step()
            except Exception:
                logger.exception("engine %r: step failed; failing its requests in flight", base)
                outs = self._fail_all(engine)
            for out in outs:
                if out.finished:
                    self._owner.pop(out.request_id, None)
            outputs += outs
        return outputs

    def _fail_all(self, engine: LLMEngine) -> list[RequestOutput]:
        """End every request of ``engine`` (its blocks freed) with finish reason ``"error"``."""
        outs = []
        for request_id, seq in list(engine.sequences.items()):
            engine.abort(request_id, reason="error")  # counted as failed, as its finish reason says
            outs.append(error_output(seq))
        return outs

    # what /metrics shows -----------------------------------------------------------------------
    def stats(self) -> dict[str, dict[str, int]]:
        """Per served base: KV blocks owned, lent to the others and borrowed from them."""
        if self.lending is not None:
            return self.lending.stats()
        return {base: {"owned_blocks": engine.kv_usage()["kv"]["blocks_total"], "lent_blocks": 0,
                       "borrowed_blocks": 0, "block_size": engine.block_size}
                for base, engine in self.engines.items()}


def build_colocation(models: list[ModelSpec], lending: bool = False) -> Colocation:
    """The engines of ``models`` in one Colocation: each with its own fixed KV pool, or, with
    ``lending``, sharing one arena through SwiftCache's lending (:func:`colocate`)."""
    served = [name for *_, name in models]
    twice = sorted({name for name in served if served.count(name) > 1})
    if twice:
        raise KvshareError(f"served model name {twice[0]!r} is used by two co-located models")
    if lending:
        return colocate(models, lending=True)
    return Colocation({name: LLMEngine(model, adapters, config) for model, adapters, config, name in models})


def colocate(models: list[ModelSpec], lending: bool) -> Colocation:
    """Engines for ``models`` ((model, adapter dirs, config, served name) each) in one arena:
    each starts with its configured KV memory as its home share; with ``lending`` they lend
    each other idle blocks, else the arena stays a static partition."""
    engines, configs = {}, {}
    for model, adapters, config, name in models:
        if name in engines:
            raise KvshareError(f"two co-located models are served as {name!r}")
        if config.kv_stream and not lending:
            raise KvshareError(f"{name!r}: the layer-stream cache streams lent memory; it needs lending")
        engines[name] = LLMEngine(model, adapters, config.updated(kv_cache_tokens=config.block_size,
                                                                  kv_cache_bytes=None))
        configs[name] = config
    colocation = Colocation(engines)
    home = {name: lender.home_blocks(configs[name]) for name, lender in colocation.lenders.items()}
    stream_rows = {}
    for name in [name for name, config in configs.items() if config.kv_stream]:
        home[name], stream_rows[name] = stream_split(engines, home, name)
    arena = build_arena(colocation.lenders, home, stream_rows)
    colocation.lending = SwiftCacheLending(arena, colocation.lenders) if lending else None
    return colocation
