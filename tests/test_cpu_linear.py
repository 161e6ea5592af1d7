"""The AVX512-BF16 projection kernel against its reference, ``F.linear`` in float32 rounded to
bfloat16 once, and when the compiled step chooses it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvshare.errors import KvshareError
from kvshare.kernels.cpu import linear as cpu_linear

ext = pytest.importorskip("kvshare.kernels.cpu").extension()
needs_bf16 = pytest.mark.skipif(ext is None or not ext.linear_vnni_available(),
                                reason="this CPU (or build) has no AVX512-BF16")


def _reference(x, w, bias):
    return F.linear(x.float(), w.float(), None if bias is None else bias.float()).bfloat16()


@needs_bf16
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 16, 17])
@pytest.mark.parametrize("n,k", [(16, 2), (48, 64), (576, 576), (960, 576), (80, 1536)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_kernel_equals_the_reference(rows, n, k, with_bias):
    g = torch.Generator().manual_seed(rows * 1000 + n + k)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).bfloat16()
    x = torch.randn(rows, k, generator=g).bfloat16()
    bias = torch.randn(n, generator=g).bfloat16() if with_bias else None
    got = cpu_linear.linear_vnni(x, cpu_linear.pack(w), bias)
    want = _reference(x, w, bias)
    # products of bfloat16 are exact in float32; only the order of the sums and the one final
    # rounding differ: at most a couple of bfloat16 steps of the largest output
    torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=2 ** -6 * float(want.abs().max()) + 1e-3)


@needs_bf16
@pytest.mark.parametrize("rows", [1, 2, 5, 16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_lora_deltas_in_the_projections_pass_equal_the_reference(rows, with_bias):
    """Two parts of a fused output (the first and the last columns; the middle has no adapter),
    stacks of three slots, ranks 8 and 16 with a K not a multiple of 32, and rows of every slot
    or none (scale 0: exactly the plain projection)."""
    g = torch.Generator().manual_seed(rows)
    n, k, slots = 160, 72, 3
    parts = [(0, 32, 8), (96, 64, 16)]  # (first column, columns, rank)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).bfloat16()
    x = torch.randn(rows, k, generator=g).bfloat16()
    bias = torch.randn(n, generator=g).bfloat16() if with_bias else None
    a = [(torch.randn(slots, r, k, generator=g) / k ** 0.5).bfloat16() for _, _, r in parts]
    b_t = [torch.randn(slots, r, width, generator=g).bfloat16() for _, width, r in parts]
    index = torch.arange(rows) % slots
    scale = torch.tensor([0.0 if row % 4 == 3 else 0.5 + row for row in range(rows)])
    got = cpu_linear.linear_vnni_lora(x, cpu_linear.pack(w), bias, a, b_t, [first for first, _, _ in parts], index, scale)
    want = F.linear(x.float(), w.float(), None if bias is None else bias.float())
    for (first, width, _), a_p, b_p in zip(parts, a, b_t):
        t = torch.einsum("mk,mrk->mr", x.float(), a_p.float()[index])
        want[:, first:first + width] += scale[:, None] * torch.einsum("mr,mrn->mn", t, b_p.float()[index])
    torch.testing.assert_close(got.float(), want.bfloat16().float(), rtol=0, atol=2 ** -6 * float(want.abs().max()) + 1e-3)
    plain = cpu_linear.linear_vnni(x, cpu_linear.pack(w), bias)
    assert torch.equal(got[scale == 0], plain[scale == 0])
    assert not torch.equal(got[scale != 0], plain[scale != 0])


@needs_bf16
def test_lora_parts_off_the_16_column_blocks_are_refused():
    w, x = torch.randn(64, 32).bfloat16(), torch.randn(2, 32).bfloat16()
    a, b_t = [torch.randn(1, 8, 32).bfloat16()], [torch.randn(1, 8, 16).bfloat16()]
    with pytest.raises(RuntimeError, match="blocks of 16"):
        cpu_linear.linear_vnni_lora(x, cpu_linear.pack(w), None, a, b_t, [8], torch.zeros(2, dtype=torch.long), torch.ones(2))


@needs_bf16
def test_leading_dims_and_a_strided_input_keep_their_shape():
    w = torch.randn(32, 64).bfloat16()
    x = torch.randn(3, 2, 128).bfloat16()[..., ::2]  # not contiguous
    got = cpu_linear.linear_vnni(x, cpu_linear.pack(w))
    assert got.shape == (3, 2, 32)
    torch.testing.assert_close(got.float(), _reference(x, w, None).float(), rtol=0, atol=0.05)


@needs_bf16
def test_a_wrong_weight_is_refused():
    packed = cpu_linear.pack(torch.randn(32, 64).bfloat16())
    with pytest.raises(RuntimeError, match="input size"):
        cpu_linear.linear_vnni(torch.randn(1, 32).bfloat16(), packed)


@needs_bf16
def test_a_bias_of_another_size_and_a_strided_weight_are_refused():
    """Raw pointers read N bias values and dense weight blocks: anything else is an error, not
    a read past the bias or of the wrong blocks."""
    w = torch.randn(64, 32).bfloat16()
    x = torch.randn(1, 32).bfloat16()
    with pytest.raises(RuntimeError, match="bias of 64"):
        cpu_linear.linear_vnni(x, cpu_linear.pack(w), torch.zeros(16, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="contiguous"):
        cpu_linear.linear_vnni(x, cpu_linear.pack(w)[::2])


def test_an_unbuildable_extension_falls_back_to_the_references(tmp_path, monkeypatch, caplog):
    """A home the build folder cannot be made in (here: a file): one warning, the torch
    references serve, no error."""
    from kvshare.kernels import cpu

    blocker = tmp_path / "home-is-a-file"
    blocker.write_text("")
    monkeypatch.setenv("KVSHARE_HOME", str(blocker))
    monkeypatch.setattr(cpu, "_built", [])
    assert cpu.extension() is None and not cpu.available()
    assert "could not be built" in caplog.text


def test_packable_weights():
    assert cpu_linear.packable(torch.zeros(32, 64, dtype=torch.bfloat16))
    assert not cpu_linear.packable(torch.zeros(32, 64))  # float32
    assert not cpu_linear.packable(torch.zeros(40, 64, dtype=torch.bfloat16))  # outputs not blocks of 16
    assert not cpu_linear.packable(torch.zeros(32, 63, dtype=torch.bfloat16))  # odd input size
    assert not cpu_linear.packable((torch.zeros(32, 64, dtype=torch.int8), torch.ones(32)))  # int8 pair


def test_when_the_compiled_step_takes_it(monkeypatch):
    """The projections: where the kernel runs and the CPU has no AMX (or asked); the head: wherever it runs."""
    for other in ("inductor", "onednn"):  # (onednn: float32 graphs; bfloat16 keeps the template)
        monkeypatch.setenv("KVSHARE_CPU_GEMM", other)
        assert not cpu_linear.wanted() and not cpu_linear.head_wanted()
    monkeypatch.setenv("KVSHARE_CPU_GEMM", "fast")
    with pytest.raises(KvshareError, match="KVSHARE_CPU_GEMM must be"):
        cpu_linear.wanted()
    able = ext is not None and ext.linear_vnni_available()
    monkeypatch.setenv("KVSHARE_CPU_GEMM", "auto")
    assert cpu_linear.wanted() == (able and not torch.cpu._is_amx_tile_supported())
    assert cpu_linear.head_wanted() == able  # the head after the graph: AMX or not
    monkeypatch.setenv("KVSHARE_CPU_GEMM", "vnni")
    if able:
        assert cpu_linear.wanted() and cpu_linear.head_wanted()
    else:
        for asked in (cpu_linear.wanted, cpu_linear.head_wanted):
            with pytest.raises(KvshareError, match="AVX512-BF16"):
                asked()


def test_the_head_takes_dot_products_up_to_the_rows_where_they_win(monkeypatch):
    """Without AMX every decode bucket (measured faster at 1-16 rows on AMD EPYC); with AMX up
    to 6 rows (oneDNN's tiles win from 8 on an AMX Xeon); the compiled step's head follows it."""
    from types import SimpleNamespace

    from kvshare.serve.exec.compiled import CompiledStep

    for amx, rows in ((False, cpu_linear.MAX_ROWS), (True, cpu_linear.AMX_HEAD_ROWS)):
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda amx=amx: amx)
        assert cpu_linear.head_rows() == rows
    if ext is None or not ext.linear_vnni_available():
        pytest.skip("the dot-product kernel does not run here")
    weight = (torch.randn(64, 32) / 8).bfloat16()
    calls = []
    packed = cpu_linear.pack(weight)
    step = SimpleNamespace(_prepare=lambda: (0, {}, packed), _head_rows=cpu_linear.AMX_HEAD_ROWS,
                           model=SimpleNamespace(head=lambda h: calls.append(len(h)) or F.linear(h, weight).float()))
    for n in (cpu_linear.AMX_HEAD_ROWS, cpu_linear.AMX_HEAD_ROWS + 2):
        hidden = torch.randn(n, 32).bfloat16()
        torch.testing.assert_close(CompiledStep._head(step, hidden), F.linear(hidden, weight).float(),
                                   atol=1e-2, rtol=1e-2)
    assert calls == [cpu_linear.AMX_HEAD_ROWS + 2]  # only the larger one left the kernel
