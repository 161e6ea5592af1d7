"""bfloat16 projections of decode rows in AVX512-BF16 dot products (:file:`linear_vnni.cpp`),
as the torch op ``kvshare::linear_vnni`` (defined in C++) that the compiled CPU step calls.

Why our own: Inductor's C++ GEMM template has no bfloat16 dot-product micro-kernel; without AMX
it widens each weight to float32 for FMAs, which is compute-bound at a few rows. Measured on
2 AMD EPYC cores, SmolLM2's 30 layers of projections, template time over dot-product time in one
run: 1.89x at 1 row, 2.09x at 2, 2.47x at 4, 1.12x at 8, 1.05x at 16; ``F.linear`` was slower
than the kernel at every size (results/engine-cpu-bf16/session21/projections.txt). Where the CPU has AMX the
template multiplies on tiles, so it keeps the projections there (:func:`wanted`): measured on 2
vCPUs of an AMX Xeon, template over dot products 0.91x at 1 row, 0.83x at 2-4, 0.43x at 16
(results/engine-cpu-bf16/session30-spr/projections.txt).
"""

from __future__ import annotations

import functools
import os

import torch

from ...errors import KvshareError
from . import extension

CHOICES = ("auto", "vnni", "inductor", "onednn")  # float32 graphs: :func:`kvshare.serve.exec.compiled.packs_float32`
MAX_ROWS = 16  # decode buckets; a larger bucket (a prompt chunk beside decode rows) keeps the GEMM template
AMX_HEAD_ROWS = 6  # where oneDNN multiplies on AMX tiles, the head's rows the kernel still beats it at


def wanted() -> bool:
    """Whether the compiled step's projections run in dot products: ``KVSHARE_CPU_GEMM`` =
    ``vnni`` asks for it (an error where the CPU lacks AVX512-BF16), ``inductor`` keeps the GEMM
    template, ``auto`` (the default) takes dot products on CPUs with AVX512-BF16 and no AMX."""
    choice = _choice()
    if choice == "vnni" or (choice == "auto" and not torch.cpu._is_amx_tile_supported()):
        register()  # before a graph that calls the op is traced or loaded from the cache
        return True
    return False


def head_wanted() -> bool:
    """Whether the head, which the compiled step applies after its graph to the few rows sampled
    from, runs in dot products (up to :func:`head_rows` rows): wherever the kernel runs, AMX or
    not, unless ``KVSHARE_CPU_GEMM=inductor``. Outside a graph the alternative is ``F.linear``:
    2.78 against 0.61 ms for SmolLM2's head at one row on AMD EPYC
    (results/engine-cpu-bf16/session22/head.txt), 2.02 against 1.15 ms on an AMX Xeon."""
    if _choice() is None:
        return False
    register()
    return True


def head_rows() -> int:
    """Rows up to which the head runs in dot products. Without AMX, every decode bucket (the
    kernel was faster than ``F.linear`` at 1-16 rows on AMD EPYC); with AMX, oneDNN's tiles win
    from 8 rows on: SmolLM2's head 2.22 against 2.37 ms at 8 rows, 2.10 against 4.27 at 16, and
    2.18 against 1.89 at 6 (results/engine-cpu-bf16/session30-spr/head_rows.txt)."""
    return AMX_HEAD_ROWS if torch.cpu._is_amx_tile_supported() else MAX_ROWS


def _choice() -> str | None:
    """``KVSHARE_CPU_GEMM`` checked against this machine; None where the kernel does not run here
    (or ``inductor`` or ``onednn`` declines it)."""
    choice = gemm_choice()
    if choice in ("inductor", "onednn"):
        return None
    ext = extension()
    able = ext is not None and ext.linear_vnni_available()
    if choice == "vnni" and not able:
        raise KvshareError("KVSHARE_CPU_GEMM=vnni needs a CPU with AVX512-BF16 and the C++ kernels built")
    return choice if able else None


def gemm_choice() -> str:
    """``KVSHARE_CPU_GEMM`` (default ``auto``), checked against :data:`CHOICES`."""
    choice = os.environ.get("KVSHARE_CPU_GEMM", "auto")
    if choice not in CHOICES:
        raise KvshareError(f"KVSHARE_CPU_GEMM must be one of {', '.join(CHOICES)}, not {choice!r}")
    return choice


def packable(weight) -> bool:
    """A plain bfloat16 weight the kernel takes: 16-output blocks over pairs of input dims."""
    return (isinstance(weight, torch.Tensor) and weight.dtype == torch.bfloat16 and weight.dim() == 2
            and weight.shape[0] % 16 == 0 and weight.shape[1] % 2 == 0)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [N, K] in the kernel's order, [N/16, K/2, 16, 2] (a copy, made once)."""
    return extension().linear_vnni_pack(weight)


def linear_vnni(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``packed = pack(weight)``, rounded to bfloat16 once."""
    register()
    return torch.ops.kvshare.linear_vnni(x, packed, bias)


def linear_vnni_lora(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, a: list[torch.Tensor],
                     b_t: list[torch.Tensor], offsets: list[int], index: torch.Tensor,
                     scale: torch.Tensor) -> torch.Tensor:
    """:func:`linear_vnni` plus each row's LoRA delta in the same pass: output columns
    ``offsets[p]`` on (``b_t[p].shape[-1]`` of them, multiples of 16) get ``scale[row] * (x
    A_p^T) B_p^T`` with the row's slot ``index[row]`` of ``a[p]`` [slots, rank, in] and ``b_t[p]``
    [slots, rank, out] (the slot stacks of :mod:`kvshare.serve.exec.lora_slots`); rows of scale 0 get
    none. The delta is added in float32 before the one rounding to bfloat16."""
    register()
    return torch.ops.kvshare.linear_vnni_lora(x, packed, bias, a, b_t, offsets, index, scale)


def _output_like(x: torch.Tensor, packed: torch.Tensor, *_) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], packed.shape[0] * packed.shape[2])


@functools.cache
def register() -> None:
    """Load the extension, which defines the ops ``kvshare::linear_vnni`` and
    ``kvshare::linear_vnni_lora`` in C++, and give them their fake (shape) functions for tracing,
    once per process."""
    if extension() is None:
        raise KvshareError("the C++ CPU kernels could not be built here")
    for op in ("kvshare::linear_vnni", "kvshare::linear_vnni_lora"):
        torch.library.register_fake(op)(_output_like)
