"""The fused C++ pointwise parts (kernels/cpu/pointwise.cpp) against the torch reference, and
the eager engine with them against the engine with the reference."""

from __future__ import annotations

import pytest
import torch

from kvshare.kernels import Kernels, cpu
from kvshare.kernels.cpu.pointwise import CpuPointwise
from kvshare.kernels.pointwise import TorchPointwise
from kvshare.serve import LLM, SamplingParams

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module", autouse=True)
def built():
    assert cpu.extension() is not None  # built (or loaded) now, not in the background mid-test


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """float32 to the last bits of a reordered sum; bfloat16 to a rounding step in each of two roundings."""
    assert got.shape == want.shape and got.dtype == want.dtype
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2 ** -6, "atol": 1e-3}
    torch.testing.assert_close(got, want, **tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_norms_match_the_reference(dtype):
    gen = torch.Generator().manual_seed(0)
    h = (torch.randn(37, 576, generator=gen) * 3).to(dtype)
    delta = torch.randn(37, 576, generator=gen).to(dtype)
    weight = (torch.rand(576, generator=gen) + 0.5).to(dtype)
    _close(CpuPointwise.rms_norm(h, weight, 1e-5), TorchPointwise.rms_norm(h, weight, 1e-5), dtype)
    got_sum, got_norm = CpuPointwise.add_rms_norm(h, delta, weight, 1e-6)
    want_sum, want_norm = TorchPointwise.add_rms_norm(h, delta, weight, 1e-6)
    assert torch.equal(got_sum, want_sum)  # one rounded add: exact
    _close(got_norm, want_norm, dtype)
    heads = torch.randn(37, 3 * 64 + 8, generator=gen).to(dtype)[:, 8:].reshape(37, 3, 64)  # q_norm's strided heads
    head_weight = (torch.rand(64, generator=gen) + 0.5).to(dtype)
    _close(CpuPointwise.rms_norm(heads, head_weight, 1e-6), TorchPointwise.rms_norm(heads, head_weight, 1e-6), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_and_the_gated_activation_match_the_reference(dtype):
    gen = torch.Generator().manual_seed(1)
    rows, n_q, n_kv, d = 29, 9, 3, 64
    qkv = torch.randn(rows, (n_q + 2 * n_kv) * d, generator=gen).to(dtype)
    q, k, _ = torch.split(qkv, [n_q * d, n_kv * d, n_kv * d], dim=-1)  # views with the fused row stride
    q, k = q.reshape(rows, n_q, d), k.reshape(rows, n_kv, d)
    angle = torch.rand(rows, 1, d, generator=gen) * 6
    cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    for got, want in zip(CpuPointwise.rope(q, k, cos, sin), TorchPointwise.rope(q, k, cos, sin)):
        if dtype == torch.bfloat16:  # every product rounded as PyTorch rounds it: exact
            assert torch.equal(got, want)
        else:  # float32 sums may fuse into one FMA (one rounding fewer)
            _close(got, want, dtype)
    gate_up = (torch.randn(rows, 2 * 1536, generator=gen) * 4).to(dtype)
    _close(CpuPointwise.silu_mul(gate_up, 1536), TorchPointwise.silu_mul(gate_up, 1536), dtype)


def test_what_the_kernels_do_not_take_runs_on_the_reference():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(8, 64, generator=gen, dtype=torch.float16)
    weight = torch.rand(64, generator=gen, dtype=torch.float16)
    assert torch.equal(CpuPointwise.rms_norm(x, weight, 1e-6), TorchPointwise.rms_norm(x, weight, 1e-6))
    mixed = torch.rand(64, generator=gen)  # a float32 weight beside float16 rows
    assert torch.equal(CpuPointwise.rms_norm(x, mixed, 1e-6), TorchPointwise.rms_norm(x, mixed, 1e-6))
    h = torch.randn(64, 8, generator=gen).t()  # not contiguous
    assert torch.equal(CpuPointwise.add_rms_norm(h, h, torch.ones(64), 1e-6)[1],
                       TorchPointwise.add_rms_norm(h, h, torch.ones(64), 1e-6)[1])


def test_the_cpu_backend_chooses_the_fused_parts():
    assert Kernels("auto").pointwise is CpuPointwise
    assert Kernels("torch").pointwise is TorchPointwise
    assert Kernels("auto", "cuda").pointwise is TorchPointwise


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_eager_engine_generates_as_with_the_reference(tiny_models, dtype):
    """Greedy tokens through whole prompts (prompt chunks and decode rows) agree."""
    base = tiny_models("llama")
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22], [30, 31, 32]]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    outputs = {}
    for kernels in ("cpu", "torch"):
        llm = LLM(base, kv_cache_tokens=256, block_size=4, kernels=kernels, dtype=dtype, compile="off")
        outputs[kernels] = [out.token_ids for out in llm.generate(prompts, params)]
    assert outputs["cpu"] == outputs["torch"]
