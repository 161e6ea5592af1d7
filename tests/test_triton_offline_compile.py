"""The Triton kernels compile for the GPUs we are lent (sm_90: H100, H200) on a machine without
one: Triton's interpreter (the other kernel tests) checks what a kernel computes, not whether
the compiler takes it. Each check runs in its own process: this one's Triton may be the
interpreter (``TRITON_INTERPRET=1``, set by the kernel tests)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.triton

KERNELS = {"_paged_attention_kernel", "_merge_splits_kernel", "_write_kv_kernel", "_fused_kernel", "_shrink_kernel",
           "_expand_kernel", "_parts_kernel", "_linear_lora_kernel", "_residual_attention_kernel"}


def _compiler_env(cache) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(cache)  # a build of its own, not one cached by an earlier run
    return env


def _compile(tmp_path, *args: str) -> list[list[str]]:
    done = subprocess.run([sys.executable, "-m", "kvshare.kernels.triton.offline_compile", *args],
                          env=_compiler_env(tmp_path), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return [line.split(" | ") for line in done.stdout.splitlines()]


def test_every_kernel_compiles_for_sm90_in_the_engines_dtypes(tmp_path):
    builds = _compile(tmp_path, "--arch", "90")
    assert {b[2] for b in builds} == KERNELS
    assert {b[1].rsplit(" ", 1)[1] for b in builds} == {"(bfloat16)", "(float32)"}
    assert all(b[0] == "sm_90" and "registers None" not in b[3] for b in builds)  # cuobjdump read every cubin
    fused = [b for b in builds if b[2] == "_linear_lora_kernel" and "LORA=True" in b[4]]
    assert fused and all("PRECISION=ieee" in b[4] for b in fused if "float32" in b[1])


def test_the_kernels_compile_for_a_large_models_shapes(tmp_path):
    """Llama-8B's: head_dim 128, four query heads a KV head, 4096 features (where the BGMV
    kernels shrink and expand in two launches)."""
    builds = _compile(tmp_path, "--shape", "llama-8b", "--dtype", "bfloat16")
    assert KERNELS - {"_fused_kernel", "_parts_kernel"} <= {b[2] for b in builds}
    assert any("HEAD_DIM=128" in b[4] for b in builds if b[2] == "_paged_attention_kernel")


def test_a_kernel_the_compiler_rejects_fails_the_check(tmp_path):
    """A ``break`` in a kernel's loop: the interpreter runs it as Python, the compiler refuses it."""
    (tmp_path / "bad_kernel.py").write_text(textwrap.dedent("""
        import torch
        import triton
        import triton.language as tl

        from kvshare.kernels.triton.offline_compile import compile_only


        @triton.jit
        def first_positive(x_ptr, y_ptr, n):
            for i in range(n):
                if tl.load(x_ptr + i) > 0:
                    tl.store(y_ptr, i)
                    break


        if __name__ == "__main__":
            with compile_only(90) as built:
                first_positive[(1,)](torch.zeros(8), torch.zeros(1, dtype=torch.int32), 8)
            print("built", [name for name, _ in built])
    """))
    done = subprocess.run([sys.executable, str(tmp_path / "bad_kernel.py")], env=_compiler_env(tmp_path / "cache"),
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode != 0 and "built" not in done.stdout
    assert "unsupported AST node type: Break" in done.stderr, done.stderr[-2000:]
