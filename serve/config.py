"""EngineConfig: one engine's settings, and the command-line arguments that set them.

``kvshare serve`` takes the engine options on its command line (`add_engine_arguments`)
and builds this object from them, as ``LLM(...)`` does from keywords, so a setting means the
same thing everywhere; the benchmarks set the few they vary with flags of their own.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields, replace

from ..errors import KvshareError
from ..kinds import KV_LAYOUTS

# the compiled CPU step's batch buckets (a step's rows are padded up to the next one); each
# compiles on first use, about a minute per graph for SmolLM2 on 2 cores (seconds in a later
# process on the same weights: the graph cache, serve/exec/graph_cache.py)
COMPILE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
DEFAULT_COMPILE_MAX_ROWS = 16  # decode steps; larger buckets are opt-in (one more compile each)


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
    kernels: str = "auto"  # kernel backends ("auto": the device's fast path; "torch": the references)
    compile: str = "auto"  # the compiled CPU step: auto (CPU: float32, or bfloat16 where the CPU has bf16 instructions) | on | off
    compile_max_rows: int = DEFAULT_COMPILE_MAX_ROWS  # the compiled step's largest bucket; larger steps (prefill chunks) run eager
    max_loras: int = 8  # adapters one compiled step holds in its LoRA slots (vLLM's name); any number may be loaded
    max_lora_rank: int = 64  # the largest adapter rank those stacks take; higher ranks run eager
    warm_up: bool = False  # servers: compile every step bucket before answering (vLLM captures at startup)
    eviction_policy: str = "lru"  # lru | step (KVFlow: by the agents' steps to execution)
    host_cache_tokens: int = 0  # host KV tier capacity (0 = no tier: evicted KV is dropped)
    host_bandwidth_gbps: float = 25.0  # simulated host<->device link on CPU (about PCIe 4.0 x16)
    prefetch_steps: int = 0  # load back the fixed prompts of agents due within this many steps
    workflow_admission: bool = False  # hold new workflows' calls while the running ones' contexts fill the pool
    workflow_idle_s: float = 120.0  # admission: a workflow with a call ahead but none for this long is gone
    kv_layout: str = "exact"  # lora adapters' KV: exact (private) | forkkv (shared base part + rank-r residual)
    forkkv_max_rank: int = 16  # the ForkKV residual pool's width: the largest adapter rank it serves
    forkkv_residual_tokens: int | None = None  # residual pool capacity (default: 4x the KV pool's tokens)
    # co-located (SwiftCache): keep one layer of KV locally (kv_cache_* then sizes that layer
    # buffer) and stream the rest from memory the other engines lend
    kv_stream: bool = False
    stream_bandwidth_gbps: float = 16.0  # the simulated link to lent memory on CPU

    def __post_init__(self):
        for name in ("block_size", "max_num_batched_tokens", "max_num_seqs", "max_loras", "max_lora_rank"):
            if getattr(self, name) < 1:
                raise KvshareError(f"{name} must be at least 1")
        for name in ("kv_cache_tokens", "kv_cache_bytes", "max_model_len"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise KvshareError(f"{name} must be at least 1")
        if self.host_cache_tokens < 0 or self.prefetch_steps < 0:
            raise KvshareError("host_cache_tokens and prefetch_steps must not be negative")
        if self.prefetch_steps and not self.host_cache_tokens:
            raise KvshareError("prefetch_steps loads KV back from the host tier: it needs host_cache_tokens")
        if not self.workflow_idle_s > 0:
            raise KvshareError("workflow_idle_s must be positive")
        if not self.host_bandwidth_gbps > 0 or not self.stream_bandwidth_gbps > 0:
            raise KvshareError("host_bandwidth_gbps and stream_bandwidth_gbps must be positive")
        if self.compile not in ("auto", "on", "off"):
            raise KvshareError(f"compile must be auto, on or off, not {self.compile!r}")
        if self.compile_max_rows not in COMPILE_BUCKETS:
            raise KvshareError(f"compile_max_rows must be one of {', '.join(map(str, COMPILE_BUCKETS))}, "
                               f"not {self.compile_max_rows}")
        if self.kv_layout not in KV_LAYOUTS:
            raise KvshareError(f"kv_layout must be {', '.join(KV_LAYOUTS[:-1])} or {KV_LAYOUTS[-1]}, "
                               f"not {self.kv_layout!r}")
        if self.forkkv_max_rank < 1 or (self.forkkv_residual_tokens is not None and self.forkkv_residual_tokens < 1):
            raise KvshareError("forkkv_max_rank and forkkv_residual_tokens must be at least 1")

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
    g.add_argument("--kernels", default="auto",
                   help="kernel backends, comma-separated (torch: the references; cpu: the C++ CPU attention; "
                   "int8 / int4: weight-only int8 / int4 base; onednn: oneDNN's packed float32 linear for the dense "
                   "projections; triton: GPU kernels); "
                   "default auto: cpu on a "
                   "CPU, torch on a GPU")
    g.add_argument("--compile", choices=["auto", "on", "off"], default="auto",
                   help="run steps of up to --compile-max-rows rows through torch.compile (Inductor, weights packed; each "
                   "batch bucket compiles on first use, about a minute, and later processes on the same weights load it from "
                   "the cache); auto: on CPU in "
                   "float32 with the torch kernels, and in bfloat16 (torch, int8 or int4 kernels) on CPUs with "
                   "bfloat16 instructions; on a GPU with --kernels triton, decode steps replay from CUDA graphs "
                   "(default auto)")
    g.add_argument("--compile-max-rows", type=int, choices=COMPILE_BUCKETS, default=DEFAULT_COMPILE_MAX_ROWS,
                   help="the compiled step's largest batch bucket (default 16: decode steps); 32-128 also "
                   "compile short prompt chunks with the decode rows beside them, one more graph each")
    g.add_argument("--max-loras", type=int, default=8,
                   help="adapters one step may hold in the compiled step's LoRA slots (default 8; as in vLLM, "
                   "any number may be loaded: a step's adapters are swapped into the slots)")
    g.add_argument("--max-lora-rank", type=int, default=64,
                   help="largest adapter rank those stacks take (default 64); higher ranks run eager")
    g.add_argument("--warm-up", action="store_true",
                   help="kvshare serve: compile every step bucket, with the adapters too, before answering (as "
                   "vLLM captures its graphs at startup; minutes the first time on 2 cores, seconds from the disk "
                   "cache); default: each on its first use")
    g.add_argument("--eviction-policy", choices=["lru", "step"], default="lru",
                   help="which idle cached KV goes first: lru, or step (KVFlow: agents due last go first)")
    g.add_argument("--host-cache-tokens", type=int, default=0,
                   help="host KV tier: evicted KV waits here to be loaded back (default 0: none)")
    g.add_argument("--host-bandwidth-gbps", type=float, default=25.0,
                   help="simulated host<->device copy rate on CPU, GB/s (default 25: about PCIe 4.0 x16)")
    g.add_argument("--prefetch-steps", type=int, default=0,
                   help="load back the fixed prompts of agents due within this many steps (default 0: off)")
    g.add_argument("--workflow-admission", action="store_true",
                   help="hold the first call of a new workflow (kvshare_hints.workflow_id) while the contexts of the "
                   "workflows already running fill the KV pool, so they keep their cached context between turns")
    g.add_argument("--workflow-idle-s", type=float, default=120.0,
                   help="with --workflow-admission: a workflow whose last call named a next one, but which sent "
                   "none for this many seconds, is taken as gone and frees its place (default 120)")
    g.add_argument("--kv-layout", choices=KV_LAYOUTS, default="exact",
                   help="KV of lora adapters: exact (private, default), forkkv (ForkKV: base part shared "
                   "among lora agents, rank-r residual private; approximate, saves memory) or full_reuse "
                   "(whole KV shared as-is: a quality baseline, wrong by construction)")
    g.add_argument("--forkkv-max-rank", type=int, default=16, help="ForkKV residual width: largest lora rank")
    g.add_argument("--forkkv-residual-tokens", type=int,
                   help="ForkKV residual pool capacity in tokens (default: 4x --kv-cache-tokens)")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(dtype=args.dtype, device=args.device, kv_cache_tokens=args.kv_cache_tokens,
                        block_size=args.block_size, max_num_batched_tokens=args.max_num_batched_tokens,
                        max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                        kernels=args.kernels, compile=args.compile, compile_max_rows=args.compile_max_rows,
                        max_loras=args.max_loras, max_lora_rank=args.max_lora_rank, warm_up=args.warm_up,
                        eviction_policy=args.eviction_policy,
                        host_cache_tokens=args.host_cache_tokens, host_bandwidth_gbps=args.host_bandwidth_gbps,
                        prefetch_steps=args.prefetch_steps, workflow_admission=args.workflow_admission,
                        workflow_idle_s=args.workflow_idle_s,
                        kv_layout=args.kv_layout,
                        forkkv_max_rank=args.forkkv_max_rank, forkkv_residual_tokens=args.forkkv_residual_tokens)


@dataclass(frozen=True)
class ServerLimits:
    """What one HTTP request may ask of ``kvshare serve``, so that no single request can cost
    the server more than its share; past a limit the request is refused with a clear 4xx
    (vLLM's name where vLLM has the limit)."""

    max_request_bytes: int = 8 * 2**20  # request body; larger is 413, refused before it is parsed
    max_prompts: int = 64  # prompts in one /v1/completions batch
    max_n: int = 16  # choices per prompt (``n``); every choice counts against max_waiting
    max_logprobs: int = 20  # logprobs / top_logprobs alternatives per token (vLLM: max_logprobs)
    max_stop_sequences: int = 16  # entries of ``stop``
    max_stop_length: int = 1024  # characters of one stop string
    max_hints_bytes: int = 64 * 2**10  # ``kvshare_hints`` as JSON
    max_hints_depth: int = 8  # nesting of ``kvshare_hints`` (objects and lists)
    max_waiting: int = 256  # requests queued for the engine: more is 503; a larger batch is 400
    # sequences one request queues (prompts x n): one request may not fill the waiting queue alone
    max_request_sequences: int = 64
    # echo + logprobs: prompt tokens x (logprobs + 1) entries a reply scores, over its prompts and choices
    max_scored_entries: int = 2**20

    def __post_init__(self):
        for f in fields(self):
            if getattr(self, f.name) < 1:
                raise KvshareError(f"{f.name} must be at least 1")


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    """``kvshare serve``'s per-request limits (see :class:`ServerLimits`)."""
    g = parser.add_argument_group("request limits")
    for f in fields(ServerLimits):
        g.add_argument("--" + f.name.replace("_", "-"), type=int, default=f.default,
                       help=f"(default {f.default})")


def server_limits_from_args(args: argparse.Namespace) -> ServerLimits:
    return ServerLimits(**{f.name: getattr(args, f.name) for f in fields(ServerLimits)})


def add_ray_arguments(parser: argparse.ArgumentParser) -> None:
    """``kvshare serve --ray``: engine replicas on Ray Serve (the ``kvshare[ray]`` extra)."""
    g = parser.add_argument_group("Ray Serve (pip install 'kvshare[ray]')")
    g.add_argument("--ray", action="store_true",
                   help="serve from Ray Serve replicas, each an engine with the same base and adapters")
    g.add_argument("--replicas", type=int, help="engine replicas (default 2)")
    g.add_argument("--num-cpus-per-replica", type=float, help="Ray CPUs reserved per replica (default 1)")
    g.add_argument("--num-gpus-per-replica", type=float, help="Ray GPUs reserved per replica (default 0)")
    g.add_argument("--threads-per-replica", type=int,
                   help="torch/OpenMP threads in each replica (default: its CPUs; Ray would set 1)")
    g.add_argument("--ray-address", help="join this Ray cluster (e.g. auto, or ray://HOST:10001); "
                   "default: start a local one")
    g.add_argument("--no-affinity", action="store_true",
                   help="balance every request by load (no workflow affinity): the control experiment")


RAY_ONLY_FLAGS = ("replicas", "num_cpus_per_replica", "num_gpus_per_replica", "threads_per_replica",
                  "ray_address", "no_affinity")
