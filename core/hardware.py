"""Whether this CPU computes bfloat16 natively, and a warning where it does not.

bfloat16 halves the bytes read per weight, so on CPUs with bf16 instructions (AVX512-BF16,
AMX) it is about twice as fast as float32. On AVX2-only CPUs torch falls back to a generic
GEMM: measured on an AVX2 AMD EPYC (torch 2.13, 2 threads), a 1024x576x1536 matmul ran at
1.2-21 GFLOP/s in bfloat16 against 128-147 in float32. Users who copy a bf16 recipe or
``--dtype bfloat16`` to such a machine should hear about it before waiting hours.
"""

from __future__ import annotations

import functools
import warnings

import torch


@functools.cache
def cpu_has_fast_bf16() -> bool:
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a torch build without oneDNN: assume the slow path
        return False


def bf16_is_fast() -> bool:
    """bfloat16 pays off here: a CUDA device, or a CPU with bf16 instructions."""
    return torch.cuda.is_available() or cpu_has_fast_bf16()


def resolve_mixed_precision(setting: str, on_gpu: bool | None = None) -> str:
    """A recipe's ``mixed_precision`` as accelerate takes it: ``auto`` becomes ``bf16`` where
    bfloat16 is fast on the device that trains (``on_gpu``; default: whether CUDA is there)
    and ``no`` elsewhere, so one recipe trains at full speed on either machine. A GPU without
    bfloat16 (V100, T4) and a CPU run on a GPU host (accelerate's ``use_cpu``) get ``no``."""
    if setting != "auto":
        return setting
    on_gpu = torch.cuda.is_available() if on_gpu is None else on_gpu
    fast = torch.cuda.is_bf16_supported() if on_gpu else cpu_has_fast_bf16()
    return "bf16" if fast else "no"


def warn_if_bf16_is_slow(what: str) -> None:
    """Warn (once per call site's message) when bfloat16 would run on a CPU without bf16 support."""
    if not bf16_is_fast():
        warnings.warn(f"{what}: this CPU has no bfloat16 instructions ({torch.backends.cpu.get_cpu_capability()}); "
                      "bfloat16 matmuls fall back to a slow path here, typically several times slower than "
                      "float32. Use float32 on this machine.", RuntimeWarning, stacklevel=3)
