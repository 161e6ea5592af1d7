"""Kernel implementations by (operation, backend), and each engine's own selection.

Implementations register process-wide (the plain-torch references here; Triton ones when
Triton and a GPU are present, or Triton's CPU interpreter is on); *selection* is per engine (:class:`Kernels`), so two engines
in one process can run different backends. Every backend is tested against the reference.
"""

from __future__ import annotations

import os
from typing import Callable

import torch

from kvshare.errors import KvshareError  # absolute: transformers imports a top-level "kernels" from the cwd
from .attention import paged_attention_ref, write_kv_ref
from .cpu import paged_attention_cpu
from .cpu.pointwise import CpuPointwise
from .cpu.residual import residual_attention_cpu
from .linear import OneDNNLinear, TorchLinear
from .lora import gathered_lora_ref
from .pointwise import TorchPointwise
from .quant import Int4WeightOnlyLinear, Int8WeightOnlyLinear
from .residual_attention import residual_attention_sdpa

OPERATIONS = ("paged_attention", "write_kv", "gathered_lora", "linear", "residual_attention", "pointwise")

# "linear" implementations are objects with prepare(weight) (once, at load) and apply(x, w, b);
# "pointwise" ones have the eager step's rms_norm, add_rms_norm, rope and silu_mul (kernels/pointwise.py)
_IMPLEMENTATIONS: dict[tuple[str, str], Callable] = {
    ("paged_attention", "torch"): paged_attention_ref,
    ("write_kv", "torch"): write_kv_ref,
    ("gathered_lora", "torch"): gathered_lora_ref,
    ("linear", "torch"): TorchLinear,
    ("residual_attention", "torch"): residual_attention_sdpa,  # ForkKV; the block loop is its oracle
    ("pointwise", "torch"): TorchPointwise,
    # C++, built on first use; the reference where it cannot be built or the tensors are not on the CPU
    ("paged_attention", "cpu"): paged_attention_cpu,
    ("residual_attention", "cpu"): residual_attention_cpu,  # ForkKV's decode rows
    ("pointwise", "cpu"): CpuPointwise,  # the eager step's norms, RoPE and SiLU(gate) * up, fused
}
if OneDNNLinear.available():
    _IMPLEMENTATIONS[("linear", "onednn")] = OneDNNLinear
_IMPLEMENTATIONS[("linear", "int8")] = Int8WeightOnlyLinear  # weight-only int8 base (kernels/quant.py)
_IMPLEMENTATIONS[("linear", "int4")] = Int4WeightOnlyLinear  # weight-only int4, Q4_1's precision (kernels/quant.py)


def register(name: str, backend: str, fn: Callable) -> None:
    """Add an implementation of operation ``name`` under ``backend``."""
    if name not in OPERATIONS:
        raise ValueError(f"unknown kernel operation {name!r}")
    _IMPLEMENTATIONS[(name, backend)] = fn


def register_triton() -> bool:
    """Register the Triton kernels as backend "triton" where they can run: Triton installed
    and a GPU present, or ``TRITON_INTERPRET=1`` (Triton's interpreter on CPU, for tests).

    Called at import; callable again (idempotent) after setting the variable. Returns
    whether the backend is registered.
    """
    if ("paged_attention", "triton") in _IMPLEMENTATIONS:
        return True
    if not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"):
        return False
    try:
        from . import triton as kernels
    except ModuleNotFoundError as exc:  # Triton not installed (the "kernels" extra)
        if (exc.name or "").split(".")[0] != "triton":
            raise
        return False

    register("paged_attention", "triton", kernels.paged_attention)
    register("write_kv", "triton", kernels.write_kv)
    register("gathered_lora", "triton", kernels.gathered_lora)
    register("residual_attention", "triton", kernels.residual_attention)
    return True


def backends(name: str) -> list[str]:
    return sorted(b for (n, b) in _IMPLEMENTATIONS if n == name)


def all_backends() -> list[str]:
    return sorted({b for (_, b) in _IMPLEMENTATIONS})


register_triton()


class Kernels:
    """One engine's choice of implementation per operation (default: the torch references).

    ``Kernels("triton")`` takes that backend for every operation it implements and the
    reference for the rest; ``Kernels("int8,cpu")`` applies several backends in turn (each
    for the operations it implements); ``Kernels({"paged_attention": "triton"})`` names
    single operations. ``"auto"`` is the fast path of the ``device``: on CPU the "cpu"
    backend, elsewhere the references (Triton stays opt-in). A backend no operation has is
    a clear error.
    """

    def __init__(self, backend: str | dict[str, str] = "torch", device: torch.device | str | None = None):
        choice = {name: "torch" for name in OPERATIONS}
        if isinstance(backend, str):
            for name in backend.split(","):
                name = name.strip()
                if name == "auto":
                    name = "cpu" if torch.device(device or "cpu").type == "cpu" else "torch"
                if not any((op, name) in _IMPLEMENTATIONS for op in OPERATIONS):
                    raise KvshareError(f"no kernel backend {name!r} (available: auto, {', '.join(all_backends())})")
                choice.update({op: name for op in OPERATIONS if (op, name) in _IMPLEMENTATIONS})
        else:
            choice.update(backend)
        for name, chosen in choice.items():
            if (name, chosen) not in _IMPLEMENTATIONS:
                raise KvshareError(f"no {chosen!r} implementation of kernel {name!r} "
                                   f"(available: {', '.join(backends(name)) or 'none'})")
        if device is not None and torch.device(device).type != "cuda" and "triton" in choice.values():
            from .triton import INTERPRETED  # registered, so importable

            if not INTERPRETED:  # compiled kernels read GPU memory only: say so now, not at the first step
                raise KvshareError(f"the triton kernels run on a GPU (--device cuda); this engine runs on "
                                   f"{torch.device(device)}")
        self.choice = choice
        self.paged_attention = _IMPLEMENTATIONS[("paged_attention", choice["paged_attention"])]
        self.write_kv = _IMPLEMENTATIONS[("write_kv", choice["write_kv"])]
        self.gathered_lora = _IMPLEMENTATIONS[("gathered_lora", choice["gathered_lora"])]
        self.linear = _IMPLEMENTATIONS[("linear", choice["linear"])]
        self.residual_attention = _IMPLEMENTATIONS[("residual_attention", choice["residual_attention"])]
        self.pointwise = _IMPLEMENTATIONS[("pointwise", choice["pointwise"])]
