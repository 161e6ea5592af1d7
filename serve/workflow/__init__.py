"""Agent workflows on kvshare: a client runtime that drives agents over one shared context.

- :mod:`.runtime`: agents, backends (an in-process engine or a server over HTTP), patterns
  (ReAct round-robin or skewed, Reflexion, MapReduce) and the workflow that records each call;

Each call's agent hints (steps to each agent's next call, for KVFlow) are read off the
pattern's task graph, :mod:`kvshare.serve.task_graph`, which the engine's hints use too.
"""

from .runtime import (Agent, CallRecord, EngineBackend, RoundRobin, ServerBackend, SimulatedTool, Skewed,
                      Workflow)

__all__ = ["Agent", "CallRecord", "EngineBackend", "RoundRobin", "ServerBackend", "SimulatedTool", "Skewed",
           "Workflow"]
