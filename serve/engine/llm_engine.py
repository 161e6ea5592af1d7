"""The engine facade: add_request / abort / step, adapters, and what callers may ask of it.

A request goes: :meth:`LLMEngine.add_request` makes a :class:`Sequence` (its kind's spec,
adapter slot and content digest) and queues it; each :meth:`LLMEngine.step` is
schedule -> run -> postprocess: the scheduler picks work and plans its rows
(:mod:`..exec.batch`), the model runner builds the batch's tensor metadata, runs the model on its
device with its kernels and samples (:mod:`..exec.runner`), and the scheduler advances, publishes
completed blocks to the prefix cache (:mod:`..cache`) and finishes sequences; the engine
turns them into :class:`RequestOutput` (:mod:`.output`). Callers (server, benchmarks, eval)
use only the methods and properties here, never the runner, cache or scheduler; what the
engine reports is built in :mod:`.stats`, and its side of SwiftCache lending
between co-located engines is :class:`~..driver.lender.EngineLender`.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections import Counter, deque
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from ...errors import KvshareError
from ...fingerprint import fingerprints
from ...hardware import warn_if_bf16_is_slow
from ...kernels import Kernels
from ...models import end_of_sequence_ids, sampling_defaults, load_tokenizer, resolve_model_dir
from ...kinds import find_invocation_start
from ..exec.adapters import AdapterSet, LoadedAdapter
from .admission import WorkflowAdmission
from ..exec.batch import StepPlan
from ..cache import AgentTable, BlockManager, HostTier, make_policy
from ..cache.arena import BlockShape
from ..cache.residual import ResidualCache
from ..config import EngineConfig
from .stats import engine_stats, kv_usage
from ..hints import AgentHints
from ..kv_layout import layout_named
from ..exec.model import Model
from .output import IncrementalDetokenizer, RequestOutput, error_output, make_output, stop_reason
from ..exec.runner import DTYPES, ModelRunner, resolve_device
from ..exec.sampler import allowed_mask
from ..sampling_params import SamplingParams
from .scheduler import Scheduler
from ..sequence import Sequence, Status
from ..exec.step_buckets import BucketedStep

__all__ = ["LLM", "LLMEngine", "RequestOutput", "EngineConfig"]

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, model: str | Path, adapters: list[str | Path] = (),
                 config: EngineConfig | None = None, **settings):
        """``config`` (or keyword settings such as ``kv_cache_tokens=``, ``device=``, applied
        over it) says how the engine runs; see :class:`EngineConfig`."""
        config = (config or EngineConfig()).updated(**settings)
        if config.dtype not in DTYPES:
            raise KvshareError(f"dtype must be one of {', '.join(DTYPES)}")
        self.config = config
        self.model_dir = resolve_model_dir(model)
        self.model_name = str(model)
        self.dtype = DTYPES[config.dtype]
        self.device = resolve_device(config.device)
        if self.dtype is torch.bfloat16 and self.device.type == "cpu":
            warn_if_bf16_is_slow("engine dtype bfloat16")
        self.tokenizer = load_tokenizer(self.model_dir)
        self.eos_token_ids = end_of_sequence_ids(self.model_dir, self.tokenizer)
        self.sampling_defaults = sampling_defaults(self.model_dir)  # the server's, for what a request leaves out
        self.fingerprint = fingerprints(self.model_dir).base
        self.runner = ModelRunner(self.model_dir, self.dtype, self.device, config.kv_cache_tokens,
                                  config.kv_cache_bytes, config.block_size, Kernels(config.kernels, config.device),
                                  config.compile, min(config.compile_max_rows, config.max_num_batched_tokens),
                                  config.max_loras,
                                  config.max_lora_rank)
        self.runner.eos_token_ids = self.eos_token_ids
        positions = int(getattr(self.runner.model.config, "max_position_embeddings", 4096))
        if config.max_model_len and config.max_model_len > positions:  # as vLLM: RoPE was not trained past them
            too_long = (f"max_model_len {config.max_model_len} is more than the model's {positions} positions "
                        "(max_position_embeddings)")
            if os.environ.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "").lower() not in ("1", "true"):
                raise KvshareError(f"{too_long}; set VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 to serve it anyway")
            logger.warning("kvshare: %s; served anyway (VLLM_ALLOW_LONG_MAX_MODEL_LEN)", too_long)
        self.max_model_len = config.max_model_len or positions
        self.kv_bytes_per_token = self.runner.kv_bytes_per_token
        self._agents = AgentTable()
        tier = None
        if config.host_cache_tokens:
            tier = HostTier(self.runner.kv_cache, max(1, config.host_cache_tokens // config.block_size),
                            config.host_bandwidth_gbps)
        self._blocks = BlockManager(self.runner.num_blocks, config.block_size, self.fingerprint,
                                    policy=make_policy(config.eviction_policy), agents=self._agents,
                                    host_tier=tier)
        compiled = self.runner.compiled
        admission = (WorkflowAdmission(lambda: self._blocks.num_blocks, config.block_size, config.workflow_idle_s)
                     if config.workflow_admission else None)
        self._scheduler = Scheduler(self._blocks, config.max_num_batched_tokens, config.max_num_seqs,
                                    compiled.buckets if compiled is not None else (), admission,
                                    config.max_loras if compiled is not None else None)
        self._adapters = AdapterSet(self.model_dir, self.dtype, self.device)
        self._adapters.default_layout = layout_named(config.kv_layout)
        if self._adapters.default_layout.uses_residual_pool:
            self._ensure_residual_pool()
        for path in adapters:
            self._adapters.load(path)
        self.sequences: dict[str, Sequence] = {}
        self.hints_log: deque[tuple[str, AgentHints]] = deque(maxlen=1024)  # recent requests' hints
        self._ids = itertools.count()
        self.counters = {"requests": 0, "finished": 0, "aborted": 0, "failed": 0, "generated_tokens": 0,
                         "prompt_tokens": 0, "steps": 0}
        self.finish_reasons: Counter[str] = Counter()  # ended requests by finish reason (abort, error too)
        self.max_kv_blocks: int | None = None  # set when co-located engines may lend this one blocks

    # adapters ----------------------------------------------------------------------------
    def load_adapter(self, path: str | Path, name: str | None = None, kv_layout: str | None = None) -> str:
        """Load an exported adapter; ``kv_layout="forkkv"`` serves a lora adapter with ForkKV
        (default: the engine's ``kv_layout`` for lora adapters, exact for the other kinds)."""
        return self.install_adapter(self.prepare_adapter(path, name, kv_layout))

    def prepare_adapter(self, path: str | Path, name: str | None = None,
                        kv_layout: str | None = None) -> LoadedAdapter:
        """Read and check an adapter (manifest, files, base fingerprint, finite weights) without
        changing the engine: what a server runs on a worker thread, so that steps go on while
        the file is read; :meth:`install_adapter` then serves it."""
        return self._adapters.prepare(path, name, kv_layout)

    def install_adapter(self, adapter: LoadedAdapter) -> str:
        """Serve a :meth:`prepare_adapter`-d adapter (cheap; on the thread that steps the engine)."""
        if adapter.layout.uses_residual_pool:
            self._ensure_residual_pool()
        return self._adapters.install(adapter)

    def hidden_states(self, prompt: list[int], adapter: str | None = None) -> torch.Tensor:
        """(layers, hidden) float32: each decoder layer's output at the prompt's last position,
        run through the cache like any request (what ForkKV's divergence is measured on: the
        same row under exact, ForkKV and full-reuse KV). Needs an idle engine."""
        if self.has_unfinished():
            raise KvshareError("hidden_states needs an idle engine (other requests share its steps)")
        model = self.runner.model
        request_id = self.add_request(prompt, SamplingParams(max_tokens=1, ignore_eos=True), adapter=adapter)
        model.hidden_capture = captured = []
        try:
            while self.has_unfinished():
                outputs = self.step()
                if any(o.request_id == request_id for o in outputs):
                    break
        finally:
            model.hidden_capture = None
        layers = model.n_layers
        return torch.stack(captured[-layers:])[:, -1]  # the step that sampled: its logit row

    def _ensure_residual_pool(self) -> None:
        """ForkKV's residual pool and its index, made with the first ForkKV adapter."""
        if self._blocks.residual is not None:
            return
        config = self.config
        tokens = config.forkkv_residual_tokens or 4 * self._blocks.num_blocks * config.block_size
        blocks = self.runner.add_residual_pool(tokens, config.forkkv_max_rank)
        self._blocks.residual = ResidualCache(blocks, config.block_size, self.fingerprint)
        self._adapters.residual_rank = config.forkkv_max_rank

    def unload_adapter(self, name: str) -> None:
        busy = [s.request_id for s in self.sequences.values() if s.adapter == name]
        if busy:
            raise KvshareError(f"adapter {name!r} is in use by {len(busy)} request(s)")
        self._adapters.unload(name)

    def adapters(self) -> list[LoadedAdapter]:
        """The loaded adapters, in slot order."""
        return [a for a in self._adapters.slots if a is not None]

    def adapter(self, name: str) -> LoadedAdapter:
        """One loaded adapter (unknown names are a clear error)."""
        return self._adapters.get(name)

    def chat_prompt(self, messages: list[dict], adapter: str | None = None, *, add_generation_prompt: bool = True,
                    continue_final_message: bool = False, template_kwargs: dict | None = None) -> list[int]:
        """Token ids of a chat for ``adapter``, laid out as that adapter was trained: its
        training system prompt first when the conversation brings none; an aLoRA gets the
        conversation then its invocation (no assistant header, whatever
        ``add_generation_prompt`` says); others get the chat template's generation prompt
        unless asked not to (or to leave the last message open: ``continue_final_message``).
        ``template_kwargs``: extra variables for the template (vLLM's ``chat_template_kwargs``)."""
        if not self.tokenizer.chat_template:
            raise KvshareError(f"{self.model_name} has no chat template (a base model?): use an instruct model, "
                               "or add chat_template to its tokenizer_config.json")
        invocation = None
        if adapter is not None:
            loaded = self.adapter(adapter)
            if loaded.spec.needs_invocation:
                invocation = list(loaded.invocation)
            system = loaded.manifest.get("chat", {}).get("system_prompt")
            if system and not (messages and messages[0].get("role") == "system"):
                messages = [{"role": "system", "content": system}, *messages]
        header = add_generation_prompt and invocation is None
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=header,
                                                 continue_final_message=continue_final_message, tokenize=True,
                                                 return_dict=True, **(template_kwargs or {}))["input_ids"]
        return list(ids) + (invocation or [])

    # requests ----------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    adapter: str | None = None, request_id: str | None = None,
                    hints: dict | AgentHints | None = None) -> str:
        """Queue a request. ``hints`` (:class:`AgentHints` or its dict form: workflow and agent
        ids, the agent's fixed-prompt length, the steps to the other agents' next calls) feed
        the step-aware eviction policy and the prefetcher; other policies ignore them."""
        params = params or SamplingParams()
        hints = hints if isinstance(hints, AgentHints) else AgentHints.parse(hints)
        tokens = self.tokenizer.encode(prompt, add_special_tokens=False) if isinstance(prompt, str) else list(prompt)
        if not tokens:
            raise KvshareError("the prompt is empty")
        vocab = self.vocab_size
        bad = next((t for t in tokens if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise KvshareError(f"prompt token id {bad!r} is outside the vocabulary (0..{vocab - 1})")
        bad = next((t for t in params.allowed_token_ids or () if t >= vocab), None)
        if bad is not None:
            raise KvshareError(f"allowed_token_ids: {bad} is outside the vocabulary (0..{vocab - 1})")
        for name in ("logprobs", "prompt_logprobs"):  # topk over the vocabulary; past it a step would fail
            if (getattr(params, name) or 0) > vocab:
                raise KvshareError(f"{name} ({getattr(params, name)}) is more than the vocabulary's {vocab} tokens")
        if len(tokens) + params.max_tokens > self.max_model_len:
            raise KvshareError(f"prompt ({len(tokens)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                               f"max_model_len {self.max_model_len}")
        needed = self._blocks.blocks_needed(len(tokens) + params.max_tokens)
        limit = self.max_kv_blocks or self._blocks.num_blocks
        if needed > limit:
            raise KvshareError(f"request needs {needed} KV blocks; the pool has {limit}"
                               + (" with every block the co-located engines may lend" if self.max_kv_blocks else ""))
        if adapter is not None and self.adapter(adapter).layout.uses_residual_pool and \
                needed > self._blocks.residual.num_blocks:
            raise KvshareError(f"request needs {needed} ForkKV residual blocks; the residual pool has "
                               f"{self._blocks.residual.num_blocks}")
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.sequences:
            raise KvshareError(f"request id {request_id!r} is already in use")
        seq = Sequence(request_id, tokens, params, hints=hints)
        seq.detokenizer = IncrementalDetokenizer(self.tokenizer, tokens)
        if params.prompt_logprobs is not None:
            seq.prompt_logprobs = [None] * len(tokens)
        self.hints_log.append((request_id, seq.hints))
        if adapter is not None:
            loaded = self.adapter(adapter)
            seq.adapter, seq.spec, seq.adapter_slot = adapter, loaded.spec, self._adapters.get_slot(adapter)
            seq.adapter_digest = loaded.digest
            if loaded.spec.needs_invocation:
                seq.invocation_start = find_invocation_start(tokens, loaded.invocation)
        if params.seed is not None:
            seq.generator = torch.Generator().manual_seed(params.seed)
        if params.allowed_token_ids is not None:  # once here, not at every step of the request
            seq.allowed_mask = allowed_mask(params.allowed_token_ids, vocab, self.device)
        self.sequences[request_id] = seq
        seq.agent = self._agents.on_request(hints)
        self._scheduler.add(seq)
        self.counters["requests"] += 1
        self.counters["prompt_tokens"] += len(tokens)
        return request_id

    def max_request_tokens(self) -> int:
        """Prompt + output tokens one request may have: the context, or the KV pool (with every
        block co-located engines may lend) where that is smaller."""
        return min(self.max_model_len, (self.max_kv_blocks or self.num_kv_blocks) * self.config.block_size)

    def abort(self, request_id: str, reason: str = "abort") -> bool:
        """End a request now (its blocks freed); ``reason`` "error" counts it as failed."""
        seq = self.sequences.pop(request_id, None)
        if seq is None:
            return False
        self._scheduler.finish(seq, reason)
        self._agents.on_finish(seq.agent)
        self._count_end(reason)
        return True

    def warm_up(self, rows: tuple[int, ...] = (), adapters: bool = False) -> None:
        """Compile the CPU step now for steps of ``rows`` rows (default: every bucket), the graph
        for steps without adapters or (``adapters``) with, so that no request waits for a compile
        (about a minute each for SmolLM2 on 2 cores the first time, seconds once Inductor's cache holds
        them for these weights). Nothing happens on an engine that runs eager."""
        compiled = self.runner.compiled
        if compiled is not None:
            sizes = tuple(sorted({b for b in map(compiled.bucket, rows) if b is not None})) if rows else None
            compiled.warm_up(self.runner.kv_cache, sizes, adapters, self._adapters)

    def warm_up_all(self, rows: tuple[int, ...] = ()) -> None:
        """:meth:`warm_up` for steps without adapters and, when any are loaded, with them: what
        an engine about to serve its loaded adapters compiles (servers, benchmarks, the story)."""
        self.warm_up(rows)
        if self.adapters():
            self.warm_up(rows, adapters=True)

    def has_unfinished(self) -> bool:
        """Requests to run, or host-tier loads to collect: a load's block stays in use until
        a step collects it, even when no request is left (a prefetch started by the last step)."""
        return self._scheduler.has_work() or bool(self._blocks.loads_in_flight())

    # one step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one forward pass; return outputs of requests that produced a token.

        A failure is pinned on the requests it belongs to: if the batch fails, its halves are
        retried (bisection), and only a sequence whose step fails alone is failed (finish
        reason ``"error"``); the others go on unchanged. A failed run changes no sequence
        (progress is recorded only after the model ran; seeded generators are rewound)."""
        self._blocks.poll_loads()  # blocks back from the host tier
        if self.config.prefetch_steps:
            self._blocks.prefetch(self.config.prefetch_steps, reserve=self._blocks_still_needed())
        plans = self._scheduler.schedule()
        if not plans:
            self._blocks.wait_for_loads(0.05)  # only loads can make progress now: do not spin
            return []
        runs, failed = self._run_isolating(plans)
        self.counters["steps"] += 1
        now, sampled = time.perf_counter(), []
        for group, (batch, tokens, records) in runs:
            samples = iter(tokens)
            for row, (index, position) in enumerate(batch.targets):
                seq = group[index].seq
                if position is not None:  # a prompt position scored for prompt_logprobs
                    seq.prompt_logprobs[position + 1] = records[row]
                    seq.scored = max(seq.scored, position + 1)
                    continue
                token = next(samples)
                if seq.params.logprobs is not None:
                    seq.logprobs.append(records[row])
                seq.token_times.append(now)
                seq.first_token = seq.first_token or now
                sampled.append((seq, token))
        texts: dict[str, str] = {}

        def finish(seq: Sequence) -> str | None:
            try:
                new_text = seq.detokenizer.update(seq.output)
                reason, cut = stop_reason(seq, self.eos_token_ids, self.max_model_len, new_text)
                if reason is not None:
                    seq.detokenizer.flush(seq.output)
            except Exception:  # this request's text alone: fail it, not the step
                logger.exception("request %s: detokenising failed; failing the request", seq.request_id)
                reason, cut = "error", None
            texts[seq.request_id] = seq.detokenizer.text[:cut]
            return reason

        ran = [plan for group, _ in runs for plan in group]
        outputs = [self._fail(plan.seq) for plan in failed]
        for seq in self._scheduler.postprocess(ran, sampled, finish):
            if seq.status is Status.FINISHED:
                self.sequences.pop(seq.request_id, None)
                self._agents.on_finish(seq.agent)
                self._count_end(seq.finish_reason)
            try:
                outputs.append(make_output(seq, texts[seq.request_id]))
            except Exception:  # this request alone: it ends with an error, the step's other outputs go out
                logger.exception("request %s: building its output failed; failing the request", seq.request_id)
                outputs.append(self._fail_built(seq))
        self.counters["generated_tokens"] += len(sampled)
        return outputs

    def _run_isolating(self, plans: list[StepPlan]) -> tuple[list[tuple[list[StepPlan], tuple]], list[StepPlan]]:
        """Run ``plans`` (as the runner splits them); on failure bisect them. Returns the groups
        that ran with their results, and the plans whose step failed alone."""
        runs, failed, todo = [], [], self.runner.split(plans, self._adapters)[::-1]
        while todo:
            group = todo.pop()
            states = {id(p.seq.generator): p.seq.generator.get_state() for p in group if p.seq.generator is not None}
            try:
                runs.append((group, self.runner.run(group, self._adapters)))
            except Exception:
                for plan in group:  # the failed run may have drawn from seeded generators
                    if plan.seq.generator is not None:
                        plan.seq.generator.set_state(states[id(plan.seq.generator)])
                if len(group) == 1:
                    logger.exception("request %s: its step failed alone; failing the request",
                                     group[0].seq.request_id)
                    failed.append(group[0])
                else:
                    logger.warning("a step of %d sequences failed; retrying it in halves", len(group))
                    half = len(group) // 2
                    todo += [group[half:], group[:half]]
        return runs, failed

    def _fail(self, seq: Sequence) -> RequestOutput:
        """End ``seq`` with finish reason ``"error"`` and free its blocks."""
        self._end_failed(seq)
        return make_output(seq, seq.detokenizer.text)

    def _fail_built(self, seq: Sequence) -> RequestOutput:
        """A bare ``"error"`` output for ``seq`` (ended here if it was still running), made
        without what failed to build its output."""
        if seq.status is not Status.FINISHED:
            self._end_failed(seq)
        return error_output(seq)

    def _end_failed(self, seq: Sequence) -> None:
        self._scheduler.finish(seq, "error")
        self.sequences.pop(seq.request_id, None)
        self._agents.on_finish(seq.agent)
        self._count_end("error")

    def _count_end(self, reason: str) -> None:
        """A request ended: count it by finish reason, and as aborted, failed or finished."""
        self.counters[{"abort": "aborted", "error": "failed"}.get(reason, "finished")] += 1
        self.finish_reasons[reason] += 1

    def _blocks_still_needed(self) -> int:
        """Blocks the requests in flight may still take (to their max_tokens): prefetches
        leave them free."""
        need = self._blocks.blocks_needed
        return sum(max(0, need(len(s.prompt) + s.params.max_tokens) - len(s.block_table))
                   for s in self.sequences.values())

    # what callers may ask ----------------------------------------------------------------------
    @property
    def block_size(self) -> int:
        return self._blocks.block_size

    @property
    def block_shape(self) -> BlockShape:
        """What one KV block holds (layers, KV heads, head size, tokens, dtype) and its bytes."""
        return self.runner.block_shape()

    @property
    def num_kv_blocks(self) -> int:
        """Blocks of the KV pool this engine holds now (co-located: its share of the arena)."""
        return self._blocks.num_blocks

    @property
    def vocab_size(self) -> int:
        """Token ids run from 0 to ``vocab_size - 1`` (the embedding's rows)."""
        return self.runner.vocab_size

    @property
    def model(self) -> Model:
        """The base model's weights, for benchmarks and tests that look at them."""
        return self.runner.model

    @property
    def compiled_step(self) -> BucketedStep | None:
        """The compiled CPU step or CUDA graphs that small steps run through (None: eager)."""
        return self.runner.compiled

    @contextmanager
    def eager_steps(self) -> Iterator[None]:
        """Run every step eager inside the block (a benchmark that times nothing need not
        compile a graph for each of its batch sizes)."""
        compiled, self.runner.compiled = self.runner.compiled, None
        try:
            yield
        finally:
            self.runner.compiled = compiled

    def num_waiting(self) -> int:
        return len(self._scheduler.waiting)

    def num_held(self) -> int:
        """Waiting calls that workflow admission holds back (new workflows' calls); safe to
        read from another thread (the waiting queue is copied in one step)."""
        admission = self._scheduler.admission
        if admission is None:
            return 0
        return sum(1 for seq in list(self._scheduler.waiting) if admission.holds(seq))

    def workflow_running(self, workflow_id: str | None) -> bool:
        """Whether workflow admission has let ``workflow_id`` in (False without admission)."""
        admission = self._scheduler.admission
        return admission is not None and admission.running(workflow_id)

    def num_running(self) -> int:
        return len(self._scheduler.running)

    def num_prefilling(self) -> int:
        """Requests whose prompt is not fully computed yet (waiting ones included)."""
        return self.num_waiting() + sum(1 for s in self._scheduler.running if s.num_computed < len(s.prompt))

    def forget_workflows(self) -> None:
        """Forget what workflow admission learned (the workflows seen, the footprints of those
        that ended), so that a benchmark's next point starts as a fresh server would."""
        if self._scheduler.admission is not None:
            self._scheduler.admission.forget()

    def reset_prefix_cache(self) -> None:
        """Forget every cached block and zero the cache statistics (no request may be running)."""
        self._blocks.land_loads("reset_prefix_cache")
        self._blocks.reset()

    def kv_usage(self) -> dict:
        """Per pool: blocks in total, in use, shared, private, unsealed, cached-idle, and the
        blocks holding KV (in use or kept for reuse) and their bytes."""
        return kv_usage(self._blocks, self.kv_bytes_per_token, self.runner.residual_block_bytes)

    def stats(self) -> dict:
        """Counters, the pool's usage, prefix-cache hits (by the kind of KV reused) and evictions,
        preemptions, and the figures of the ForkKV pool, host tier and workflow admission."""
        return engine_stats(self.counters, self._blocks, self._scheduler, self.num_held())


class LLM:
    """Batch generation in the shape vLLM users know: ``LLM(model=...).generate(prompts, params)``."""

    def __init__(self, model: str | Path, adapters: list[str | Path] = (), **engine_args):
        self.engine = LLMEngine(model, adapters, **engine_args)

    def generate(self, prompts: str | list[str] | list[list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None,
                 adapter: str | None | list[str | None] = None) -> list[RequestOutput]:
        """Run prompts to completion, all in flight together. ``params`` and ``adapter`` are
        one for all or one per prompt (as in vLLM)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        per_prompt = params if isinstance(params, list) else [params] * len(prompts)
        adapters = adapter if isinstance(adapter, list) else [adapter] * len(prompts)
        if not len(per_prompt) == len(adapters) == len(prompts):
            raise KvshareError(f"{len(prompts)} prompts need as many sampling params and adapters")
        ids = [self.engine.add_request(p, s, adapter=a) for p, s, a in zip(prompts, per_prompt, adapters)]
        done: dict[str, RequestOutput] = {}
        while len(done) < len(ids):
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
        return [done[i] for i in ids]
