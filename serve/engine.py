"""The step-wise engine (add_request / step / abort) and the batch API ``LLM.generate``.

One paged KV pool serves the base and every adapter. Each step the scheduler picks work,
the engine lays it out as rows - one per token, plus for an ICaRus request that samples an
adapter row beside the base row, reading the same cache - runs the model once, samples, and
publishes newly completed blocks to the prefix cache under the owner the adapter kind
allows.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import KvshareError
from ..fingerprint import fingerprints
from ..hardware import warn_if_bf16_is_slow
from ..models import load_tokenizer, resolve_model_dir
from ..sharing import AdapterKind
from .adapters import AdapterSet, find_invocation_start
from .block_manager import BlockManager
from .model import Model, Rows
from .sampling import SamplingParams, sample, top_logprobs
from .scheduler import Scheduled, Scheduler
from .sequence import Sequence, Status

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    adapter: str | None
    logprobs: list[dict] = field(default_factory=list)
    metrics: dict = field(default_factory=dict)
    prompt_logprobs: list[dict | None] | None = None  # [None, {token, logprob, top}, ...]


class LLMEngine:
    def __init__(self, model: str | Path, adapters: list[str | Path] = (), *,
                 kv_cache_tokens: int | None = None, kv_cache_bytes: int | None = None,
                 block_size: int = 16, max_num_batched_tokens: int = 512, max_num_seqs: int = 64,
                 max_model_len: int | None = None, dtype: str = "float32"):
        if dtype not in DTYPES:
            raise KvshareError(f"dtype must be one of {', '.join(DTYPES)}")
        self.model_dir = resolve_model_dir(model)
        self.model_name = str(model)
        self.dtype = DTYPES[dtype]
        if self.dtype is torch.bfloat16:
            warn_if_bf16_is_slow("engine dtype bfloat16")
        self.model = Model(self.model_dir, self.dtype)
        self.tokenizer = load_tokenizer(self.model_dir)
        self.fingerprint = fingerprints(self.model_dir).base
        self.max_model_len = max_model_len or int(getattr(self.model.config, "max_position_embeddings", 4096))
        m = self.model
        per_token = 2 * m.n_layers * m.n_kv * m.head_dim * torch.finfo(self.dtype).bits // 8
        if kv_cache_bytes is not None:
            kv_cache_tokens = kv_cache_bytes // per_token
        kv_cache_tokens = kv_cache_tokens or 16384
        num_blocks = max(1, kv_cache_tokens // block_size)
        self.kv_cache = torch.zeros(2, m.n_layers, num_blocks, block_size, m.n_kv, m.head_dim, dtype=self.dtype)
        self.kv_bytes_per_token = per_token
        self.blocks = BlockManager(num_blocks, block_size, self.fingerprint)
        self.scheduler = Scheduler(self.blocks, max_num_batched_tokens, max_num_seqs)
        self.adapters = AdapterSet(self.model_dir, self.dtype)
        for path in adapters:
            self.adapters.load(path)
        self.sequences: dict[str, Sequence] = {}
        self.hints_log: deque[tuple[str, dict]] = deque(maxlen=1024)  # recent requests' hints
        self._ids = itertools.count()
        self.counters = {"requests": 0, "finished": 0, "aborted": 0, "generated_tokens": 0,
                         "prompt_tokens": 0, "steps": 0}

    # adapters ----------------------------------------------------------------------------
    def load_adapter(self, path: str | Path, name: str | None = None) -> str:
        return self.adapters.load(path, name)

    def unload_adapter(self, name: str) -> None:
        busy = [s.request_id for s in self.sequences.values() if s.adapter == name]
        if busy:
            raise KvshareError(f"adapter {name!r} is in use by {len(busy)} request(s)")
        self.adapters.unload(name)

    def chat_prompt(self, messages: list[dict], adapter: str | None = None) -> list[int]:
        """Token ids of a chat for ``adapter``, laid out as that adapter was trained: an aLoRA
        gets the conversation then its invocation (no assistant header); others get the chat
        template's generation prompt."""
        invocation = None
        if adapter is not None and self.adapters.get(adapter).kind is AdapterKind.ALORA:
            invocation = list(self.adapters.get(adapter).invocation)
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=invocation is None,
                                                 tokenize=True, return_dict=True)["input_ids"]
        return list(ids) + (invocation or [])

    # requests ----------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    adapter: str | None = None, request_id: str | None = None,
                    hints: dict | None = None) -> str:
        """Queue a request. ``hints`` (e.g. which agents run next) are recorded with it for
        cache policies that look ahead; the current LRU policy does not use them."""
        params = params or SamplingParams()
        tokens = self.tokenizer.encode(prompt, add_special_tokens=False) if isinstance(prompt, str) else list(prompt)
        if not tokens:
            raise KvshareError("the prompt is empty")
        if len(tokens) + params.max_tokens > self.max_model_len:
            raise KvshareError(f"prompt ({len(tokens)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                               f"max_model_len {self.max_model_len}")
        needed = self.blocks.blocks_needed(len(tokens) + params.max_tokens)
        if needed > len(self.blocks.blocks):
            raise KvshareError(f"request needs {needed} KV blocks; the pool has {len(self.blocks.blocks)}")
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.sequences:
            raise KvshareError(f"request id {request_id!r} is already in use")
        seq = Sequence(request_id, tokens, params, hints=dict(hints or {}))
        if params.prompt_logprobs is not None:
            seq.prompt_logprobs = [None] * len(tokens)
        self.hints_log.append((request_id, seq.hints))
        if adapter is not None:
            loaded = self.adapters.get(adapter)
            seq.adapter, seq.kind, seq.adapter_slot = adapter, loaded.kind, self.adapters.get_slot(adapter)
            if loaded.kind is AdapterKind.ALORA:
                seq.invocation_start = find_invocation_start(tokens, loaded.invocation)
        if params.seed is not None:
            seq.generator = torch.Generator().manual_seed(params.seed)
        self.sequences[request_id] = seq
        self.scheduler.add(seq)
        self.counters["requests"] += 1
        self.counters["prompt_tokens"] += len(tokens)
        return request_id

    def abort(self, request_id: str) -> bool:
        seq = self.sequences.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.remove(seq)
        seq.status, seq.finish_reason = Status.FINISHED, "abort"
        self.counters["aborted"] += 1
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # one step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one forward pass; return outputs of requests that produced a token."""
        plan = self.scheduler.schedule()
        if not plan:
            return []
        rows, targets = self._layout(plan)
        logits = self.model.forward(rows, self.kv_cache, self.adapters.lookup)
        self.counters["steps"] += 1
        for item in plan:
            item.seq.num_computed += item.n_compute
            self.blocks.register_computed(item.seq)
        outputs, now = [], time.perf_counter()
        for row_logits, (index, position) in zip(logits, targets):
            seq = plan[index].seq
            if position is not None:  # a prompt position scored for prompt_logprobs
                seq.prompt_logprobs[position + 1] = top_logprobs(row_logits, seq.prompt[position + 1],
                                                                 seq.params.prompt_logprobs)
                seq.scored = max(seq.scored, position + 1)
                continue
            token = sample(row_logits, seq.params, seq.generator)
            if seq.params.logprobs is not None:
                seq.logprobs.append(top_logprobs(row_logits, token, seq.params.logprobs))
            seq.output.append(token)
            seq.token_times.append(now)
            seq.first_token = seq.first_token or now
            self.counters["generated_tokens"] += 1
            outputs.append(self._check_finished(seq))
        return outputs

    def _layout(self, plan: list[Scheduled]) -> tuple[Rows, list[tuple[int, int | None]]]:
        """Flatten the plan into rows; also say what each logit row is for: (plan index,
        None) samples the sequence's next token, (plan index, p) scores prompt token p + 1."""
        tokens, positions, adapters, writes, row_seq, logit_rows = [], [], [], [], [], []
        targets: list[tuple[int, int | None]] = []
        bs = self.blocks.block_size

        def add_row(index: int, seq: Sequence, pos: int, write: bool, adapter: bool) -> None:
            tokens.append(seq.tokens[pos])
            positions.append(pos)
            adapters.append(seq.adapter_slot if adapter else -1)
            writes.append(seq.block_table[pos // bs] * bs + pos % bs if write else -1)
            row_seq.append(index)

        for index, item in enumerate(plan):
            seq = item.seq
            active_from = seq.adapter_active_from()
            uses_adapter = lambda pos: active_from is not None and pos >= active_from  # noqa: E731
            first_row = len(tokens)
            for pos in range(seq.num_computed, seq.num_computed + item.n_compute):
                add_row(index, seq, pos, True, not seq.is_icarus and uses_adapter(pos))
            scored_by_write, scored_read_only = seq.score_rows(item.n_compute)
            for pos in scored_by_write:
                logit_rows.append(first_row + pos - seq.num_computed)
                targets.append((index, pos))
            # read-only rows: ICaRus' adapter stream, or tokens whose KV came from the prefix
            # cache (their KV must not be written twice)
            for pos in scored_read_only:
                add_row(index, seq, pos, False, uses_adapter(pos))
                logit_rows.append(len(tokens) - 1)
                targets.append((index, pos))
            if item.wants_logits:
                last = len(seq) - 1
                if seq.is_icarus or item.n_compute == 0:
                    add_row(index, seq, last, False, uses_adapter(last))
                logit_rows.append(len(tokens) - 1 if seq.is_icarus or item.n_compute == 0
                                  else first_row + item.n_compute - 1)
                targets.append((index, None))
        rows = Rows(torch.tensor(tokens), torch.tensor(positions), torch.tensor(adapters),
                    torch.tensor(writes), row_seq, [p.seq.block_table for p in plan],
                    torch.tensor(logit_rows, dtype=torch.long))
        return rows, targets

    def _check_finished(self, seq: Sequence) -> RequestOutput:
        params, token = seq.params, seq.output[-1]
        text = self.tokenizer.decode(seq.output, skip_special_tokens=True)
        reason = None
        if not params.ignore_eos and token == self.tokenizer.eos_token_id:
            reason = "stop"
        elif token in params.stop_token_ids:
            reason = "stop"
        elif any(s in text for s in params.stop):
            cut = min(text.find(s) for s in params.stop if s in text)
            text, reason = text[:cut], "stop"
        elif len(seq.output) >= params.max_tokens or len(seq) >= self.max_model_len:
            reason = "length"
        if reason is not None:
            seq.status, seq.finish_reason = Status.FINISHED, reason
            self.scheduler.remove(seq)
            self.sequences.pop(seq.request_id, None)
            self.counters["finished"] += 1
        return RequestOutput(seq.request_id, seq.prompt, list(seq.output), text, reason is not None,
                             reason, seq.adapter, list(seq.logprobs), self._request_metrics(seq),
                             list(seq.prompt_logprobs) if seq.prompt_logprobs is not None else None)

    def _request_metrics(self, seq: Sequence) -> dict:
        times = seq.token_times
        gaps = [b - a for a, b in zip(times, times[1:])]
        return {
            "queue_time": (seq.first_scheduled or seq.arrival) - seq.arrival,
            "time_to_first_token": (seq.first_token - seq.arrival) if seq.first_token else None,
            "inter_token_latency": sum(gaps) / len(gaps) if gaps else None,
            "e2e_time": (times[-1] - seq.arrival) if times else None,
            "prompt_tokens": len(seq.prompt),
            "prompt_tokens_cached": seq.num_cached_prompt,
            "prompt_tokens_computed": len(seq.prompt) - seq.num_cached_prompt,
            "preemptions": seq.preemptions,
        }

    def stats(self) -> dict:
        blocks = self.blocks.stats
        queried = blocks["queried_tokens"]
        return {
            **self.counters, **self.blocks.usage(),
            "prefix_hit_rate": blocks["hit_tokens"] / queried if queried else 0.0,
            "prefix_hit_tokens": blocks["hit_tokens"], "evictions": blocks["evictions"],
            "preemptions": self.scheduler.preemptions,
            "waiting": len(self.scheduler.waiting), "running": len(self.scheduler.running),
        }


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
