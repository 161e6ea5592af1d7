"""What an engine reports: its counters, the prefix cache's figures and each KV pool's blocks.

:meth:`LLMEngine.stats` and :meth:`LLMEngine.kv_usage` (read by ``/metrics``, the benchmarks
and the tests) are built here from the engine's parts, so the facade only names them. The
optional parts - ForkKV's residual pool, the host tier, workflow admission - each add their
figures only where the engine has one.
"""

from __future__ import annotations

from .admission import WorkflowAdmission
from ..cache import BlockManager
from .scheduler import Scheduler


def kv_usage(blocks: BlockManager, kv_bytes_per_token: int, residual_block_bytes: int) -> dict:
    """Per pool: blocks in total, in use, shared, private, unsealed, cached-idle, and the
    blocks holding KV (in use or kept for reuse) and their bytes."""
    usage = blocks.usage()
    holding = blocks.num_holding_kv
    usage.update(blocks_holding_kv=holding, bytes_holding_kv=holding * blocks.block_size * kv_bytes_per_token)
    pools = {"kv": usage}
    residual = blocks.residual
    if residual is not None:
        res = residual.usage()
        res.update(blocks_holding_kv=residual.num_holding, bytes_holding_kv=residual.num_holding * residual_block_bytes)
        pools["forkkv_residual"] = res
    return pools


def engine_stats(counters: dict[str, int], blocks: BlockManager, scheduler: Scheduler, held: int) -> dict:
    """The engine's counters, the pool's usage, the prefix cache's hits and evictions, and
    its parts' figures; ``held``: the waiting calls workflow admission holds back."""
    cache = blocks.stats
    return {
        **counters, **blocks.usage(),
        "prefix_hit_rate": cache.hit_tokens / cache.queried_tokens if cache.queried_tokens else 0.0,
        "prefix_hit_tokens": cache.hit_tokens, "prefix_queried_tokens": cache.queried_tokens,
        **{f"prefix_hit_tokens_{kind}": n for kind, n in cache.hit_tokens_by_kind.items()},
        "evictions": cache.evictions,
        **forkkv_stats(blocks),
        "preemptions": scheduler.preemptions, **host_tier_stats(blocks),
        **admission_stats(scheduler.admission, held),
        "waiting": len(scheduler.waiting), "running": len(scheduler.running),
    }


def admission_stats(admission: WorkflowAdmission | None, held: int) -> dict:
    """Workflows admitted and live now, how often calls of new ones were held back, and how
    many wait held now (nothing without workflow admission)."""
    if admission is None:
        return {}
    return {"workflows_admitted": admission.admitted, "admission_holds": admission.held,
            "admission_held_waiting": held}


def forkkv_stats(blocks: BlockManager) -> dict:
    """The ForkKV residual pool's hits and evictions (nothing without the pool)."""
    residual = blocks.residual
    if residual is None:
        return {}
    return {"forkkv_base_read_tokens": blocks.stats.forkkv_base_read_tokens,
            "forkkv_residual_hit_tokens": residual.stats.hit_tokens,
            "forkkv_residual_evictions": residual.stats.evictions}


def host_tier_stats(blocks: BlockManager) -> dict:
    """Blocks and bytes the host tier moved, and how much of the prompts it served."""
    tier = blocks.tier
    if tier is None:
        return {}
    return {"host_" + k: v for k, v in vars(tier.stats).items()} | {
        "host_hit_tokens": blocks.stats.host_hit_tokens,
        "host_blocks_total": tier.num_blocks, "host_blocks_used": len(tier.index),
        "host_loads_in_flight": blocks.loads_in_flight()}
