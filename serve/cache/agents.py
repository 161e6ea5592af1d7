"""The agent table: per (workflow, agent), how far its next call is and which blocks hold its
fixed prompt. The step-aware eviction policy ranks blocks by it; the prefetcher reads which
agents are due and what to load back for them.

Steps come from the hints each request carries (:mod:`..hints`): a request's own agent is
at 0 while it runs; the other agents of its workflow get the steps it names. When the
request ends its agent takes the steps the hints gave for its next call (unknown: last).
A request's steps are its workflow's whole schedule (as KVFlow's step graph is): an agent
of that workflow they leave out has no call ahead, so its blocks rank as the furthest (above
the unhinted and dynamic blocks, evicted first; KVFlow orders them so too).

The fixed prompt of an agent is the prefix its calls keep: given as ``fixed_prefix_tokens``
or learned as the blocks its last two prompts have in common (its first prompt counts as
fixed whole until a second call says otherwise).
"""

from __future__ import annotations

import math

from ..hints import AgentHints

AgentKey = tuple[str, str]  # (workflow id, agent id)
MAX_AGENTS = 4096  # agents remembered; the least recently seen idle one goes first


class AgentTable:
    def __init__(self):
        self.steps: dict[AgentKey, float] = {}
        self.after_call: dict[AgentKey, float] = {}  # steps an agent gets once its running call ends
        self.running: dict[AgentKey, int] = {}  # calls in flight per agent
        self.fixed_keys: dict[AgentKey, list[bytes]] = {}  # block keys of the agent's fixed prompt
        self._last_prompt: dict[AgentKey, list[bytes]] = {}
        self._scheduled: dict[str, set[AgentKey]] = {}  # workflow -> agents its last schedule named
        self.version = 0  # bumped whenever an agent's steps may change (ranks are recomputed)

    def steps_of(self, agent: AgentKey) -> float:
        return 0 if self.running.get(agent) else self.steps.get(agent, math.inf)

    def on_request(self, hints: AgentHints) -> AgentKey | None:
        """A request arrived: record what its hints say about its workflow."""
        workflow = hints.workflow_id or ""
        own = hints.agent_key
        schedule = hints.steps_to_execution
        if own is not None or schedule is not None:
            self.version += 1
        if schedule is not None:
            self._replace_schedule(workflow, own, schedule)
        if own is not None:
            self.running[own] = self.running.get(own, 0) + 1
            self.after_call.setdefault(own, math.inf)
            self._forget_oldest()
        return own

    def _replace_schedule(self, workflow: str, own: AgentKey | None, schedule: dict[str, int]) -> None:
        """Steps named for the workflow's agents; the agents its last schedule named and this
        one leaves out have no call ahead (a running one none after its call)."""
        named = {(workflow, agent) for agent in schedule}
        for key in self._scheduled.pop(workflow, set()) - named:
            self.steps.pop(key, None)
            if key in self.after_call:
                self.after_call[key] = math.inf
        for agent, steps in schedule.items():
            key = (workflow, agent)
            if key == own:
                self.after_call[key] = steps if steps > 0 else math.inf
            else:
                self.steps[key] = steps
        if own is not None and own not in named:
            self.after_call[own] = math.inf
        if named:
            self._scheduled[workflow] = named

    def _forget_oldest(self) -> None:
        """Bound the table: drop the least recently seen agents that have no call in flight."""
        while len(self.fixed_keys) > MAX_AGENTS:
            oldest = next((a for a in self.fixed_keys if a not in self.running), None)
            if oldest is None:
                return
            for table in (self.steps, self.after_call, self.fixed_keys, self._last_prompt):
                table.pop(oldest, None)
            self._unschedule(oldest)
        if len(self.steps) > 2 * MAX_AGENTS:  # agents named by hints that never called
            for agent in [a for a in self.steps if a not in self.fixed_keys]:
                del self.steps[agent]
                self._unschedule(agent)

    def _unschedule(self, agent: AgentKey) -> None:
        named = self._scheduled.get(agent[0])
        if named is not None:
            named.discard(agent)
            if not named:
                del self._scheduled[agent[0]]

    def on_finish(self, agent: AgentKey | None) -> None:
        if agent is None or not self.running.get(agent):
            return
        self.running[agent] -= 1
        self.version += 1
        if not self.running[agent]:
            del self.running[agent]
            self.steps[agent] = self.after_call.pop(agent, math.inf)

    def fixed_blocks(self, agent: AgentKey, prompt_keys: list[bytes], fixed_tokens: int | None,
                     block_size: int) -> int:
        """How many leading full blocks of this prompt are the agent's fixed prompt; remembers
        their keys (for prefetch) and, when learning, this prompt (for the next call)."""
        if fixed_tokens is not None:
            count = min(len(prompt_keys), fixed_tokens // block_size)
        else:
            previous = self._last_prompt.get(agent)
            count = len(prompt_keys) if previous is None else _common_prefix(previous, prompt_keys)
            self._last_prompt[agent] = prompt_keys
        self.fixed_keys.pop(agent, None)  # re-inserted: most recently seen last
        self.fixed_keys[agent] = prompt_keys[:count]
        return count

    def due(self, within: int) -> list[tuple[float, AgentKey]]:
        """Agents whose next call is 1..``within`` steps away, nearest first."""
        due = [(self.steps_of(a), a) for a in self.fixed_keys]
        return sorted((s, a) for s, a in due if 0 < s <= within)


def _common_prefix(a: list[bytes], b: list[bytes]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
