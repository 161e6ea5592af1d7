"""Compile the Triton kernels for a GPU on a machine without one, and report each build's
registers and local memory (spills).

Why: CI and our own machines have no GPU, and Triton's interpreter checks what a kernel
computes, not whether the compiler takes it; a kernel written without a GPU (the multi-part
BGMV kernel of session 27, the one-launch projection of session 28) would otherwise meet the
compiler only in a lent GPU's few minutes. Compiling needs no GPU: Triton's wheel ships LLVM
and ``ptxas``; only loading a cubin does. So each kernel's own Python wrapper runs here on
small CPU tensors of the engine's shapes and dtypes, and where it would launch, Triton's
warm-up path compiles instead (the signature, constexprs and options a launch would give),
for the architecture asked (default sm_90, the H100/H200 we are lent). Registers and local
memory come from the ``cuobjdump`` Triton ships. What this cannot tell: speed, and whether
the driver of a given GPU loads the cubin.

    python -m kvshare.kernels.triton.offline_compile [--arch 90] [--dtype bfloat16 float32] [--shape llama-8b]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ..shapes import SHAPES, Shape


@dataclass
class Build:
    """One compiled specialization of a kernel."""

    case: str  # the wrapper call that launched it
    kernel: str
    constants: str  # its constexprs, as Triton keyed the build
    registers: int | None  # per thread; None where cuobjdump could not say
    local_bytes: int | None  # local memory per thread: register spills (and stack arrays)
    shared_bytes: int


class _OfflineDriver:
    """What Triton's JIT asks its driver for before compiling: a device, a stream, a target."""

    def __init__(self, target):
        self.target = target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_current_target(self):
        return self.target


def _resources(cubin: bytes) -> tuple[int | None, int | None]:
    """(registers, local bytes) of a cubin's one function, from Triton's cuobjdump."""
    import triton.backends.nvidia as nvidia

    tool = os.path.join(os.path.dirname(nvidia.__file__), "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        try:
            text = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True,
                                  timeout=60).stdout
        except (OSError, subprocess.SubprocessError):
            return None, None
    regs, local = re.search(r"REG:(\d+)", text), re.search(r"LOCAL:(\d+)", text)
    return (int(regs[1]) if regs else None), (int(local[1]) if local else None)


@contextmanager
def compile_only(arch: int) -> Iterator[list[tuple[str, object]]]:
    """Within: Triton launches compile for ``sm_<arch>`` and return, and the wrappers take CPU
    tensors; yields the list of (kernel name, compiled kernel) built so far."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver
    from triton.runtime.jit import KernelInterface

    from . import _common, bgmv, linear_lora
    from .attention import INTERPRETED

    if INTERPRETED:
        raise RuntimeError("unset TRITON_INTERPRET: the interpreter compiles nothing")
    built: list[tuple[str, object]] = []
    touched = []  # kernels whose per-device caches now hold this target's builds
    original = KernelInterface.__getitem__

    def compiling(kernel, grid):
        def build(*args, **kwargs):
            touched.append(kernel)
            built.append((kernel.fn.__name__, kernel.run(*args, grid=grid, warmup=True, **kwargs)))
        return build

    before = (driver._active, _common.compiling_only, bgmv._parts_failed, linear_lora._failed)
    # None here without a GPU (reset_active() would look for one); no fallback remembered from
    # an earlier launch hides a kernel from the compiler
    driver.set_active(_OfflineDriver(GPUTarget("cuda", arch, 32)))
    KernelInterface.__getitem__ = compiling
    _common.compiling_only, bgmv._parts_failed, linear_lora._failed = True, None, None
    try:
        yield built
    finally:
        driver._active, _common.compiling_only, bgmv._parts_failed, linear_lora._failed = before
        KernelInterface.__getitem__ = original
        for kernel in touched:  # a later launch on a real GPU builds for that GPU, not for this target
            kernel.device_caches.clear()


def _attention_cases(shape: Shape, dtype: torch.dtype) -> dict[str, Callable[[], None]]:
    from ..metadata import build_attention_metadata
    from .attention import paged_attention, write_kv

    n_q, n_kv, d, block = shape.q_heads, shape.kv_heads, shape.head_dim, 16
    blocks = torch.arange(64).tolist()

    def batch(rows_per_seq: list[list[int]]):
        row_seq = [s for s, rows in enumerate(rows_per_seq) for _ in rows]
        positions = [p for rows in rows_per_seq for p in rows]
        slots = [-1] * len(row_seq)
        tables = [blocks[:(max(rows) // block) + 1] for rows in rows_per_seq]
        meta = build_attention_metadata(row_seq, positions, slots, tables, block)
        cache = torch.zeros(2, 64, block, n_kv, d, dtype=dtype)
        return torch.zeros(len(row_seq), n_q, d, dtype=dtype), cache, meta

    def decode_split():  # batch 1 over 1k keys, split four ways, then merged
        q, cache, meta = batch([[1000]])
        paged_attention(q, cache[0], cache[1], meta, d ** -0.5, splits=4)

    def decode_table_ahead():  # the variant the GPU sweep times (attention_sweep.py)
        from . import attention

        q, cache, meta = batch([[1000]])
        before, attention._PREFETCH_TABLE = attention._PREFETCH_TABLE, True
        try:
            paged_attention(q, cache[0], cache[1], meta, d ** -0.5, splits=16)
        finally:
            attention._PREFETCH_TABLE = before

    def icarus_pairs():  # two rows a sequence
        q, cache, meta = batch([[300, 300], [20, 20], [5, 5]])
        paged_attention(q, cache[0], cache[1], meta, d ** -0.5)

    def prefill_chunk():
        q, cache, meta = batch([list(range(100, 164))])
        paged_attention(q, cache[0], cache[1], meta, d ** -0.5)

    def kv_write():
        cache = torch.zeros(2, 64, block, n_kv, d, dtype=dtype)
        k = torch.zeros(4, n_kv, d, dtype=dtype)
        write_kv(cache[0], cache[1], k, k.clone(), torch.tensor([3, -1, 40, 17]))

    return {"attention, batch-1 decode split over the keys": decode_split,
            "attention, batch-1 decode, block table a step ahead": decode_table_ahead,
            "attention, ICaRus pairs": icarus_pairs,
            "attention, a prefill chunk": prefill_chunk, "KV write": kv_write}


def _lora_cases(shape: Shape, dtype: torch.dtype) -> dict[str, Callable[[], None]]:
    from ..lora import lora_groups
    from . import bgmv
    from .linear_lora import fits, linear_lora
    from .lora import gathered_lora

    hidden, inter, kv = shape.hidden, shape.intermediate, shape.kv_heads * shape.head_dim
    rank, slots = 16, 8

    def stacks(width: int, features: int = hidden, r: int = rank):
        return torch.zeros(slots, r, features, dtype=dtype), torch.zeros(slots, r, width, dtype=dtype)

    def rows(n: int):
        return torch.zeros(n, dtype=torch.long), torch.ones(n, dtype=torch.float32)

    def bgmv_one_and_two_launches():
        x, y = torch.zeros(2, hidden, dtype=dtype), torch.zeros(2, hidden, dtype=dtype)
        bgmv.bgmv_lora_add(y, x, *stacks(hidden), *rows(2))
        reads, bgmv._FUSED_READS = bgmv._FUSED_READS, 0  # Llama-8B's sizes: shrink, then expand
        try:
            bgmv.bgmv_lora_add(y, x, *stacks(hidden), *rows(2))
        finally:
            bgmv._FUSED_READS = reads

    def bgmv_parts():  # gate/up in one launch
        x, y = torch.zeros(2, hidden, dtype=dtype), torch.zeros(2, 2 * inter, dtype=dtype)
        bgmv.bgmv_lora_add_parts(y, x, [(0, *stacks(inter)), (inter, *stacks(inter))], *rows(2))

    def projection(n: int, parts_widths: list[tuple[int, int]], bias: bool, features: int = hidden, r: int = rank):
        def run():
            out = sum(w for w, _ in parts_widths)
            x, weight = torch.zeros(n, features, dtype=dtype), torch.zeros(out, features, dtype=dtype)
            parts, first = [], 0
            for width, adapted in parts_widths:
                if adapted:
                    parts.append((first, *stacks(width, features, r)))
                first += width
            if not fits(x, weight, parts):
                raise RuntimeError("linear_lora does not take this projection")
            linear_lora(x, weight, torch.zeros(out, dtype=dtype) if bias else None, parts, *rows(n))
        return run

    def segments():
        x, base = torch.zeros(5, hidden, dtype=dtype), torch.zeros(5, hidden, dtype=dtype)
        weights = [(torch.zeros(rank, hidden, dtype=dtype), torch.zeros(hidden, rank, dtype=dtype), 1.0)] * 2
        gathered_lora(x, base, lora_groups([0, -1, 1, 1, 0], "cpu"), weights)

    return {"BGMV, one launch and shrink + expand": bgmv_one_and_two_launches, "BGMV, gate/up parts": bgmv_parts,
            "projection + LoRA, a pair's q/k/v with bias": projection(2, [(hidden, True), (kv, False), (kv, False)],
                                                                       True),
            "projection + LoRA, 16 rows of gate/up": projection(16, [(inter, True), (inter, True)], False),
            "projection + LoRA, 3 rows of down": projection(3, [(hidden, True)], False, inter),
            "projection + LoRA, 1 row of o": projection(1, [(hidden, True)], False),
            "projection + LoRA, 16 rows of o at rank 32 (the most it takes)": projection(
                16, [(hidden, True)], False, r=32),
            "projection + LoRA, q/k/v all adapted": projection(4, [(hidden, True), (kv, True), (kv, True)], True),
            "projection alone, 1 row": projection(1, [(hidden, False)], False),
            "segment LoRA (shrink, expand)": segments}


def _residual_case(shape: Shape, dtype: torch.dtype) -> dict[str, Callable[[], None]]:
    from ..metadata import build_attention_metadata
    from ..residual_attention import build_residual_metadata
    from .residual_attention import residual_attention

    n_q, n_kv, d, rank = shape.q_heads, shape.kv_heads, shape.head_dim, 16

    def run():
        meta = build_attention_metadata([0, 1, 1], [40, 7, 7], [-1, -1, -1], [[0, 1, 2], [3]], 16)
        residual = build_residual_metadata(meta, [[0, 1, 2], [3]], 16, [0, 1])
        cache = torch.zeros(64, 16, n_kv, d, dtype=dtype)
        res = torch.zeros(64, 16, rank, dtype=dtype)
        b = torch.zeros(2, n_kv * d, rank, dtype=dtype)
        rope = torch.zeros(128, d, dtype=torch.float32)
        residual_attention(torch.zeros(3, n_q, d, dtype=dtype), cache, cache, res, res, b, b,
                           torch.ones(2), rope, rope, meta, residual, d ** -0.5)

    return {"ForkKV residual attention": run}


def compile_all(arch: int = 90, dtypes: tuple[str, ...] = ("bfloat16", "float32"),
                shape: str = "smollm2-135m", progress: Callable[[str], None] | None = None) -> list[Build]:
    """Every case's kernels built for ``sm_<arch>`` in each dtype, for one model's shapes
    (:data:`kvshare.kernels.shapes.SHAPES`); raises on the first failure, naming the case."""
    builds: list[Build] = []
    sizes = SHAPES[shape]
    for name in dtypes:
        dtype = getattr(torch, name)
        cases = {**_attention_cases(sizes, dtype), **_lora_cases(sizes, dtype), **_residual_case(sizes, dtype)}
        for case, run in cases.items():
            if progress:
                progress(f"{case} ({name})")
            with compile_only(arch) as built:
                try:
                    run()
                except Exception as err:
                    raise RuntimeError(f"{case} ({name}): {type(err).__name__}: {err}") from err
            for kernel, compiled in built:
                regs, local = _resources(compiled.asm["cubin"])
                constants = ", ".join(f"{k}={v}" for k, v in sorted(_constexprs(compiled).items()))
                builds.append(Build(f"{case} ({name})", kernel, constants, regs, local,
                                    compiled.metadata.shared))
    return builds


def _constexprs(compiled) -> dict[str, object]:
    """The upper-case (tl.constexpr) names the build fixed, from its source's signature."""
    src = compiled.src if hasattr(compiled, "src") else None
    constants = getattr(src, "constants", None) or {}
    names = getattr(getattr(src, "fn", None), "arg_names", [])
    out = {}
    for key, value in constants.items():
        index = key[0] if isinstance(key, tuple) else key
        name = names[index] if isinstance(index, int) and index < len(names) else str(index)
        if name.isupper():
            out[name] = value
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvshare.kernels.triton.offline_compile",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability x10 (90: H100/H200, 80: A100)")
    parser.add_argument("--dtype", nargs="+", default=["bfloat16", "float32"], choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES), help="whose sizes the cases take")
    args = parser.parse_args(argv)
    try:
        builds = compile_all(args.arch, tuple(args.dtype), args.shape,
                             progress=lambda case: print(f"compiling: {case}", file=sys.stderr, flush=True))
    except RuntimeError as err:
        print(f"kvshare: error: {err}", file=sys.stderr)
        return 1
    for b in builds:
        print(f"sm_{args.arch} | {b.case} | {b.kernel} | registers {b.registers}, local {b.local_bytes} B, "
              f"shared {b.shared_bytes} B | {b.constants}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
