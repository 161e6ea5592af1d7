"""The KV cache's bookkeeping, one job per module (SGLang's mem_cache is the model).

- :mod:`pool`: block ids over a tensor view, reference counts, a free list (so a pool can
  later grow or shrink inside a shared arena);
- :mod:`prefix_index`: the hash chain of full blocks and the pending table;
- :mod:`policy`: which unreferenced cached block goes first (``EvictionPolicy``; LRU today);
- :mod:`layout`: which pool and owner a block of a sequence gets, from its kind's spec;
- :mod:`block_manager`: the facade the scheduler talks to, and the statistics.
"""

from .block_manager import BlockManager, CacheStats, OutOfBlocks, PrefixPending
from .layout import KVLayout
from .policy import POLICIES, EvictionPolicy, LRUPolicy, make_policy
from .pool import BlockPool
from .prefix_index import PrefixIndex

__all__ = ["BlockManager", "BlockPool", "CacheStats", "EvictionPolicy", "KVLayout", "LRUPolicy",
           "OutOfBlocks", "POLICIES", "PrefixIndex", "PrefixPending", "make_policy"]
