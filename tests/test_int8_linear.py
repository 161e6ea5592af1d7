"""Weight-only int8 ("linear" backend "int8"): the quantisation, the kernel's math against the
dequantised float product, its error against the float weights, and an engine on it where the
base is int8 and the adapters stay float and exact."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvshare.kernels import Kernels
from kvshare.kernels.quant import EXPAND_ROWS, QMAX, Int8Weight, Int8WeightOnlyLinear, quantize_per_channel
from kvshare.serve import LLM, SamplingParams

from conftest import assert_one_line_error
from test_engine import adapters, base, invocation, prompts_for, tokenizer  # noqa: F401

PATHS = [False] + ([True] if hasattr(torch, "_weight_int8pack_mm") else [])  # dequantise / packed kernel


def random_weight(out: int = 96, inp: int = 80, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(out, inp, generator=gen) * torch.rand(out, 1, generator=gen)  # rows of different ranges
    w[3] = 0.0  # an all-zero row must not divide by zero
    return w.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantisation_round_trip_is_within_half_a_step_per_channel(dtype):
    w = random_weight(dtype=dtype)
    qw = quantize_per_channel(w)
    assert qw.q.dtype == torch.int8 and qw.scale.dtype == dtype and qw.scale.shape == (w.shape[0],)
    err = (w.float() - qw.q.float() * qw.scale.float()[:, None]).abs().amax(dim=1)
    # round to nearest: at most half a step per row (+ float32 rounding of the division)
    assert torch.all(err <= qw.scale.float() / 2 * (1 + 1e-5)), (err / qw.scale.float()).max()
    nonzero = w.float().abs().amax(dim=1) > 0
    assert torch.all(qw.q.abs().amax(dim=1)[nonzero] >= QMAX - 1)  # each row uses the full range
    assert torch.all(qw.q[3] == 0)
    assert qw.nbytes == w.numel() + w.shape[0] * w.element_size()  # 1 byte per weight + one scale per row


@pytest.mark.parametrize("packed", PATHS, ids=lambda p: "packed" if p else "dequantise")
@pytest.mark.parametrize("rows", [1, 2, 17])
def test_apply_is_exactly_the_dequantised_product(packed, rows):
    w, gen = random_weight(), torch.Generator().manual_seed(1)
    b = torch.randn(w.shape[0], generator=gen)
    qw = quantize_per_channel(w)
    qw = Int8Weight(qw.q, qw.scale, packed_kernel=packed)
    x = torch.randn(rows, w.shape[1], generator=gen)
    want = F.linear(x.double(), qw.dequantize().double(), b.double())
    got = Int8WeightOnlyLinear.apply(x, qw, b)
    assert got.dtype == torch.float32 and got.shape == (rows, w.shape[0])
    # the same products in another order: float32 summation noise only
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("packed", PATHS, ids=lambda p: "packed" if p else "dequantise")
def test_apply_in_bfloat16_is_the_dequantised_product_up_to_bfloat16_rounding(packed):
    w = random_weight(dtype=torch.bfloat16)
    qw = quantize_per_channel(w)
    qw = Int8Weight(qw.q, qw.scale, packed_kernel=packed)
    x = torch.randn(5, w.shape[1], generator=torch.Generator().manual_seed(2)).bfloat16()
    got = Int8WeightOnlyLinear.apply(x, qw)
    assert got.dtype == torch.bfloat16
    want = F.linear(x.double(), qw.dequantize().double())
    # bfloat16 has an 8-bit significand: the output's own rounding plus the dot product's
    torch.testing.assert_close(got.double(), want, atol=0.05, rtol=2 ** -6)


@pytest.mark.skipif(not hasattr(torch, "_weight_int8pack_mm"), reason="no packed int8 kernel in this torch")
def test_the_packed_kernel_is_kept_to_inputs_it_handles():
    """PyTorch's kernel steps 8/16 along K with aligned loads: other K silently gives wrong
    numbers and a misaligned activation crashes, so the backend guards both."""
    odd = quantize_per_channel(random_weight(inp=20, dtype=torch.bfloat16))
    assert not odd.packed_kernel  # K = 20: dequantise-and-matmul
    x = torch.randn(3, 20, generator=torch.Generator().manual_seed(4)).bfloat16()
    torch.testing.assert_close(Int8WeightOnlyLinear.apply(x, odd).double(),
                               F.linear(x.double(), odd.dequantize().double()), atol=0.05, rtol=2 ** -6)
    qw = quantize_per_channel(random_weight(dtype=torch.bfloat16))
    assert qw.packed_kernel  # bfloat16, K = 80
    flat = torch.randn(3 * 80 + 1, generator=torch.Generator().manual_seed(5)).bfloat16()
    view = flat[1:].view(3, 80)  # contiguous, but 2 bytes past an aligned address
    assert view.data_ptr() % 16
    torch.testing.assert_close(Int8WeightOnlyLinear.apply(view, qw).double(),
                               F.linear(view.double(), qw.dequantize().double()), atol=0.05, rtol=2 ** -6)


@pytest.mark.skipif(not hasattr(torch, "_weight_int8pack_mm"), reason="no packed int8 kernel in this torch")
def test_chunks_expand_the_weight_and_decode_rows_take_the_packed_kernel(monkeypatch):
    """The packed kernel's cost grows with the rows; from EXPAND_ROWS rows on the weight is
    expanded for the dense GEMM (kernels/quant.py). Both give the dequantised product."""
    calls, kernel = [], torch._weight_int8pack_mm
    monkeypatch.setattr(torch, "_weight_int8pack_mm", lambda *a: calls.append(a) or kernel(*a))
    qw = quantize_per_channel(random_weight(dtype=torch.bfloat16))
    assert qw.packed_kernel
    for rows, kernel_calls in ((EXPAND_ROWS - 1, 1), (EXPAND_ROWS, 0), (4 * EXPAND_ROWS, 0)):
        calls.clear()
        x = torch.randn(rows, 80, generator=torch.Generator().manual_seed(rows)).bfloat16()
        torch.testing.assert_close(Int8WeightOnlyLinear.apply(x, qw).double(),
                                   F.linear(x.double(), qw.dequantize().double()), atol=0.05, rtol=2 ** -6)
        assert len(calls) == kernel_calls


def test_error_against_the_float_weights_is_within_the_rounding_bound():
    w, gen = random_weight(out=256, inp=576), torch.Generator().manual_seed(3)
    x = torch.randn(8, 576, generator=gen)
    qw = quantize_per_channel(w)
    err = (Int8WeightOnlyLinear.apply(x, qw) - F.linear(x, w)).abs()
    # each weight is off by at most s_i/2, so output i is off by at most s_i/2 * sum_j |x_j|
    bound = qw.scale[None, :] / 2 * x.abs().sum(dim=1, keepdim=True)
    assert torch.all(err <= bound * (1 + 1e-4) + 1e-5)
    # and typically far less: rounding errors are about uniform in +-s/2 and cancel, so the
    # relative error of the output is about max|w|/(127*sqrt(12)*std(w)) (< 1% for Gaussian rows)
    rows = w.abs().amax(dim=1) > 0
    ref = F.linear(x, w)[:, rows]
    rel = (Int8WeightOnlyLinear.apply(x, qw)[:, rows] - ref).norm() / ref.norm()
    assert 1e-4 < rel < 0.02, rel  # not zero either: the weights really were quantised


def test_other_dtypes_take_the_reference():
    w = random_weight().half()
    assert Int8WeightOnlyLinear.prepare(w) is w
    x = torch.randn(2, w.shape[1]).half()
    torch.testing.assert_close(Int8WeightOnlyLinear.apply(x, w), F.linear(x, w))


def test_the_backend_is_offered_for_linear_only():
    assert Kernels("int8").choice == {"paged_attention": "torch", "write_kv": "torch", "gathered_lora": "torch",
                                      "linear": "int8", "residual_attention": "torch", "pointwise": "torch"}


def _model(llm):
    return llm.engine.model


def test_engine_quantises_the_base_projections_and_nothing_else(tiny_models, base, adapters):
    llm = LLM(base, list(adapters.values()), kv_cache_tokens=256, block_size=4, kernels="int8")
    model = _model(llm)
    for layer in model.layers:
        for name in ("qkv", "o", "gate_up", "down"):
            assert isinstance(layer[name], Int8Weight), name
    # tied head: the embedding itself, in float (an int8 copy would add memory, not save it)
    assert model.lm_head is model.embed and model.embed.dtype == torch.float32
    for adapter in llm.engine._adapters.slots:
        for a, b, _ in adapter.weights.values():
            assert a.dtype == b.dtype == torch.float32  # LoRA weights are never quantised
    untied = _model(LLM(tiny_models("llama", tied=False), kv_cache_tokens=256, kernels="int8"))
    assert isinstance(untied.lm_head, Int8Weight)  # its own head: int8 saves its bytes


@pytest.mark.parametrize("name", [None, "lora-a", "icarus-a"])
def test_int8_engine_equals_a_float_engine_on_the_dequantised_base(base, adapters, tokenizer, name):
    """Everything but the base's projections is exact: the int8 engine scores and generates
    like the float engine whose projection weights were replaced by their dequantised values,
    with the same float adapter (so the adapter delta is added in float, unquantised)."""
    settings = dict(kv_cache_tokens=512, block_size=4)
    quant = LLM(base, list(adapters.values()), kernels="int8", **settings)
    ref = LLM(base, list(adapters.values()), **settings)
    for q_layer, r_layer in zip(_model(quant).layers, _model(ref).layers):
        for part in ("qkv", "o", "gate_up", "down"):
            r_layer[part] = q_layer[part].dequantize()
    prompt = sum(prompts_for(tokenizer, 2), [])
    score = SamplingParams(max_tokens=1, prompt_logprobs=0)
    got, want = (llm.generate([prompt], score, adapter=name)[0].prompt_logprobs[1:] for llm in (quant, ref))
    assert [g["logprob"] for g in got] == pytest.approx([w["logprob"] for w in want], abs=1e-4)
    if name is not None:  # the adapter really changes the output, so the check above covers its delta
        plain = quant.generate([prompt], score)[0].prompt_logprobs[1:]
        assert max(abs(g["logprob"] - p["logprob"]) for g, p in zip(got, plain)) > 1e-2
    out = quant.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True), adapter=name)[0]
    assert len(out.token_ids) == 12


def test_bench_quant_reports_quality_speed_and_memory(cli, tiny_models, tmp_path, monkeypatch):
    """The benchmark end to end on the tiny model (figures printed, not asserted; what must
    hold whatever the speed is asserted)."""
    import json

    data = tmp_path / "data"
    (data / "hotpotqa").mkdir(parents=True)
    sentence = "The river runs past the old mill and the town hall before it reaches the sea. "
    records = [{"_id": str(i), "question": f"Which river runs past mill number {i}?",
                "context": [[f"Title {i}", [sentence * 2, sentence]]]} for i in range(4)]
    (data / "hotpotqa" / "dev_hard_500.jsonl").write_text("\n".join(json.dumps(r) for r in records))
    monkeypatch.setenv("KVSHARE_DATA", str(data))
    out = tmp_path / "out"
    result = cli("bench", "quant", "--model", tiny_models("llama"), "--prompts", "2", "--new-tokens", "4",
                 "--paragraphs", "2", "--prefill-tokens", "32", "--out", out)
    assert result.code == 0, result.err
    report = json.loads((out / "quant_bench.json").read_text())
    assert report["prompts"] == 2 and report["perplexity_paragraphs"] == 2
    assert report["weight_bytes"]["int8"] < report["weight_bytes"]["torch"]
    g = report["greedy"]["int8"]
    assert 0 <= g["identical_tokens"] <= 1 and 0 <= g["teacher_forced_top1"] <= 1
    assert all(0 <= f <= 4 for f in g["first_divergence"]) and len(g["first_divergence"]) == 2
    assert all(p > 1 for p in report["perplexity"].values())
    assert all(r["decode_b1"] > 0 and r["prefill_32"] > 0 for r in report["speed"].values())
    assert "perplexity" in (out / "quant_bench.md").read_text() and "perplexity" in result.out
    bad = cli("bench", "quant", "--model", tiny_models("llama"), "--prompts", "0")
    assert_one_line_error(bad, "prompts must be at least 1")


@pytest.mark.parametrize("name", [None, "lora-a", "icarus-a"])
def test_bfloat16_int8_engine_runs_on_the_packed_kernel(base, adapters, tokenizer, name):
    """bfloat16 engines take PyTorch's packed int8 kernel and score like the bfloat16 float
    engine on the dequantised base within bfloat16 rounding (0.03 seen; a sanity bound: the
    exact check is the float32 test above, 2e-6 seen against 0.03 for unquantised weights)."""
    settings = dict(kv_cache_tokens=512, block_size=4, dtype="bfloat16")
    quant = LLM(base, list(adapters.values()), kernels="int8", **settings)
    ref = LLM(base, list(adapters.values()), **settings)
    for q_layer, r_layer in zip(_model(quant).layers, _model(ref).layers):
        for part in ("qkv", "o", "gate_up", "down"):
            assert q_layer[part].packed_kernel == hasattr(torch, "_weight_int8pack_mm")
            r_layer[part] = q_layer[part].dequantize()
    prompt = sum(prompts_for(tokenizer, 2), [])
    score = SamplingParams(max_tokens=1, prompt_logprobs=0)
    got, want = (llm.generate([prompt], score, adapter=name)[0].prompt_logprobs[1:] for llm in (quant, ref))
    assert [g["logprob"] for g in got] == pytest.approx([w["logprob"] for w in want], abs=0.1)
    out = quant.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True), adapter=name)[0]
    assert len(out.token_ids) == 8
