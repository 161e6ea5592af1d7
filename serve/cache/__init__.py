"""The KV cache's bookkeeping, one job per module (SGLang's mem_cache is the model).

- :mod:`pool`: block ids over a tensor view, reference counts, a free list (so a pool can
  later grow or shrink inside a shared arena);
- :mod:`prefix_index`: the hash chain of full blocks and the pending table;
- :mod:`policy`: which unreferenced cached block goes first (``EvictionPolicy``: LRU, or
  KVFlow's step-aware order);
- :mod:`agents`: per workflow agent, the steps to its next call and its fixed prompt's blocks;
- :mod:`host_tier`: evicted blocks in host memory, loaded back by a copy thread;
- :mod:`block_manager`: the facade the scheduler talks to, and the statistics.
"""

from .agents import AgentTable
from .block_manager import BlockManager, CacheStats, OutOfBlocks, PrefixLoading, PrefixPending
from .host_tier import HostTier
from .policy import POLICIES, EvictionPolicy, LRUPolicy, StepAwarePolicy, make_policy
from .pool import BlockPool, OutOfResidualBlocks
from .prefix_index import PrefixIndex

__all__ = ["AgentTable", "BlockManager", "BlockPool", "CacheStats", "EvictionPolicy", "HostTier",
           "LRUPolicy", "OutOfBlocks", "OutOfResidualBlocks", "POLICIES", "PrefixIndex", "PrefixLoading", "PrefixPending",
           "StepAwarePolicy", "make_policy"]
