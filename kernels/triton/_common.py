"""Small helpers the Triton wrappers share."""

from __future__ import annotations

import torch

from kvshare.errors import KvshareError


def inner_contiguous(t: torch.Tensor) -> torch.Tensor:
    """The kernels index the last dimension with stride 1; copy only when it is not."""
    return t if t.stride(-1) == 1 else t.contiguous()


def dot_precision(dtype: torch.dtype) -> str:
    """float32 inputs: exact float32 products (torch's default matmul), not TF32."""
    return "ieee" if dtype == torch.float32 else "tf32"


compiling_only = False  # set by :mod:`.offline_compile`: CPU tensors only give a launch's types, no launch


def require_gpu_tensor(t: torch.Tensor, interpreted: bool) -> None:
    """Compiled kernels read GPU memory only; say so instead of faulting (e.g. --device cpu
    with --kernels triton on a machine with a GPU). The interpreter takes any tensor."""
    if not interpreted and not compiling_only and t.device.type != "cuda":
        raise KvshareError(f"the triton kernels need tensors on a GPU (--device cuda), not on {t.device}")
