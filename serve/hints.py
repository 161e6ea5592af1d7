"""Typed agent hints: what a workflow tells the engine about the calls ahead.

A request may say which workflow and agent it belongs to, where the agent's fixed prompt
ends (the rest is its dynamic suffix), and how many steps away the workflow's other agents
are - as a mapping, or as a step graph plus the nodes already finished. Each names the
workflow's whole schedule: an agent it leaves out has no call ahead. The workflow
runtime sends them in the ``kvshare_hints`` body field; routers may send the identifiers as
headers (:data:`HEADERS`). The step-aware eviction policy and the prefetcher read them;
without hints the engine behaves as it always did.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import KvshareError
from .task_graph import StepGraph, StepNode

# HTTP headers a router may set instead of body fields (the body wins where both are given)
HEADERS = {"x-kvshare-workflow-id": "workflow_id", "x-session-id": "workflow_id",
           "x-kvshare-agent-id": "agent_id"}
MAX_NAME = 256  # characters of a workflow or agent id
MAX_AGENTS = 1024  # entries of steps_to_execution
MAX_NODES = 4096  # nodes of a step graph


@dataclass(frozen=True)
class AgentHints:
    workflow_id: str | None = None
    agent_id: str | None = None
    fixed_prefix_tokens: int | None = None  # the agent's fixed prompt; None = learn it
    # agent -> steps to its next call, for every agent of the workflow with a call ahead (one
    # left out has none); None: the request says nothing about the workflow's schedule
    steps_to_execution: dict[str, int] | None = None

    @property
    def agent_key(self) -> tuple[str, str] | None:
        """(workflow, agent) when the request names its agent; None for anonymous calls."""
        if self.agent_id is None:
            return None
        return (self.workflow_id or "", self.agent_id)

    @classmethod
    def parse(cls, raw: dict | None, headers: dict[str, str] | None = None) -> AgentHints:
        """Validate a hints dict (and router headers); a malformed field is a clear error."""
        raw = dict(raw or {})
        for header, name in (headers or {}).items():
            if header.lower() in HEADERS and HEADERS[header.lower()] not in raw:
                raw[HEADERS[header.lower()]] = name
        known = {"workflow_id", "agent_id", "fixed_prefix_tokens", "steps_to_execution", "graph",
                 "next_agents"}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise KvshareError(f"kvshare_hints: unknown field(s) {unknown} (known: {sorted(known)})")
        steps = _steps(raw)
        return cls(_name(raw.get("workflow_id"), "workflow_id"), _name(raw.get("agent_id"), "agent_id"),
                   _count(raw.get("fixed_prefix_tokens"), "fixed_prefix_tokens"), steps)


def _name(value, field_name: str) -> str | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise KvshareError(f"kvshare_hints.{field_name} must be a string")
    value = str(value)
    if not 0 < len(value) <= MAX_NAME:
        raise KvshareError(f"kvshare_hints.{field_name} must have 1 to {MAX_NAME} characters")
    return value


def _count(value, field_name: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**31:
        raise KvshareError(f"kvshare_hints.{field_name} must be a non-negative integer")
    return value


def _steps(raw: dict) -> dict[str, int] | None:
    """steps_to_execution, else derived from a graph, else next_agents (each one step away);
    None when the request gives none of them."""
    given = [k for k in ("steps_to_execution", "graph", "next_agents") if raw.get(k) is not None]
    if len(given) > 1:
        raise KvshareError(f"kvshare_hints: give one of steps_to_execution, graph, next_agents (got {given})")
    if "steps_to_execution" in given:
        value = raw["steps_to_execution"]
        if not isinstance(value, dict) or len(value) > MAX_AGENTS:
            raise KvshareError(f"kvshare_hints.steps_to_execution must map at most {MAX_AGENTS} agent ids to steps")
        return {_name(k, "steps_to_execution key"): _count(v, f"steps_to_execution[{k!r}]") for k, v in value.items()}
    if "graph" in given:  # a node runnable now is the next call: 1 step away, as next_agents and the runtime
        return {a: s + 1 for a, s in _graph(raw["graph"]).agent_steps(_done(raw["graph"])).items()}
    if "next_agents" in given:
        value = raw["next_agents"]
        if not isinstance(value, list) or len(value) > MAX_AGENTS:
            raise KvshareError(f"kvshare_hints.next_agents must be a list of at most {MAX_AGENTS} agent ids")
        return {_name(a, "next_agents item"): 1 for a in value}
    return None


def _graph(value) -> StepGraph:
    """``{"nodes": [{"id", "agent", "after": [...], "join": "all"|"any"}], "done": [...]}``."""
    if not isinstance(value, dict) or not isinstance(value.get("nodes"), list):
        raise KvshareError("kvshare_hints.graph must be an object with a 'nodes' list")
    if len(value["nodes"]) > MAX_NODES:
        raise KvshareError(f"kvshare_hints.graph may have at most {MAX_NODES} nodes")
    nodes = []
    for item in value["nodes"]:
        if not isinstance(item, dict) or set(item) - {"id", "agent", "after", "join"}:
            raise KvshareError("kvshare_hints.graph nodes are objects with id, agent, after, join")
        after = item.get("after", [])
        if not isinstance(after, list):
            raise KvshareError("kvshare_hints.graph node 'after' must be a list of node ids")
        nodes.append(StepNode(_name(item.get("id"), "graph node id"), _name(item.get("agent"), "graph node agent"),
                              tuple(_name(a, "graph node after") for a in after), item.get("join", "all")))
    if any(n.id is None or n.agent is None for n in nodes):
        raise KvshareError("kvshare_hints.graph nodes need an id and an agent")
    return StepGraph(nodes)


def _done(value: dict) -> set[str]:
    done = value.get("done", [])
    if not isinstance(done, list):
        raise KvshareError("kvshare_hints.graph.done must be a list of node ids")
    return {_name(d, "graph.done item") for d in done}
