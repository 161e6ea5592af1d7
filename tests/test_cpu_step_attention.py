"""The compiled CPU step's C++ attention op, ``kvshare::step_attention_cpu``, against the torch
references: a layer's KV writes (strided K/V rows as a fused projection gives them, read-only
rows, ICaRus pairs whose adapter row writes nothing) and its paged attention over random block
layouts, pad rows zeroed; other layers untouched; the step's plan is per thread and refused
outside a step. That the compiled engine calls it and keeps the eager tokens:
tests/test_compiled_step.py."""

from __future__ import annotations

import threading

import pytest
import torch

from kvshare.kernels import build_attention_metadata, cpu
from kvshare.kernels.attention import paged_attention_ref, write_kv_ref

pytestmark = pytest.mark.skipif(cpu.extension() is None, reason="the C++ CPU kernels are not built here")

LAYERS, BLOCKS = 3, 40


def _step(gen: torch.Generator, seqs: list[tuple[list[int], list[bool]]], n_q: int, n_kv: int, d: int, block: int,
          pad: int, dtype: torch.dtype):
    """A block-major cache, metadata for sequences of rows (position, writes?) and the step's
    q/k/v with ``pad`` pad rows; k and v are column slices of one fused tensor, as the graph's."""
    kv = torch.randn(BLOCKS, LAYERS, 2, block, n_kv, d, generator=gen).to(dtype)
    free = torch.randperm(BLOCKS, generator=gen).tolist()
    row_seq, positions, writes, tables = [], [], [], []
    for s, (rows, writing) in enumerate(seqs):
        table = [free.pop() for _ in range((max(rows) + block) // block)]
        tables.append(table)
        row_seq += [s] * len(rows)
        positions += rows
        writes += [table[p // block] * block + p % block if w else -1 for p, w in zip(rows, writing)]
    meta = build_attention_metadata(row_seq, positions, writes, tables, block)
    total = len(row_seq) + pad
    q = torch.randn(total, n_q, d, generator=gen).to(dtype)
    fused = torch.randn(total, 2 * n_kv + 1, d, generator=gen).to(dtype)
    return kv, meta, q, fused[:, :n_kv], fused[:, n_kv + 1:]


def _reference(kv: torch.Tensor, meta, q, k, v, layer: int, rows: int, scale: float) -> torch.Tensor:
    k_cache, v_cache = kv[:, layer, 0], kv[:, layer, 1]
    write_kv_ref(k_cache, v_cache, k[:rows], v[:rows], meta.slot_mapping, meta.write_rows)
    out = torch.zeros_like(q)
    out[:rows] = paged_attention_ref(q[:rows], k_cache, v_cache, meta, scale)
    return out


def _native(kv: torch.Tensor, meta, q, k, v, layer: int, rows: int, scale: float, chunks: bool) -> torch.Tensor:
    cpu.register_step_op()
    cpu.StepPlan(meta, rows, chunks).begin(kv, scale)
    try:
        return torch.ops.kvshare.step_attention_cpu(q, k, v, layer)
    finally:
        cpu.end_step()


STEPS = {
    "decode rows, unequal lengths": [([37], [True]), ([2], [True]), ([16], [True]), ([63], [True])],
    "ICaRus pairs (the adapter row reads only)": [([20, 20], [True, False]), ([45, 45], [True, False])],
    "read-only rows beside prompt rows": [([30, 31, 32], [False, True, True]), ([9], [True])],
}


@pytest.mark.parametrize("pad", [0, 3])
@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (8, 2)], ids=lambda h: f"gqa{h[0] // h[1]}")
@pytest.mark.parametrize("step", STEPS)
def test_writes_and_attention_equal_the_references(step, heads, pad):
    gen = torch.Generator().manual_seed(heads[0] * 10 + pad)
    d, block, layer = 32, 8, 1
    kv, meta, q, k, v = _step(gen, STEPS[step], *heads, d, block, pad, torch.float32)
    rows = len(q) - pad
    want_kv = kv.clone()
    want = _reference(want_kv, meta, q, k, v, layer, rows, d ** -0.5)
    got = _native(kv, meta, q, k, v, layer, rows, d ** -0.5, chunks=False)
    assert torch.equal(kv, want_kv)  # this layer's writes, and no other layer's slots
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not got[rows:].any()


def test_a_prompt_chunk_takes_the_kernel_where_it_runs_chunks():
    """A chunk of more than FEW_ROWS rows: refused where the kernel leaves chunks to SDPA (the
    graph then calls the Python op); equal to the references in bfloat16 with 64-dim heads
    where it runs them."""
    gen = torch.Generator().manual_seed(5)
    chunk = list(range(4, 4 + cpu.FEW_ROWS + 5))
    kv, meta, q, k, v = _step(gen, [(chunk, [True] * len(chunk)), ([11], [True])], 8, 2, 64, 16, 0,
                              torch.bfloat16)
    with pytest.raises(ValueError, match="prompt chunks"):
        cpu.StepPlan(meta, len(q), chunks=False)
    if not cpu.chunk_kernel_takes(torch.bfloat16, 64):
        return
    want_kv = kv.clone()
    want = _reference(want_kv, meta, q, k, v, 2, len(q), 0.125)
    got = _native(kv, meta, q, k, v, 2, len(q), 0.125, chunks=True)
    assert torch.equal(kv, want_kv)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


def test_the_op_runs_inside_a_step_of_its_own_thread_only():
    """Outside a step, or on a thread other than the one whose step it is, the op refuses
    instead of reading another step's plan."""
    gen = torch.Generator().manual_seed(1)
    kv, meta, q, k, v = _step(gen, STEPS["decode rows, unequal lengths"], 4, 4, 32, 8, 0, torch.float32)
    cpu.register_step_op()
    with pytest.raises(RuntimeError, match="inside a compiled step"):
        torch.ops.kvshare.step_attention_cpu(q, k, v, 0)
    errors = []

    def other_thread():
        try:
            torch.ops.kvshare.step_attention_cpu(q, k, v, 0)
        except RuntimeError as err:
            errors.append(str(err))

    cpu.StepPlan(meta, len(q), chunks=False).begin(kv, 0.1)
    try:
        worker = threading.Thread(target=other_thread)
        worker.start()
        worker.join()
        with pytest.raises(RuntimeError, match="no layer"):
            torch.ops.kvshare.step_attention_cpu(q, k, v, LAYERS)
    finally:
        cpu.end_step()
    assert len(errors) == 1 and "inside a compiled step" in errors[0]
