"""What the compiled CPU step (:mod:`.compiled`) and the CUDA-graph step (:mod:`.cuda_graphs`)
share: a step's rows padded up to a bucket of static shape, resident adapters read from slot
stacks (:mod:`.lora_slots`) so adapters come and go without a new graph, and the rule that
splits a step too large for the largest bucket."""

from __future__ import annotations

import logging

import torch

from .adapters import AdapterSet
from .batch import Batch, StepPlan
from ..config import COMPILE_BUCKETS, DEFAULT_COMPILE_MAX_ROWS
from .lora_slots import LoraSlots

log = logging.getLogger(__name__)


class StepUnavailable(RuntimeError):
    """The step gave up on its graphs (why: :attr:`BucketedStep.unavailable`); the engine runs
    this step and every later one eager."""


class BucketedStep:
    """A step of static shapes per row bucket (1, 2, 4, ... up to ``max_rows``)."""

    def __init__(self, model, max_rows: int = DEFAULT_COMPILE_MAX_ROWS, max_loras: int = 8, max_lora_rank: int = 64):
        self.model = model
        self.buckets = tuple(b for b in COMPILE_BUCKETS if b <= max_rows) or (1,)
        self.lora = LoraSlots(model, max_loras, max_lora_rank)
        self.steps = 0  # steps run through the graphs
        self.unavailable: str | None = None  # why the graphs gave up, once they have

    def give_up(self, err: Exception, failed: str, steps: str = "steps") -> StepUnavailable:
        """Stop using the graphs after ``failed`` (a compile or a recording) raised ``err``, on
        a model or machine we never ran on: logged once, and the exception the caller raises,
        so that this step and every later one serve eager instead of failing their requests."""
        self.unavailable = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        log.warning("kvshare: %s failed (%s); %s run eager from now on (--compile off skips the graphs)",
                    failed, self.unavailable, steps)
        return StepUnavailable(self.unavailable)

    def bucket(self, rows: int) -> int | None:
        return next((b for b in self.buckets if b >= rows), None)

    def handles(self, batch: Batch, kv_cache, hidden_capture, adapters: AdapterSet) -> bool:
        if not (self.unavailable is None and batch.forkkv is None and isinstance(kv_cache, torch.Tensor)
                and hidden_capture is None and self.bucket(len(batch.tokens)) is not None):
            return False
        if not self.serves_adapters([slot for slot, _ in batch.lora_groups], adapters):
            return False
        return self.graph_ready(self.bucket(len(batch.tokens)), bool(batch.lora_groups), kv_cache)

    def graph_ready(self, size: int, adapted: bool, kv_cache) -> bool:
        """Whether a step of bucket ``size`` (with adapters or not) may run its graph now."""
        return True

    def serves_adapters(self, slots: list[int], adapters: AdapterSet) -> bool:
        """Whether the slot stacks hold every adapter slot in ``slots`` (brought up to date first)."""
        if not slots:
            return True
        if self.lora.sync(adapters):  # new stacks: the graphs with adapters are made again
            self.forget_adapted()
        return self.lora.serves(slots)

    def forget_adapted(self) -> None:
        """Drop the graphs with adapters: they read stacks that were just reallocated."""
        raise NotImplementedError

    def split(self, plans: list[StepPlan], kv_cache, hidden_capture, adapters: AdapterSet) -> list[list[StepPlan]]:
        """The forwards a step runs as. A step too large for the graph (a prompt chunk beside
        decoding sequences) runs as two: the few-row plans, up to the largest bucket, through
        the graph, the rest eager. Otherwise the decode rows would ride in the eager forward,
        with every adapter's LoRA as separate eager calls. Splitting changes no result: a
        sequence's rows stay in one forward, and a step's rows read only blocks computed
        before it or their own sequence's (prefix sharing reuses computed blocks only)."""
        if (self.unavailable is not None or not isinstance(kv_cache, torch.Tensor) or hidden_capture is not None
                or self.bucket(sum(plan.num_rows for plan in plans)) is not None):
            return [plans]
        few, rest, rows = [], [], 0
        for plan in plans:
            fits = not plan.seq.layout.uses_residual_pool and rows + plan.num_rows <= self.buckets[-1]
            (few if fits else rest).append(plan)
            rows += plan.num_rows if fits else 0
        slots = [p.seq.adapter_slot for p in few if p.seq.adapter_slot >= 0]
        if not few or not rest or not self.serves_adapters(slots, adapters) or not self.graph_ready(
                self.bucket(rows), bool(slots), kv_cache):
            return [plans]  # (split in two only where the few rows' graph is ready)
        return [few, rest]
