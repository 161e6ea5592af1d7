"""Kernel references against the plainest possible formulation, over random layouts."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from kvshare.errors import KvshareError
from kvshare.kernels import Kernels, build_attention_metadata
from kvshare.kernels.lora import lora_groups

REF = Kernels("torch")


def dense_causal(q, k, v, positions, scale):
    """softmax(q k^T) v with keys 0..position per row, GQA by repeating heads."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("rhd,thd->rht", q, k) * scale
    allowed = torch.arange(k.shape[0])[None, None, :] <= positions[:, None, None]
    probs = torch.softmax(scores.masked_fill(~allowed, -math.inf), dim=-1)
    return torch.einsum("rht,thd->rhd", probs, v)


@pytest.mark.parametrize("seed", range(5))
def test_paged_attention_equals_dense_attention(seed):
    gen = torch.Generator().manual_seed(seed)
    block_size, n_blocks, n_q, n_kv, d = 4, 32, 6, 2, 8
    k_cache = torch.randn(n_blocks, block_size, n_kv, d, generator=gen)
    v_cache = torch.randn(n_blocks, block_size, n_kv, d, generator=gen)
    free = torch.randperm(n_blocks, generator=gen).tolist()
    tables, rows_seq, rows_pos, dense = [], [], [], []
    for s, length in enumerate([5, 11, 1]):
        table = [free.pop() for _ in range((length + block_size - 1) // block_size)]
        tables.append(table)
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(length)])
        keys = k_cache.view(-1, n_kv, d)[slots]
        values = v_cache.view(-1, n_kv, d)[slots]
        # a prefill (from 0, or a later chunk) for the first sequence, decode rows (one or an
        # ICaRus pair) for the others
        positions = {0: [0, 1, 2, 3, 4] if seed % 2 else [2, 3, 4], 1: [10, 10], 2: [0]}[s]
        rows_seq += [s] * len(positions)
        rows_pos += positions
        dense.append((keys, values, torch.tensor(positions)))
    q = torch.randn(len(rows_seq), n_q, d, generator=gen)
    writes = [-1] * len(rows_pos)
    meta = build_attention_metadata(rows_seq, rows_pos, writes, tables, block_size)
    got = REF.paged_attention(q, k_cache, v_cache, meta, d ** -0.5)
    start = 0
    for keys, values, positions in dense:
        end = start + len(positions)
        want = dense_causal(q[start:end], keys, values, positions, d ** -0.5)
        torch.testing.assert_close(got[start:end], want, atol=1e-5, rtol=1e-5)
        start = end


def test_write_kv_skips_read_only_rows():
    k_cache, v_cache = torch.zeros(2, 4, 1, 2), torch.zeros(2, 4, 1, 2)
    k = torch.arange(6.0).view(3, 1, 2)
    REF.write_kv(k_cache, v_cache, k, -k, torch.tensor([5, -1, 0]))
    flat = k_cache.view(-1, 1, 2)
    assert torch.equal(flat[5], k[0]) and torch.equal(flat[0], k[2])
    assert flat[[1, 2, 3, 4, 6, 7]].abs().sum() == 0


def test_gathered_lora_equals_a_per_row_loop():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, 16, generator=gen)
    base = torch.randn(7, 12, generator=gen)
    weights = [(torch.randn(4, 16, generator=gen), torch.randn(12, 4, generator=gen), 2.0), None,
               (torch.randn(8, 16, generator=gen), torch.randn(12, 8, generator=gen), 0.5)]
    index = torch.tensor([0, -1, 2, 1, 0, 2, -1])
    got = REF.gathered_lora(x, base, lora_groups(index.tolist()), weights)
    for r in range(7):
        slot = int(index[r])
        want = base[r].clone()
        if slot >= 0 and weights[slot] is not None:
            a, b, s = weights[slot]
            want += (b @ (a @ x[r])) * s
        torch.testing.assert_close(got[r], want)
    same = base.clone()
    assert REF.gathered_lora(x, same, lora_groups(index.tolist()), weights, inplace=True) is same  # the engine's way
    torch.testing.assert_close(same, got, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gathered_lora_in_half_precision_rounds_once(dtype):
    """A bfloat16 model: the delta accumulated in float32 and added to the output with one
    rounding (as PEFT), not the delta and the sum each rounded; x A^T in the model's dtype
    (as vLLM)."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, 32, generator=gen).to(dtype)
    base = torch.randn(5, 24, generator=gen).to(dtype)
    a, b = torch.randn(8, 32, generator=gen).to(dtype), (torch.randn(24, 8, generator=gen) / 4).to(dtype)
    index = [0, -1, 0, 0, -1]
    rows = torch.tensor([0, 2, 3])
    want = base.clone()
    t = F.linear(x[rows], a)
    want[rows] = (base[rows].float() + (t.float() @ b.float().T) * 0.5).to(dtype)
    for inplace in (False, True):
        out = base.clone()
        got = REF.gathered_lora(x, out, lora_groups(index), [(a, b, 0.5)], inplace=inplace)
        assert got.dtype == dtype and torch.equal(got, want)
    rounded_each_step = base[rows] + (F.linear(F.linear(x[rows], a), b) * 0.5)
    assert not torch.equal(rounded_each_step, want[rows])  # the old way differs on these numbers


def test_dispatch_refuses_unknown_backends():
    with pytest.raises(KvshareError, match="no 'triton-that-is-not-registered' implementation"):
        Kernels({"paged_attention": "triton-that-is-not-registered"})


def test_each_engine_uses_its_own_kernels(tiny_models):
    """Selection is per engine: two engines in one process, one on a registered backend."""
    from kvshare.kernels import register
    from kvshare.kernels.attention import paged_attention_ref
    from kvshare.serve import LLM, SamplingParams

    calls = []

    def counting(*args, **kwargs):
        calls.append(1)
        return paged_attention_ref(*args, **kwargs)

    register("paged_attention", "counting-test", counting)
    base = tiny_models("llama")
    counted = LLM(base, kv_cache_tokens=256, block_size=4, kernels="counting-test")
    plain = LLM(base, kv_cache_tokens=256, block_size=4)
    assert counted.engine.runner.kernels.choice == {"paged_attention": "counting-test", "write_kv": "torch",
                                                    "gathered_lora": "torch", "linear": "torch",
                                                    "residual_attention": "torch", "pointwise": "torch"}
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    want = plain.generate([[5, 6, 7]], params)[0].token_ids
    assert not calls
    assert counted.generate([[5, 6, 7]], params)[0].token_ids == want
    assert len(calls) == 3 * 2  # 3 steps x 2 layers
    with pytest.raises(KvshareError, match="no kernel backend"):
        LLM(base, kv_cache_tokens=256, kernels="nonexistent-backend")


@pytest.mark.skipif("onednn" not in __import__("kvshare.kernels", fromlist=["backends"]).backends("linear"),
                    reason="this torch build has no oneDNN packed linear")
def test_onednn_linear_equals_the_reference(tiny_models):
    from kvshare.kernels.linear import OneDNNLinear, TorchLinear
    from kvshare.serve import LLM, SamplingParams

    gen = torch.Generator().manual_seed(0)
    w, b = torch.randn(96, 40, generator=gen), torch.randn(96, generator=gen)
    packed = OneDNNLinear.prepare(w)
    for rows in (1, 2, 3, 17):
        x = torch.randn(rows, 40, generator=gen)
        torch.testing.assert_close(OneDNNLinear.apply(x, packed, b), TorchLinear.apply(x, w, b), atol=1e-4, rtol=1e-4)
    # a whole engine on it: the same prompt logprobs as the reference engine, within float32 noise
    base = tiny_models("llama")
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    prompt = [[5, 6, 7, 8, 9, 10, 11, 12]]
    ref = LLM(base, kv_cache_tokens=256, block_size=4).generate(prompt, params)[0].prompt_logprobs[1:]
    fast = LLM(base, kv_cache_tokens=256, block_size=4, kernels="onednn").generate(prompt, params)[0].prompt_logprobs[1:]
    assert [r["logprob"] for r in fast] == pytest.approx([r["logprob"] for r in ref], abs=1e-4)
