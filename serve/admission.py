"""Workflow admission: a new workflow's first call waits while the KV pool is full of the
contexts of the workflows already running.

Why: an engine that admits every arriving call lets more workflows in than its pool holds.
Their contexts then evict each other between turns, every turn recomputes its context, and
the engine serves less than it did at a lower load. Measured with `kvshare bench workflow`
(32 workflows of 8 ICaRus agents, 1.5k-token contexts, a pool of 8 contexts, 2 CPU cores,
results/workflow-e2e/session22/w32): at 1 workflow/s the prefix hit rate fell from 0.86 to
0.14, and throughput from 62 to 34 tok/s. Neither vLLM nor SGLang has this rule (they admit
requests, not workflows); KVFlow's step graph (:mod:`.hints`) says which workflows still have
calls ahead.

A workflow is *live* while one of its agents has a call running or a next call in its hints
(``steps_to_execution``), and it has been seen in the last ``idle_s`` seconds (a client that
went away without finishing). Its *footprint* is the distinct KV blocks of its agents' last
calls (a shared ICaRus context counts once, private LoRA copies once each), or, before any call
has finished, the blocks its first call needs. A call of an unknown workflow is admitted when
the live workflows' footprints and its own need fit the pool, or when no workflow is live;
calls without a workflow id are never held.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from .cache.agents import AgentTable
from .sequence import Sequence

IDLE_S = 120.0  # a live workflow unseen this long is taken as gone


@dataclass
class _Workflow:
    first_need: int  # blocks its first call needed (its footprint until a call finishes)
    blocks: dict[str, frozenset[int]] = field(default_factory=dict)  # agent -> blocks of its last call
    seen: float = field(default_factory=time.monotonic)

    def footprint(self) -> int:
        if not self.blocks:
            return self.first_need
        return len(frozenset().union(*self.blocks.values()))


class WorkflowAdmission:
    def __init__(self, agents: AgentTable, capacity_blocks: int, block_size: int, idle_s: float = IDLE_S):
        self.agents, self.capacity, self.block_size, self.idle_s = agents, capacity_blocks, block_size, idle_s
        self.admitted: dict[str, _Workflow] = {}
        self.held = 0  # calls held back so far (a new workflow's call, once per step it waited)

    def allows(self, seq: Sequence) -> bool:
        """Whether ``seq`` may be admitted now (admitting its workflow if it is new)."""
        workflow = seq.hints.workflow_id
        if workflow is None:
            return True
        known = self.admitted.get(workflow)
        if known is not None:
            known.seen = time.monotonic()
            return True
        self._forget_ended()
        need = -(-(len(seq) + seq.params.max_tokens) // self.block_size)
        if self.admitted and sum(w.footprint() for w in self.admitted.values()) + need > self.capacity:
            self.held += 1
            return False
        self.admitted[workflow] = _Workflow(need)
        return True

    def finished(self, seq: Sequence) -> None:
        """A call ended with these blocks: its agent's share of its workflow's footprint."""
        known = self.admitted.get(seq.hints.workflow_id) if seq.hints.workflow_id is not None else None
        if known is not None:
            known.blocks[seq.hints.agent_id or seq.request_id] = frozenset(seq.block_table)
            known.seen = time.monotonic()

    def _forget_ended(self) -> None:
        live = {key[0] for key in self.agents.running}
        live |= {key[0] for key in self.agents.steps if self.agents.steps_of(key) < math.inf}
        now = time.monotonic()
        for workflow in [w for w, state in self.admitted.items()
                         if w not in live or now - state.seen > self.idle_s]:
            del self.admitted[workflow]
