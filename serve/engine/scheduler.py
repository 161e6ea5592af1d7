"""Continuous batching: decode and chunked prefill in one step, preemption by recompute.

Every step walks the running sequences oldest first and gives each the tokens it still
needs (one for a decoding sequence, a chunk of its prompt for a prefilling one) until the
step's token budget is spent (one whose rows do not fit what is left lets the younger ones
have it), then admits waiting sequences in arrival order (a sequence whose prefix is still
loading back from the host tier, or being computed for a request just admitted, is skipped,
not waited for). When the KV
pool cannot hold a sequence's next token, the newest running sequence is preempted: its
blocks are released and it waits at the front of the queue to be recomputed, so no one
starves and outputs are unchanged. With workflow admission (:mod:`.admission`) a call of a
workflow not yet running waits while the running workflows' contexts fill the pool, and the
calls of running workflows behind it may go first (new workflows keep their order).

The scheduler owns the sequence lifecycle, as in nano-vllm: admission, chunking and
preemption here, and after the model ran, :meth:`Scheduler.postprocess` advances computed
counts, publishes completed blocks, appends sampled tokens and finishes and frees sequences.
Row costs come from the row planner (:mod:`..exec.batch`), the same one that builds the batch.

Where the step runs as a compiled graph padded to a row bucket (``row_buckets``), a prompt
chunk that would spill just past a bucket is cut back to it (:meth:`Scheduler._fill_bucket`):
its last rows wait a step instead of the whole step paying for a bucket twice the size. The
running sequences hold at most ``max_adapters`` adapters (the graph's LoRA slots, vLLM's
``max_loras``; :mod:`..exec.lora_slots`), so that every step fits the slots (a step of one more would
run eager): as in vLLM, a waiting request of one more adapter is admitted once a running
adapter's requests have all ended, and nobody behind it overtakes it meanwhile.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Callable

from .admission import WorkflowAdmission
from ..exec.batch import StepPlan, plan_step
from ..cache import BlockManager, OutOfBlocks, OutOfResidualBlocks, PrefixLoading, PrefixPending
from ..sequence import Sequence, Status


FILL_FROM = 32  # the smallest bucket a prompt chunk is cut back to (_fill_bucket)


class Scheduler:
    def __init__(self, blocks: BlockManager, max_batched_tokens: int, max_seqs: int,
                 row_buckets: tuple[int, ...] = (), admission: WorkflowAdmission | None = None,
                 max_adapters: int | None = None):
        self.blocks = blocks
        self.max_adapters = max_adapters  # distinct adapters the running sequences may hold (None: any)
        self.admission = admission  # holds new workflows' calls while the pool is full of running ones
        self.max_batched_tokens = max_batched_tokens
        self.max_seqs = max_seqs
        self.row_buckets = row_buckets  # the compiled step's padded sizes (none: eager steps)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)
        if self.admission is not None:
            self.admission.arrived(seq)

    def remove(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq)  # also when it holds nothing: it may wait on others' loads, still listed

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _fit(self, seq: Sequence, budget: int, alone: bool) -> StepPlan:
        """The step computing the most tokens of ``seq`` within ``budget`` rows. Prompt scoring
        costs more than a row per token (an ICaRus position adds its read-only adapter row;
        positions from the prefix cache add theirs), so the chunk shrinks to fit. A sequence
        alone in the step always gets a token, so that a backlog of read-only rows larger
        than the budget cannot stall it (that one step runs over the budget)."""
        todo = len(seq) - seq.num_computed
        if seq.params.prompt_logprobs is None:
            whole = plan_step(seq, todo)  # a decode step, or the rest of the prompt
            if whole.num_rows <= budget or not todo:
                return whole
            # a chunk that stops short of the end samples nothing: no read-only row (e.g. ICaRus's
            # adapter row); where it still has more rows than tokens, leave room for them
            n = min(todo - 1, budget)
            if plan_step(seq, n).num_rows > budget:
                n = max(0, min(todo, budget - (whole.num_rows - todo)))
        else:
            fits = lambda k: plan_step(seq, k).num_rows <= budget  # noqa: E731
            lo, hi = 0, max(0, min(todo, budget))  # rows grow with the chunk: binary search
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
            n = lo
        return plan_step(seq, min(todo, 1) if n == 0 and alone else n)

    def _preempt_newest(self, keep: Sequence, forkkv_only: bool = False) -> bool:
        """Release the newest running sequence to make room for ``keep``; False when ``keep``
        is the newest itself (then it waits, as in vLLM: an older sequence, planned already,
        never gives way to a younger one). ``forkkv_only``: the residual pool is short, and
        only ForkKV sequences hold its blocks."""
        newest = max((s for s in self.running if s.layout.uses_residual_pool or not forkkv_only or s is keep),
                     key=lambda s: s.arrival)
        if newest is keep:
            return False
        self._preempt(newest)
        return True

    def _preempt(self, victim: Sequence) -> None:
        """Release a running sequence's blocks; it waits at the front to be recomputed."""
        self.running.remove(victim)
        self.blocks.free(victim)
        victim.status = Status.WAITING
        victim.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(victim)

    def evacuate(self, block_ids: list[int]) -> int:
        """Free ``block_ids`` of requests (a lender takes them back): running sequences that
        hold one are preempted (recomputed later; newest first, so the oldest keep their
        place at the front of the queue) and waiting ones drop their pins. Returns how many
        were preempted."""
        wanted = set(block_ids)
        holders = [s for s in self.running if wanted.intersection(s.block_table)]
        for victim in sorted(holders, key=lambda s: s.arrival, reverse=True):
            self._preempt(victim)
        for seq in self.waiting:
            if wanted.intersection(seq.pinned):
                self.blocks.unpin(seq)
        return len(holders)

    def _allocate(self, seq: Sequence) -> None:
        """Admit ``seq``'s blocks. Short of blocks, it first takes back the blocks pinned for
        the requests behind it that wait on host-tier loads: the first in line must not wait
        on those behind it (with nothing running, nobody else would release them)."""
        try:
            self.blocks.allocate(seq)
        except OutOfBlocks:
            if not self.blocks.release_pins(keep=seq):
                raise
            self.blocks.allocate(seq)

    def schedule(self) -> list[StepPlan]:
        budget = self.max_batched_tokens
        plan: list[StepPlan] = []
        stalled = False  # a running sequence found the pool short: no admission this step
        residual_stalled = False  # ForkKV's residual pool was: no ForkKV admission this step
        for seq in sorted(self.running, key=lambda s: s.arrival):
            if seq not in self.running:
                continue  # preempted while making room for an older sequence
            if budget <= 0:
                break
            step = self._fit(seq, budget, alone=not plan)
            if len(seq) > seq.num_computed and step.n_compute == 0:
                continue  # its rows do not fit what is left: younger running ones may (vLLM does the same)
            residual = False
            while True:
                try:
                    self.blocks.ensure_capacity(seq, seq.num_computed + step.n_compute)
                    break
                except OutOfBlocks as short:
                    residual = isinstance(short, OutOfResidualBlocks)
                    if not residual and self.blocks.release_pins():  # blocks held for requests waiting on loads
                        continue
                    if not self._preempt_newest(keep=seq, forkkv_only=residual):
                        # the newest itself (or alone, its pool shrunk: a lender took blocks
                        # back, or loads hold them): it waits for blocks like a new request
                        self._preempt(seq)
                        break
            if seq not in self.running:
                # the pool is short for this one: admit nobody now (where only ForkKV's residual
                # pool was, no ForkKV request); the younger ones still planned run (there, those
                # not ForkKV)
                residual_stalled = residual_stalled or residual
                stalled = stalled or not residual
                continue
            plan.append(step)
            budget -= step.num_rows
        held_new = False  # a new workflow's call was held: later new workflows wait behind it
        adapters = {seq.adapter_slot for seq in self.running}
        for seq in [] if stalled else list(self.waiting):
            if budget <= 0 or len(self.running) >= self.max_seqs:
                break
            if self.admission is not None and not self.admission.allows(seq, behind_held=held_new):
                held_new = True
                continue  # a new workflow's call: the calls of workflows already admitted go first
            if residual_stalled and seq.layout.uses_residual_pool:
                continue  # its residual pool is short for a running request: the others may go
            if not self._adapter_fits(seq, adapters):
                break  # one adapter more than a step holds: it waits for one to be free, first in line
            try:
                self._allocate(seq)
            except PrefixLoading:
                continue  # its prefix is coming back from the host tier: let the next one run
            except PrefixPending:
                continue  # its prefix is being computed for a request just admitted: shared once it is
            except OutOfBlocks:
                break  # otherwise admit in order: nobody overtakes a request short of blocks
            self.waiting.remove(seq)
            self.running.append(seq)
            seq.status = Status.RUNNING
            if seq.first_scheduled is None:
                seq.first_scheduled = time.perf_counter()
            if not seq.preemptions:  # admitted again after preemption, its "hits" are its own recomputed blocks
                seq.num_cached_prompt = min(seq.num_computed, len(seq.prompt))
            step = self._fit(seq, budget, alone=not plan)
            if len(seq) > seq.num_computed and step.n_compute == 0:
                break
            plan.append(step)
            budget -= step.num_rows
            adapters.add(seq.adapter_slot)
        return self._fill_bucket(plan)

    def _adapter_fits(self, seq: Sequence, adapters: set[int]) -> bool:
        """Whether ``seq`` may run beside sequences of ``adapters`` (-1: the base's)."""
        if self.max_adapters is None or seq.adapter_slot < 0 or seq.adapter_slot in adapters:
            return True
        return len(adapters - {-1}) < self.max_adapters

    def _fill_bucket(self, plan: list[StepPlan]) -> list[StepPlan]:
        """``plan`` with its newest prompt chunks cut back so that the step fits the bucket
        below, when fewer rows wait a step than the bucket above would pad. Why: a compiled
        step costs its bucket, not its rows (SmolLM2 on 2 cores after a 1.6k-token prefix: 58 ms
        at 64 rows, 79 ms at 65, results/cpu-attention/session19), and a follow-up turn's ~60-row
        prompt beside a few decoding pairs lands just past 64. Below :data:`FILL_FROM` rows a
        step mostly reads the weights whatever its bucket (16 rows: 38 ms, 32: 42 ms): no cut. Every
        chunk keeps a row; prompt scoring plans are left whole (their rows do not shrink one
        per token)."""
        rows = sum(p.num_rows for p in plan)
        above = next((b for b in self.row_buckets if b >= rows), None)
        below = max((b for b in self.row_buckets if b < rows), default=None)
        if above is None or below is None or below < FILL_FROM or rows - below >= above - rows:
            return plan
        trimmed, excess = list(plan), rows - below
        for i in reversed(range(len(trimmed))):
            item = trimmed[i]
            if excess <= 0:
                break
            if item.n_compute <= 1 or item.seq.params.prompt_logprobs is not None:
                continue
            shorter = plan_step(item.seq, max(1, item.n_compute - excess))
            excess -= item.num_rows - shorter.num_rows
            trimmed[i] = shorter
        return trimmed if excess <= 0 else plan

    # after the model ran ---------------------------------------------------------------------
    def postprocess(self, plan: list[StepPlan], sampled: list[tuple[Sequence, int]],
                    finish: Callable[[Sequence], str | None]) -> list[Sequence]:
        """Advance each planned sequence, publish its completed blocks, append its sampled
        token, and finish (and free) the sequences ``finish`` names a reason for. Returns the
        sequences that produced a token."""
        for item in plan:
            item.seq.num_computed += item.n_compute
            self.blocks.register_computed(item.seq)
        produced = []
        for seq, token in sampled:
            seq.output.append(token)
            reason = finish(seq)
            if reason is not None:
                self.finish(seq, reason)
            produced.append(seq)
        return produced

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status, seq.finish_reason = Status.FINISHED, reason
        if self.admission is not None:
            self.admission.finished(seq)
        self.remove(seq)
