"""kvshare.kernels: the engine's compute operations behind one dispatch point.

Each operation has a plain-torch reference here. Faster versions (Triton on GPU, fused CPU
paths) register beside it under another backend name and are tested against the reference;
the engine only ever calls :func:`op`.
"""

from __future__ import annotations

from typing import Callable

from .attention import paged_attention_ref, write_kv_ref
from .lora import gathered_lora_ref, lora_groups

_REGISTRY: dict[tuple[str, str], Callable] = {
    ("paged_attention", "torch"): paged_attention_ref,
    ("write_kv", "torch"): write_kv_ref,
    ("gathered_lora", "torch"): gathered_lora_ref,
}
_ACTIVE = {"paged_attention": "torch", "write_kv": "torch", "gathered_lora": "torch"}


def register(name: str, backend: str, fn: Callable) -> None:
    """Add an implementation of operation ``name`` under ``backend``."""
    _REGISTRY[(name, backend)] = fn


def use(name: str, backend: str) -> None:
    """Select the backend the engine uses for operation ``name``."""
    if (name, backend) not in _REGISTRY:
        raise KeyError(f"no {backend!r} implementation of {name!r}")
    _ACTIVE[name] = backend


def op(name: str) -> Callable:
    return _REGISTRY[(name, _ACTIVE[name])]
