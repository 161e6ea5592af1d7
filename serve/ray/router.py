"""Workflow-affinity routing for Ray Serve: every call of a workflow reaches one replica.

A workflow's shared KV lives in one engine, so its calls must land where the earlier ones
ran. Ray ships a consistent-hash router over the request's session id (the ``x-session-id``
header, or ``handle.options(session_id=...)``); it rebuilds its ring whenever the replica
set changes, so a replica that joins (a restart after a failure, a scale-up) takes over
about 1/N of all running workflows, and each of those loses its cache. This router places a
new workflow by the same ring, with bounded loads (Mirrokni, Thorup and Zadimoghaddam,
"Consistent Hashing with Bounded Loads", 2018: a replica already holding ``load_factor``
times its share of the active workflows passes a new one on to the next replica on the ring;
a workflow is active while its last call is under ``active_window_s`` old), and then keeps
it on that replica for as long as the replica lives: only the workflows of a dead replica
move, once, and they stay where they moved.

Requests without a session id go to the least loaded replica (by Ray's queue-length
probes), as Ray's default router does. Session ids come from clients, so the table is
bounded twice: an id is 1 to 256 printable ASCII characters (:func:`valid_session_id`; the
gateway refuses others, and this router load-balances any that reach it) and at most
``max_workflows`` ids are remembered, least recently routed forgotten first.
"""

from __future__ import annotations

import math
import re
import time
from collections import Counter, OrderedDict

from ray.serve.experimental.consistent_hash_router import ConsistentHashRouter
from ray.serve.request_router import PendingRequest, ReplicaID, RunningReplica

from ..hints import MAX_NAME

SESSION_ID = re.compile(rf"[!-~]{{1,{MAX_NAME}}}")  # printable ASCII, no spaces; the engine's workflow id bound
MAX_REMEMBERED_WORKFLOWS = 100_000  # least recently routed ones are forgotten (placed again by the ring)
DEFAULT_LOAD_FACTOR = 1.0  # a replica takes a new workflow while it holds at most this times its share
DEFAULT_ACTIVE_WINDOW_S = 120.0  # a workflow counts towards its replica's load this long after its last call


def valid_session_id(session_id: str) -> bool:
    """Whether ``session_id`` may key the router's table: bounded in length and charset, so
    a client's ids cost the gateway a bounded amount of memory each."""
    return SESSION_ID.fullmatch(session_id) is not None


class WorkflowAffinityRouter(ConsistentHashRouter):
    """Sticky consistent hashing on the session id; load balancing without one.

    Strict: a workflow waits for its replica when that replica's queue is full rather than
    spilling to another (Ray's router would try up to two others and lose the cache). Set
    the deployment's ``max_ongoing_requests`` high enough that this is rare.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._placed: OrderedDict[str, tuple[ReplicaID, float]] = OrderedDict()  # oldest call first
        self._load_factor, self._active_window_s = DEFAULT_LOAD_FACTOR, DEFAULT_ACTIVE_WINDOW_S
        self._max_workflows = MAX_REMEMBERED_WORKFLOWS

    def initialize_state(self, **kwargs) -> None:
        """Ray's kwargs, ``load_factor`` (at least 1; default 1: the ring owner takes a new
        workflow unless it already holds its even share), ``active_window_s`` and
        ``max_workflows`` (the table's size bound)."""
        self._load_factor = float(kwargs.pop("load_factor", DEFAULT_LOAD_FACTOR))
        self._active_window_s = float(kwargs.pop("active_window_s", DEFAULT_ACTIVE_WINDOW_S))
        self._max_workflows = int(kwargs.pop("max_workflows", MAX_REMEMBERED_WORKFLOWS))
        if not self._load_factor >= 1 or not self._active_window_s > 0 or self._max_workflows < 1:
            raise ValueError("load_factor must be at least 1, active_window_s positive and max_workflows at "
                             f"least 1, got {self._load_factor!r}, {self._active_window_s!r} and "
                             f"{self._max_workflows!r}")
        super().initialize_state(**kwargs)
        self._num_fallback_replicas = 1 << 20  # the ring walk lists every replica, in ring order

    def _active_load(self, now: float) -> Counter[ReplicaID]:
        """Active workflows per replica (a walk over the recent end of the table only)."""
        load: Counter[ReplicaID] = Counter()
        for replica, seen in reversed(self._placed.values()):
            if now - seen > self._active_window_s:
                break
            load[replica] += 1
        return load

    def replica_for(self, session_id: str) -> ReplicaID | None:
        """The live replica ``session_id`` is bound to, binding it now if it has none (or its
        replica is gone): the first live replica clockwise of its hash on the ring whose
        active load is under the bound."""
        now = time.monotonic()
        placed = self._placed.get(session_id, (None, 0.0))[0]
        if placed is None or placed not in self._replicas:
            ring = [r for r in self._lookup_ranked_replicas(session_id) if r in self._replicas]
            if not ring:
                return None
            load = self._active_load(now)
            bound = math.ceil(self._load_factor * (sum(load[r] for r in ring) + 1) / len(ring))
            placed = next((r for r in ring if load[r] + 1 <= bound), ring[0])
        self._placed[session_id] = (placed, now)
        self._placed.move_to_end(session_id)
        while len(self._placed) > self._max_workflows:
            self._placed.popitem(last=False)
        return placed

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True  # retry with backoff, not a busy loop
        session_id = pending_request.metadata.session_id if pending_request is not None else None
        if not session_id or not valid_session_id(session_id):
            return [candidate_replicas]  # one rank: the replica with the shortest queue wins
        replica = self.replica_for(session_id)
        return [[self._replicas[replica]]] if replica is not None else []
