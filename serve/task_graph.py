"""The agent step graph: which agent invocation runs after which, and how far each agent is.

KVFlow's abstraction: nodes are agent invocations; a node runs once its predecessors have
(``join="all"``, a barrier) or once any of them has (``join="any"``). A node's
*steps-to-execution* is 0 when it can run now, else the aggregate over its pending
predecessors of theirs plus one (max for an all-of join, min for any-of). An agent's steps
are the minimum over its pending nodes. The cache keeps the agents due soonest.

The workflow runtime builds graphs for its patterns (ReAct round-robin or skewed,
Reflexion, MapReduce) and sends the resulting steps with each call; any client may instead
send a graph and the nodes it has finished (:mod:`.hints`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import KvshareError

JOINS = ("all", "any")


@dataclass(frozen=True)
class StepNode:
    id: str
    agent: str
    after: tuple[str, ...] = ()  # predecessors
    join: str = "all"  # all: a barrier over `after`; any: the first one to finish releases it


class StepGraph:
    def __init__(self, nodes: list[StepNode]):
        self.nodes = {n.id: n for n in nodes}
        if len(self.nodes) != len(nodes):
            raise KvshareError("step graph: node ids must be unique")
        for node in nodes:
            if node.join not in JOINS:
                raise KvshareError(f"step graph: node {node.id!r} has join {node.join!r} (known: all, any)")
            unknown = [p for p in node.after if p not in self.nodes]
            if unknown:
                raise KvshareError(f"step graph: node {node.id!r} follows unknown node(s) {unknown}")
        self.order = self._topological_order()

    def _topological_order(self) -> list[str]:
        """Node ids, every node after its predecessors (Kahn's algorithm; a cycle is an error)."""
        waiting = {n: len(set(node.after)) for n, node in self.nodes.items()}
        followers: dict[str, list[str]] = {n: [] for n in self.nodes}
        for node in self.nodes.values():
            for pred in set(node.after):
                followers[pred].append(node.id)
        ready = [n for n, count in waiting.items() if count == 0]
        order = []
        while ready:
            node = ready.pop()
            order.append(node)
            for follower in followers[node]:
                waiting[follower] -= 1
                if waiting[follower] == 0:
                    ready.append(follower)
        if len(order) != len(self.nodes):
            stuck = sorted(n for n, count in waiting.items() if count)
            raise KvshareError(f"step graph: a cycle passes through node(s) {stuck[:5]}")
        return order

    def node_steps(self, done: set[str] | frozenset[str] = frozenset()) -> dict[str, int]:
        """Steps-to-execution of every node not in ``done`` (0 = can run now)."""
        steps: dict[str, int] = {}
        for node_id in self.order:  # predecessors first
            if node_id in done:
                continue
            node = self.nodes[node_id]
            pending = [p for p in node.after if p not in done]
            if not pending or (node.join == "any" and len(pending) < len(node.after)):
                steps[node_id] = 0
            else:
                ahead = [steps[p] + 1 for p in pending]
                steps[node_id] = max(ahead) if node.join == "all" else min(ahead)
        return steps

    def agent_steps(self, done: set[str] | frozenset[str] = frozenset()) -> dict[str, int]:
        """Per agent: the steps to its next pending invocation (agents with none are absent)."""
        result: dict[str, int] = {}
        for node_id, value in self.node_steps(done).items():
            agent = self.nodes[node_id].agent
            result[agent] = min(value, result.get(agent, value))
        return result

    # the runtime's patterns --------------------------------------------------------------
    @classmethod
    def chain(cls, agents: list[str], prefix: str = "n") -> StepGraph:
        """One agent after another (ReAct round-robin or skewed, Reflexion): node i = turn i."""
        return cls([StepNode(f"{prefix}{i}", a, (f"{prefix}{i - 1}",) if i else ()) for i, a in enumerate(agents)])

    @classmethod
    def fan_in(cls, mappers: list[str], reducer: str) -> StepGraph:
        """MapReduce: every mapper at once, then the reducer behind an all-of barrier."""
        nodes = [StepNode(f"map{i}", m) for i, m in enumerate(mappers)]
        return cls(nodes + [StepNode("reduce", reducer, tuple(n.id for n in nodes), "all")])
