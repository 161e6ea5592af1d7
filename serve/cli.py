"""``kvshare serve``: the OpenAI-compatible server, registered by the serve subsystem."""

from __future__ import annotations

import argparse
import json
import os
import sys

from ..errors import KvshareError
from .config import (RAY_ONLY_FLAGS, EngineConfig, add_engine_arguments, add_ray_arguments, add_server_arguments,
                     engine_config_from_args, server_limits_from_args)

COLOCATE_KEYS = ("model", "served_model_name", "adapters", "kv_cache_tokens")


def parse_lora_module(value: str, served_names: list[str]) -> tuple[str, str]:
    """vLLM's ``--lora-modules`` item: ``name=path`` or ``{"name": ..., "path": ...,
    "base_model_name": ...}``; a ``base_model_name`` must be a name this server serves the base as.
    Returns (name, path)."""
    if value.lstrip().startswith("{"):
        try:
            item = json.loads(value)
        except json.JSONDecodeError as err:
            raise KvshareError(f"--lora-modules: invalid JSON {value!r} ({err.msg})") from None
        unknown = sorted(set(item) - {"name", "path", "base_model_name"}) if isinstance(item, dict) else []
        if not isinstance(item, dict) or unknown or not all(isinstance(item.get(k), str) and item[k]
                                                            for k in ("name", "path")):
            raise KvshareError(f"--lora-modules: {value!r} must be a JSON object with string 'name' and 'path' "
                               "(and optionally 'base_model_name')" + (f"; unknown: {', '.join(unknown)}" if unknown
                                                                       else ""))
        base = item.get("base_model_name")
        if base is not None and base not in served_names:
            raise KvshareError(f"--lora-modules: adapter {item['name']!r} is for base model {base!r}, but this "
                               f"server serves {', '.join(map(repr, served_names))}")
        return item["name"], item["path"]
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise KvshareError(f"--lora-modules: {value!r} is neither name=path nor a JSON object")
    return name, path


def parse_colocate_spec(value: str, config: EngineConfig) -> tuple[str, list[str], EngineConfig, str]:
    """A ``--colocate`` item, ``{"model": ..., "served_model_name": ..., "adapters": [...],
    "kv_cache_tokens": N}`` (all but model optional), as (model, adapter folders, engine
    settings: the main model's with its own kv_cache_tokens, served name)."""
    shape = (f"--colocate: {value!r} must be a JSON object with a string 'model' and optionally "
             "'served_model_name' (a string), 'adapters' (a list of folders) and 'kv_cache_tokens' "
             "(a positive integer)")
    try:
        item = json.loads(value)
    except json.JSONDecodeError as err:
        raise KvshareError(f"--colocate: invalid JSON {value!r} ({err.msg})") from None
    if not isinstance(item, dict):
        raise KvshareError(shape)
    unknown = sorted(set(item) - set(COLOCATE_KEYS))
    if unknown:
        raise KvshareError(f"{shape}; unknown: {', '.join(unknown)}")
    model, name = item.get("model"), item.get("served_model_name", item.get("model"))
    adapters, tokens = item.get("adapters", []), item.get("kv_cache_tokens")
    if not (isinstance(model, str) and model and isinstance(name, str) and name and isinstance(adapters, list)
            and all(isinstance(a, str) and a for a in adapters)
            and (tokens is None or (type(tokens) is int and tokens >= 1))):
        raise KvshareError(shape)
    return model, adapters, config.updated(kv_cache_tokens=tokens) if tokens else config, name


def _colocated(args: argparse.Namespace, config: EngineConfig) -> list[tuple[str, list[str], EngineConfig, str]]:
    """The ``--colocate`` models, checked against the main model and each other."""
    if args.lending and not args.colocate:
        raise KvshareError("--lending needs --colocate: models to lend KV blocks between")
    if not args.colocate:
        return []
    if args.served_model_name and len(args.served_model_name) > 1:
        raise KvshareError("with --colocate, --served-model-name takes one name (each model is served under one)")
    specs = [parse_colocate_spec(v, config) for v in args.colocate]
    served = [(args.served_model_name or [args.model])[0]] + [name for *_, name in specs]
    twice = next((name for i, name in enumerate(served) if name in served[:i]), None)
    if twice is not None:
        raise KvshareError(f"--colocate: served model name {twice!r} is used twice (set 'served_model_name')")
    return specs


def _cmd_serve(args: argparse.Namespace) -> int:
    try:
        from .http.server import serve
    except ImportError as err:
        raise KvshareError(f"the server needs its extra: pip install 'kvshare[server]' ({err})") from None
    given = [name for name in RAY_ONLY_FLAGS if getattr(args, name) is not None and getattr(args, name) is not False]
    if given and not args.ray:
        raise KvshareError(f"--{given[0].replace('_', '-')} needs --ray")
    if args.ray and (args.colocate or args.lending):
        raise KvshareError("--colocate and --lending do not work with --ray (each Ray replica serves one base model)")
    if args.model and args.model_positional and args.model != args.model_positional:
        raise KvshareError(f"two models given: {args.model_positional!r} and --model {args.model!r}")
    args.model = args.model or args.model_positional
    if not args.model:
        raise KvshareError("kvshare serve needs a model: kvshare serve MODEL (or --model MODEL)")
    served_names = args.served_model_name or [args.model]
    lora_modules = [parse_lora_module(v, served_names) for v in args.lora_modules or []]
    config = engine_config_from_args(args)
    colocate = _colocated(args, config)
    # env: not visible in ps; VLLM_API_KEY as vLLM reads it (a vLLM deployment's secret keeps working)
    api_key = args.api_key or os.environ.get("KVSHARE_API_KEY") or os.environ.get("VLLM_API_KEY") or None
    if not api_key and args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"kvshare: warning: serving on {args.host} without an API key: anyone who can reach "
              "the port can use it (set KVSHARE_API_KEY or --api-key)", file=sys.stderr)
    enable_loading = args.enable_lora_loading or \
        os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").lower() in ("1", "true")
    if args.ray and enable_loading:
        raise KvshareError("runtime LoRA loading (--enable-lora-loading, VLLM_ALLOW_RUNTIME_LORA_UPDATING) does not "
                           "work with --ray: a load would reach one replica")
    _check_runtime_lora_flags(args, enable_loading)
    if args.ray:
        return _serve_on_ray(args, api_key, lora_modules, enable_loading)
    serve(args.model, args.adapter or [], host=args.host, port=args.port, api_key=api_key,
          config=config, limits=server_limits_from_args(args),
          lora_modules=lora_modules, served_model_name=args.served_model_name,
          enable_lora_loading=enable_loading, colocate=colocate, lending=args.lending,
          generation_config=args.generation_config, lora_root=args.lora_root,
          allow_runtime_replace_startup_adapters=args.allow_runtime_replace_startup_adapters)
    return 0


def _check_runtime_lora_flags(args: argparse.Namespace, enable_loading: bool) -> None:
    """--lora-root and --allow-runtime-replace-startup-adapters only say what runtime loading
    may do: without it they would protect nothing, so a command line that relies on them is
    refused rather than silently ignored; a root that is not a folder too, before models load."""
    for flag in ("lora_root", "allow_runtime_replace_startup_adapters"):
        if getattr(args, flag) and not enable_loading:
            raise KvshareError(f"--{flag.replace('_', '-')} applies to runtime LoRA loading: it needs "
                               "--enable-lora-loading (or VLLM_ALLOW_RUNTIME_LORA_UPDATING=true)")
    if args.lora_root is not None:
        from .http.lora_scope import lora_root

        lora_root(args.lora_root)


def _serve_on_ray(args: argparse.Namespace, api_key: str | None, lora_modules: list[tuple[str, str]],
                  enable_loading: bool) -> int:
    """``kvshare serve --ray``: the same app in every replica of a Ray Serve deployment."""
    try:
        from .ray.replicas import EngineSpec, RayServeOptions, serve_forever
    except ImportError as err:
        raise KvshareError(f"--ray needs Ray Serve: pip install 'kvshare[ray]' ({err})") from None

    options = RayServeOptions(
        replicas=2 if args.replicas is None else args.replicas,
        num_cpus_per_replica=1.0 if args.num_cpus_per_replica is None else args.num_cpus_per_replica,
        num_gpus_per_replica=args.num_gpus_per_replica or 0.0, threads_per_replica=args.threads_per_replica,
        affinity=not args.no_affinity)
    spec = EngineSpec(args.model, tuple(args.adapter or []), engine_config_from_args(args),
                      server_limits_from_args(args), api_key, tuple(args.served_model_name or []) or None,
                      tuple(lora_modules), enable_loading, args.generation_config)
    serve_forever(spec, options, host=args.host, port=args.port, ray_address=args.ray_address)
    return 0


def register(sub) -> None:
    """Add ``kvshare serve``."""
    p = sub.add_parser("serve", help="OpenAI-compatible server for a base and its adapters",
                       description="Serve the base and exported adapters over an OpenAI-compatible "
                       "HTTP API (/v1/models, /v1/completions, /v1/chat/completions, /health, "
                       "/metrics). The request's model field picks the base or an adapter.")
    p.add_argument("model_positional", nargs="?", metavar="MODEL",
                   help="zoo name, Hugging Face id (local cache) or local model folder (as `vllm serve MODEL`)")
    p.add_argument("--model", metavar="NAME_OR_DIR", help="the same, as a flag")
    for flag in ("--enable-lora", "--enable-prefix-caching"):  # vLLM command lines run unchanged
        p.add_argument(flag, action="store_true", help="accepted as vLLM's flag; always on in kvshare")
    p.add_argument("--adapter", action="append", metavar="DIR", help="exported adapter folder (repeatable)")
    p.add_argument("--lora-modules", action="extend", nargs="+", metavar="NAME=DIR",
                   help="as vLLM: an exported adapter served under NAME (repeatable; also the JSON form "
                   '\'{"name": ..., "path": ..., "base_model_name": ...}\')')
    p.add_argument("--served-model-name", nargs="+", metavar="NAME",
                   help="as vLLM: the name(s) the base answers to (the first is listed; default: --model)")
    p.add_argument("--enable-lora-loading", action="store_true",
                   help="add POST /v1/load_lora_adapter and /v1/unload_lora_adapter (as vLLM with "
                   "VLLM_ALLOW_RUNTIME_LORA_UPDATING=true, which also turns this on)")
    p.add_argument("--lora-root", metavar="DIR",
                   help="with --enable-lora-loading: runtime-loaded adapters must lie in this folder (their paths "
                   "resolved, symlinks followed); default: any folder the server can read")
    p.add_argument("--allow-runtime-replace-startup-adapters", action="store_true",
                   help="with --enable-lora-loading: let /v1/unload_lora_adapter unload (and so replace) the adapters "
                   "given at start-up (--adapter, --lora-modules, --colocate); default: they stay")
    p.add_argument("--colocate", action="append", metavar="SPEC",
                   help="serve another base model in this process, routed by the request's model (repeatable): "
                   '\'{"model": NAME_OR_DIR, "served_model_name": ..., "adapters": [DIR, ...], "kv_cache_tokens": N}\' '
                   "(all but model optional; other engine settings as the main model's)")
    p.add_argument("--generation-config", choices=["auto", "vllm"], default="auto",
                   help="as vLLM: auto (default) takes the sampling a request leaves out (temperature, top_p, "
                   "top_k, min_p, repetition_penalty) from the model's generation_config.json; vllm leaves it off")
    p.add_argument("--lending", action="store_true",
                   help="co-located models lend idle KV blocks to each other (SwiftCache)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1/*, /tokenize and /detokenize (or set KVSHARE_API_KEY "
                   "or vLLM's VLLM_API_KEY, "
                   "which other users cannot read from the process list)")
    add_engine_arguments(p)
    add_server_arguments(p)
    add_ray_arguments(p)
    p.set_defaults(func=_cmd_serve)
