"""EngineConfig: one engine's settings, and the command-line arguments that set them.

``kvshare serve``, ``kvshare bench`` and ``kvshare eval`` take the same engine options
(`add_engine_arguments`) and build the same object from them, so a setting means the same
thing everywhere.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields, replace

from ..errors import KvshareError


@dataclass(frozen=True)
class EngineConfig:
    dtype: str = "float32"  # float32 | bfloat16
    device: str = "cpu"  # cpu | cuda (weights, KV pool, adapters and metadata live there)
    kv_cache_tokens: int | None = None  # KV pool capacity (default 16384 tokens)
    kv_cache_bytes: int | None = None  # or its size in bytes
    block_size: int = 16
    max_num_batched_tokens: int = 512  # rows per step
    max_num_seqs: int = 64
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    kernels: str = "torch"  # kernel backend for every operation
    eviction_policy: str = "lru"

    def __post_init__(self):
        for name in ("block_size", "max_num_batched_tokens", "max_num_seqs"):
            if getattr(self, name) < 1:
                raise KvshareError(f"{name} must be at least 1")
        for name in ("kv_cache_tokens", "kv_cache_bytes", "max_model_len"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise KvshareError(f"{name} must be at least 1")

    def updated(self, **overrides) -> EngineConfig:
        """A copy with ``overrides`` applied (unknown names are a clear error)."""
        known = {f.name for f in fields(self)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise KvshareError(f"unknown engine setting(s): {', '.join(unknown)}")
        return replace(self, **overrides)


def add_engine_arguments(parser: argparse.ArgumentParser, *, kv_default_help: str = "16384") -> None:
    """The engine options every command that runs an engine accepts."""
    g = parser.add_argument_group("engine")
    g.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    g.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    g.add_argument("--kv-cache-tokens", type=int, help=f"KV pool capacity in tokens (default: {kv_default_help})")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    g.add_argument("--max-num-batched-tokens", type=int, default=512, help="rows per engine step")
    g.add_argument("--max-num-seqs", type=int, default=64, help="sequences running at once")
    g.add_argument("--max-model-len", type=int, help="longest prompt + completion in tokens")
    g.add_argument("--kernels", default="torch", help="kernel backend (default: torch references)")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(dtype=args.dtype, device=args.device, kv_cache_tokens=args.kv_cache_tokens,
                        block_size=args.block_size, max_num_batched_tokens=args.max_num_batched_tokens,
                        max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                        kernels=args.kernels)
