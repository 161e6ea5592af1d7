"""Workflow admission: a new workflow's first call waits while the KV pool is full of the
contexts of the workflows already running.

Why: an engine that admits every arriving call lets more workflows in than its pool holds.
Their contexts then evict each other between turns, every turn recomputes its context, and
the engine serves less than it did at a lower load. Measured with `kvshare bench workflow`
(32 workflows of 8 ICaRus agents, 1.5k-token contexts, a pool of 8 contexts, 2 CPU cores,
results/workflow-e2e/session22/w32): at 1 workflow/s the prefix hit rate fell from 0.86 to
0.14, and throughput from 62 to 34 tok/s. Neither vLLM nor SGLang has this rule (they admit
requests, not workflows); KVFlow's step graph (:mod:`..hints`) says which workflows still have
calls ahead.

A workflow is *live* while one of its calls is in the engine, or its last finished call's
hints named a next call (``steps_to_execution`` not empty), unless it has not been seen for
``idle_s`` seconds (a client that went away between calls; ``--workflow-idle-s``). Its *footprint* is the distinct KV
blocks of its agents' last calls (a shared ICaRus context counts once, private LoRA copies once
each), or, before any call has finished, the blocks its first call needs. A workflow's context
grows with its turns (an application's workflows look alike), so each live workflow, and the
one asking, is counted at no less than

- the mean final footprint of the last workflows that ended, and
- its footprint plus the calls its schedule still names (at least one per agent named, and as
  many as the farthest agent's steps), each growing it by the mean growth per call measured on
  the workflows that made a second call (live or ended).

Without the first, workflows admitted on their first call's footprint outgrew the pool together
(session 24). Without the second, the same happened before any workflow had ended: 32 ReAct
workflows of 8 ICaRus agents at 1 workflow/s admitted 12 at the start, and 17 of their later calls
found part of their context evicted, 10 most of it (results/workflow-e2e/session32-spr). A call of a workflow not
live is admitted when those estimates fit the pool, or when no workflow is live; calls without a
workflow id are never held.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from ...errors import KvshareError
from ..sequence import Sequence

RECENT = 32  # ended workflows whose final footprints make the estimate for the live ones


@dataclass
class _Workflow:
    in_flight: int = 0  # its calls in the engine (waiting or running)
    due: bool = False  # its last finished call named a next call
    admitted: bool = False
    first_need: int = 0  # blocks its first call needed (its footprint until a call finishes)
    blocks: dict[str, frozenset[int]] = field(default_factory=dict)  # agent -> blocks of its last call
    distinct: int = 0  # blocks in the union of ``blocks``: counted when a call ends, read every step a call is held
    calls: int = 0  # its calls that ended holding blocks
    after_first: int = 0  # its footprint when its first call ended
    ahead: int = 0  # calls its latest schedule names after the call that sent it
    seen: float = field(default_factory=time.monotonic)

    def footprint(self) -> int:
        return self.distinct if self.blocks else self.first_need

    def growth(self) -> float | None:
        """Blocks its footprint grew by per call after its first (None before a second ended)."""
        return (self.distinct - self.after_first) / (self.calls - 1) if self.calls > 1 else None

    def calls_to_grow(self) -> int:
        """Calls whose growth its footprint does not hold yet: those in flight (once a call has
        ended; the first call's own blocks are in its footprint) and those its schedule names."""
        return self.ahead + (self.in_flight if self.blocks else 0)


def calls_ahead(steps: dict[str, int] | None) -> int:
    """The fewest calls a schedule (``steps_to_execution``) names: one per agent, and a chain to
    the farthest one."""
    return max(len(steps), max(steps.values())) if steps else 0


class WorkflowAdmission:
    """One engine's admission: the scheduler asks :meth:`allows` before it admits a waiting
    call, and tells it of every call that arrives and ends."""

    def __init__(self, capacity_blocks: Callable[[], int], block_size: int, idle_s: float = 120.0):
        # read at every decision: a co-located engine's pool grows and shrinks as it borrows and lends
        self.capacity, self.block_size, self.idle_s = capacity_blocks, block_size, idle_s
        self.workflows: dict[str, _Workflow] = {}
        self.ended: deque[int] = deque(maxlen=RECENT)  # final footprints of the last workflows that ended
        self.ended_growth: deque[float] = deque(maxlen=RECENT)  # their growth per call (those with two calls)
        self.held = 0  # times a call was held back (once per step it waited)

    def arrived(self, seq: Sequence) -> None:
        workflow = self._state(seq)
        if workflow is not None:
            workflow.in_flight += 1
            workflow.ahead = calls_ahead(seq.hints.steps_to_execution)

    def allows(self, seq: Sequence, behind_held: bool = False) -> bool:
        """Whether ``seq`` may be admitted now (admitting its workflow if it is not yet).
        ``behind_held``: a call of another new workflow, ahead in the queue, was held this
        step; new workflows are admitted first come, first served, so this one waits too
        (else a stream of small workflows could keep a large one out for ever)."""
        workflow = self._state(seq)
        if workflow is None or workflow.admitted:
            return True
        if behind_held:
            self.held += 1
            return False
        self._forget_ended()
        admitted = [w for w in self.workflows.values() if w.admitted]
        need = -(-(len(seq) + seq.params.max_tokens) // self.block_size)
        floor = sum(self.ended) // len(self.ended) if self.ended else 0
        growths = [g for g in (w.growth() for w in admitted) if g is not None] + list(self.ended_growth)
        rate = max(0.0, sum(growths) / len(growths)) if growths else 0.0  # a context may shrink, not the pool

        def estimate(footprint: int, calls: int) -> int:
            return max(footprint + math.ceil(rate * calls), floor)

        projected = sum(estimate(w.footprint(), w.calls_to_grow()) for w in admitted)
        if admitted and projected + estimate(need, workflow.ahead) > self.capacity():
            self.held += 1
            return False
        workflow.admitted, workflow.first_need = True, need
        return True

    def forget(self) -> None:
        """Forget the workflows seen and the footprints of those that ended (no call of theirs
        may be in the engine)."""
        if any(w.in_flight for w in self.workflows.values()):
            raise KvshareError("cannot forget the workflows while their calls are in the engine")
        self.workflows.clear()
        self.ended.clear()
        self.ended_growth.clear()

    def finished(self, seq: Sequence) -> None:
        """A call ended (or was aborted) holding these blocks: its agent's share of its workflow's
        footprint; whether it named a next call decides if the workflow stays live."""
        workflow = self._state(seq)
        if workflow is None:
            return
        workflow.in_flight = max(0, workflow.in_flight - 1)
        workflow.due = bool(seq.hints.steps_to_execution)
        if workflow.admitted and seq.block_table:
            workflow.blocks[seq.hints.agent_id or seq.request_id] = frozenset(seq.block_table)
            workflow.distinct = len(frozenset().union(*workflow.blocks.values()))
            workflow.calls += 1
            if workflow.calls == 1:
                workflow.after_first = workflow.distinct

    def holds(self, seq: Sequence) -> bool:
        """Whether ``seq`` is a call of a workflow not admitted yet (a pure read: callable from
        the server's thread while the engine runs)."""
        return seq.hints.workflow_id is not None and not self.running(seq.hints.workflow_id)

    def running(self, name: str | None) -> bool:
        """Whether workflow ``name`` has been admitted (a pure read, as :meth:`holds`)."""
        workflow = self.workflows.get(name) if name is not None else None
        return workflow is not None and workflow.admitted

    @property
    def admitted(self) -> int:
        """Workflows admitted and live (read by /metrics from the server's thread: the values
        are copied in one step, so the engine thread may add a workflow meanwhile)."""
        return sum(w.admitted for w in list(self.workflows.values()))

    def _state(self, seq: Sequence) -> _Workflow | None:
        name = seq.hints.workflow_id
        if name is None:
            return None
        workflow = self.workflows.setdefault(name, _Workflow())
        workflow.seen = time.monotonic()
        return workflow

    def _forget_ended(self) -> None:
        now = time.monotonic()
        for name, workflow in list(self.workflows.items()):
            if workflow.in_flight:
                continue
            if not workflow.due:  # its last call named no next one: it ended
                if workflow.admitted and workflow.blocks:
                    self.ended.append(workflow.footprint())
                    if workflow.growth() is not None:
                        self.ended_growth.append(workflow.growth())
                del self.workflows[name]
            elif now - workflow.seen > self.idle_s:  # gone between calls: not a footprint to learn from
                del self.workflows[name]
