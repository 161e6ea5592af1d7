"""The tied head in int8 groups of 32 (Q8_0's precision): quantisation bounds, the C++ kernel
against its dequantised reference, and the int4 engine that takes it."""

from __future__ import annotations

import pytest
import torch

from kvshare.kernels.q8 import (Q8_GROUP, Q8Weight, q8_fits, q8_head_available, q8_linear, q8_linear_reference,
                                prepare_tied_head, quantize_q8)
from kvshare.serve import LLM

from test_engine import base  # noqa: F401

needs_kernel = pytest.mark.skipif(not q8_head_available(), reason="the C++ kernels have no AVX512 here")


def _weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) / k ** 0.5


def test_quantisation_is_within_half_a_step_of_each_group():
    w = _weight(48, 96)
    w[3, :32] = 0  # an all-zero group stays zero
    q8 = quantize_q8(w)
    assert q8.packed.dtype == torch.int8 and q8.packed.shape == (3, 96, 16)
    assert q8.scales.dtype == torch.float32 and q8.scales.shape == (3, 3, 16)
    back = q8.dequantize()
    step = w.reshape(48, 3, Q8_GROUP).abs().amax(-1, keepdim=True) / 127
    assert ((back - w).reshape(48, 3, Q8_GROUP).abs() <= step / 2 + 1e-7).all()
    assert (back[3, :32] == 0).all()
    assert q8.nbytes == 48 * 96 + 48 * 3 * 4


def test_shapes_that_do_not_pack_stay_float():
    assert q8_fits(_weight(32, 64)) and q8_fits(_weight(32, 64).bfloat16())
    assert not q8_fits(_weight(40, 64))  # outputs not blocks of 16
    assert not q8_fits(_weight(32, 48))  # inputs not groups of 32
    w = _weight(40, 64)
    assert prepare_tied_head(w) is w


@needs_kernel
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 4, 5, 16, 33])
@pytest.mark.parametrize("n,k", [(16, 32), (48, 96), (1024, 576)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_kernel_equals_the_dequantised_reference(rows, n, k, dtype, with_bias):
    g = torch.Generator().manual_seed(rows * 1000 + n + k)
    q8 = quantize_q8(torch.randn(n, k, generator=g) / k ** 0.5)
    x = torch.randn(rows, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype) if with_bias else None
    got, want = q8_linear(x, q8, bias), q8_linear_reference(x, q8, bias)
    assert got.dtype == dtype and got.shape == (rows, n)
    # float32 sums in another order, then one rounding to the input's dtype
    step = 2 ** -7 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=step * (float(want.abs().max()) if want.numel() else 1.0) + 1e-4)


@needs_kernel
def test_leading_dims_and_a_strided_input_keep_their_shape():
    q8 = quantize_q8(_weight(32, 64))
    x = torch.randn(3, 2, 128)[..., ::2]  # not contiguous
    got = q8_linear(x, q8)
    assert got.shape == (3, 2, 32)
    torch.testing.assert_close(got, q8_linear_reference(x, q8), rtol=0, atol=1e-5)


@needs_kernel
def test_a_wrong_weight_is_refused():
    q8 = quantize_q8(_weight(32, 64))
    with pytest.raises(RuntimeError, match="input size"):
        q8_linear(torch.randn(1, 32), q8)


@needs_kernel
def test_the_int4_engine_gives_a_tied_head_int8_groups_and_keeps_the_embedding(base):
    llm = LLM(base, [], kernels="int4", kv_cache_tokens=256, block_size=4)
    model = llm.engine.runner.model
    assert isinstance(model.lm_head, Q8Weight) and model.embed.dtype == torch.float32
    torch.testing.assert_close(model.lm_head.dequantize(), model.embed, rtol=0,
                               atol=float(model.embed.abs().max()) / 254 + 1e-7)
    # the int8 backend keeps the tied head as the embedding itself
    int8 = LLM(base, [], kernels="int8", kv_cache_tokens=256, block_size=4).engine.runner.model
    assert int8.lm_head is int8.embed
