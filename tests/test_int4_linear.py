"""Weight-only int4 ("linear" backend "int4", Q4_1's precision): the quantisation, the kernel's
math against the dequantised float product, the weights it leaves float, an engine on it where
the base is int4 and the adapters stay float and exact, and the compiled step on it."""

from __future__ import annotations

import pytest
import torch

from kvshare.kernels import Kernels
from kvshare.kernels.cpu import extension
from kvshare.kernels.quant import EXPAND_ROWS, INT4_GROUP, Int4Weight, _int4_block_n, int4_fits, quantize_int4
from kvshare.serve import LLM, SamplingParams
from kvshare.serve.exec.compiled import compile_wanted, compiler_blocker

from test_engine import adapters, base, invocation, prompts_for, tokenizer  # noqa: F401

INT4 = Kernels("int4")


def random_weight(out: int = 48, inp: int = 96, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(out, inp, generator=gen) * torch.rand(out, 1, generator=gen) + torch.randn(out, 1, generator=gen)
    w[3, :INT4_GROUP] = 0.5  # a constant group must not divide by zero
    w[4, :INT4_GROUP] = 0.01  # nor lose its value (bfloat16 held 0.01 + 8 as 8.0)
    w[5, :INT4_GROUP] = 2 + 0.1 * torch.rand(INT4_GROUP, generator=gen)  # a mean large against the range
    return w.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantisation_round_trip_is_within_half_a_step_per_group(dtype):
    w = random_weight(dtype=dtype)
    q = quantize_int4(w)
    assert q.packed.dtype == torch.uint8 and q.packed.shape == (48, 48) and q.scales_zeros.shape == (3, 48, 2)
    groups = w.float().reshape(48, 3, INT4_GROUP)
    scale = q.scales_zeros[..., 0].float().T  # (out, groups): the step each group stored
    span = groups.amax(-1) - groups.amin(-1)
    zero = q.scales_zeros[..., 1].float().T
    moved = 0 if dtype == torch.float32 else 2 ** -8 * zero.abs()  # the zero's rounding, spread over 7 levels
    up = 1 + torch.finfo(dtype).eps  # the scale is rounded up to the dtype
    assert ((scale <= (span / 15 + moved / 7) * up + 1e-6) | (span == 0)).all()  # Q4_1's step, or just over
    err = (q.dequantize().float() - w.float()).reshape(48, 3, INT4_GROUP).abs().amax(-1)
    rounding = 0 if dtype == torch.float32 else 2 ** -8 * groups.abs().amax(-1)  # the product, rounded
    assert (err <= torch.where(span > 0, scale / 2, 0) + rounding + 1e-6).all(), (err - scale / 2).max()
    for row in (3, 4):  # constant groups: their value, to the dtype's rounding
        assert torch.equal(q.dequantize()[row, :INT4_GROUP].float(), w[row, :INT4_GROUP].float())


def _count_kernel_calls(monkeypatch) -> list:
    calls, kernel = [], torch._weight_int4pack_mm_for_cpu
    monkeypatch.setattr(torch, "_weight_int4pack_mm_for_cpu", lambda *a: calls.append(a) or kernel(*a))
    return calls


@pytest.mark.parametrize("rows", [1, 5, 2 * EXPAND_ROWS])
def test_apply_is_the_dequantised_product(rows, monkeypatch):
    """Decode rows take PyTorch's int4 kernel; a chunk (EXPAND_ROWS rows or more) expands the
    weight and takes the dense GEMM. Both are the dequantised product."""
    w = random_weight()
    q, qb = INT4.linear.prepare(w), INT4.linear.prepare(w.bfloat16())
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(2, rows, 96, generator=gen)
    bias = torch.randn(48, generator=gen)
    xb = x.bfloat16()
    want, want_b = x @ q.dequantize().T + bias, (xb.float() @ qb.dequantize().float().T).bfloat16()
    assert _int4_block_n()  # probed (with the kernel) before the count starts
    calls = _count_kernel_calls(monkeypatch)
    torch.testing.assert_close(INT4.linear.apply(x, q, bias), want, atol=1e-4, rtol=1e-5)
    # bfloat16 rounds the kernel's partial sums: within 1% of the outputs' size
    torch.testing.assert_close(INT4.linear.apply(xb, qb), want_b, atol=0.01 * float(want_b.float().abs().max()), rtol=0.02)
    assert len(calls) == (2 if 2 * rows < EXPAND_ROWS else 0)


def test_the_packed_layout_is_found_here():
    """Chunks expand only where the packed layout is known; on this suite's machines it must
    be, or the expansion tests below would compare nothing."""
    assert _int4_block_n() in (32, 64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out", [16, 48, 64, 80, 192])  # short blocks, full blocks, both
def test_expansion_equals_the_kernels_own_dequantisation(out, dtype):
    q = quantize_int4(random_weight(out=out, dtype=dtype, seed=out))
    expanded = extension().int4_expand(q.packed, q.scales_zeros, q.group, _int4_block_n())
    assert expanded.shape == (96, out) and expanded.dtype == dtype
    torch.testing.assert_close(expanded, q.dequantize().t(), atol=1e-6, rtol=1e-6)
    with pytest.raises(RuntimeError, match="block_n"):
        extension().int4_expand(q.packed, q.scales_zeros, q.group, 48)


def test_weights_the_kernel_cannot_take_stay_float():
    assert not int4_fits(random_weight(out=40))  # outputs not a multiple of 16
    assert not int4_fits(random_weight(inp=80))  # inputs not a multiple of the group
    w = random_weight(out=40)
    assert INT4.linear.prepare(w) is w


def _model(llm):
    return llm.engine.model


@pytest.mark.parametrize("name", [None, "lora-a", "icarus-a"])
def test_int4_engine_equals_a_float_engine_on_the_dequantised_base(base, adapters, tokenizer, name):
    """The int4 engine scores like the float engine whose projections (and head) were replaced
    by their dequantised values, with the same float adapter: adapters stay exact."""
    settings = dict(kv_cache_tokens=512, block_size=4)
    quant = LLM(base, list(adapters.values()), kernels="int4", **settings)
    ref = LLM(base, list(adapters.values()), **settings)
    quantised = 0
    for q_layer, r_layer in zip(_model(quant).layers, _model(ref).layers):
        for part in ("qkv", "o", "gate_up", "down"):
            if isinstance(q_layer[part], Int4Weight):
                r_layer[part] = q_layer[part].dequantize()
                quantised += 1
    assert quantised >= 4  # the tiny model's shapes fit the kernel for most projections
    if isinstance(_model(quant).lm_head, Int4Weight):
        _model(ref).lm_head = _model(quant).lm_head.dequantize()
    for adapter in quant.engine._adapters.slots:
        for a, b, _ in adapter.weights.values():
            assert a.dtype == b.dtype == torch.float32  # LoRA weights are never quantised
    prompt = sum(prompts_for(tokenizer, 2), [])
    score = SamplingParams(max_tokens=1, prompt_logprobs=0)
    got, want = (llm.generate([prompt], score, adapter=name)[0].prompt_logprobs[1:] for llm in (quant, ref))
    assert [g["logprob"] for g in got] == pytest.approx([w["logprob"] for w in want], abs=1e-4)


@pytest.mark.skipif(compiler_blocker() is not None, reason=str(compiler_blocker()))
def test_compiled_int4_step_scores_as_the_eager_one(base, adapters, tokenizer, monkeypatch):
    """--kernels int4 --dtype bfloat16 --compile on: Inductor's WOQ int4 GEMM reads the packed
    weights; every compiled step of a base / LoRA / ICaRus batch is also run eagerly (ATen's
    int4 kernel) on the same batch: the logits agree within bfloat16 rounding."""
    llm = LLM(base, [adapters["lora-a"], adapters["icarus-a"]], compile="on", dtype="bfloat16", kernels="int4",
              kv_cache_tokens=512, block_size=4)
    runner = llm.engine.runner
    step, pairs = runner.compiled.forward, []

    def both(batch, kv_cache):
        eager = runner.model.forward(batch, kv_cache, llm.engine._adapters.lookup)
        compiled = step(batch, kv_cache)
        pairs.append((compiled, eager))
        return compiled

    monkeypatch.setattr(runner.compiled, "forward", both)
    prompts = prompts_for(tokenizer, 3)
    engine = llm.engine
    for p, n in zip(prompts, [None, "lora-a", "icarus-a"]):
        engine.add_request(p, SamplingParams(max_tokens=5, ignore_eos=True), adapter=n)
    while engine.has_unfinished():
        engine.step()
    assert len(pairs) >= 4
    for got, want in pairs:
        torch.testing.assert_close(got, want, rtol=0, atol=0.05 * float(want.abs().max()))


def test_compile_takes_int4_with_bfloat16_activations(monkeypatch):
    import kvshare.serve.exec.compiled as compiled_module
    from kvshare.errors import KvshareError

    cpu = torch.device("cpu")
    monkeypatch.setenv("KVSHARE_COMPILE", "auto")
    monkeypatch.setattr(compiled_module, "cpu_has_fast_bf16", lambda: True)
    monkeypatch.setattr(compiled_module, "compiler_blocker", lambda: None)  # the rule, wherever the clone lies
    assert compile_wanted("auto", cpu, torch.bfloat16, INT4)
    assert not compile_wanted("auto", cpu, torch.float32, INT4)
    with pytest.raises(KvshareError, match="bfloat16 activations"):
        compile_wanted("on", cpu, torch.float32, INT4)


def test_a_path_with_spaces_turns_the_compiled_step_off_and_says_why(monkeypatch, tmp_path, caplog):
    """torch's Inductor passes its cache's paths to the compiler unquoted: there, auto runs eager
    (said once) and on is refused with the reason, instead of failing at every graph."""
    import kvshare.serve.exec.compiled as compiled_module
    from kvshare.errors import KvshareError

    cpu = torch.device("cpu")
    monkeypatch.setenv("KVSHARE_COMPILE", "auto")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "a cache"))
    assert "spaces" in compiled_module.compiler_blocker()
    with caplog.at_level("WARNING"):
        assert not compile_wanted("auto", cpu, torch.float32, Kernels("torch"))
    assert "compiled CPU step is off" in caplog.text
    with pytest.raises(KvshareError, match="path with spaces"):
        compile_wanted("on", cpu, torch.float32, Kernels("torch"))
