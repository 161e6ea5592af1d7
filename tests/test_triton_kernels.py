"""Triton kernels against the torch references (Triton's interpreter on CPU without a GPU).

Random block layouts, partial last blocks, GQA ratios, decode / prefill-chunk / mixed
batches, ICaRus pairs, multi-adapter LoRA with rows and adapters that do not adapt.
Shapes stay small: the interpreter runs every program in numpy.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # a GPU runs the kernels compiled
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is first imported

import pytest

pytest.importorskip("triton")

from kvshare.kernels import Kernels, build_attention_metadata  # noqa: E402
from kvshare.kernels.lora import lora_groups  # noqa: E402
from kvshare.kernels.registry import register_triton  # noqa: E402

pytestmark = pytest.mark.triton

if not register_triton():  # kvshare.kernels may have been imported before the variable was set
    pytest.skip("the triton backend cannot run here", allow_module_level=True)

import kvshare.kernels.triton as tk  # noqa: E402

DEVICE = "cpu" if tk.INTERPRETED else "cuda"
REF = Kernels("torch")
FAST = Kernels("triton")


def random_batch(gen, block_size: int, n_blocks: int, sequences: list[tuple[int, list[int]]]):
    """Block tables from shuffled free blocks and rows per (cached tokens, row positions).

    A sequence's first row at a position past its cached tokens writes that K/V; rows at
    cached positions, and the second row of an ICaRus pair, are read-only (-1).
    """
    free = torch.randperm(n_blocks, generator=gen).tolist()
    tables, row_seq, positions, slots = [], [], [], []
    for s, (cached, pos) in enumerate(sequences):
        length = max(cached, max(pos) + 1)
        table = [free.pop() for _ in range(-(-length // block_size))]
        tables.append(table)
        for i, p in enumerate(pos):
            row_seq.append(s)
            positions.append(p)
            writes = p >= cached and p not in pos[:i]
            slots.append(table[p // block_size] * block_size + p % block_size if writes else -1)
    return tables, row_seq, positions, slots


SCENARIOS = {
    # (cached tokens, row positions) per sequence
    "decode": [(5, [5]), (12, [12]), (1, [1]), (8, [8])],
    "prefill-chunks": [(0, list(range(7))), (6, list(range(6, 11)))],  # from 0; continuing cached context
    "mixed": [(0, list(range(5))), (9, [9]), (3, [3, 3]), (4, [2]), (7, list(range(7, 10)))],
    "icarus-pairs": [(6, [6, 6]), (13, [13, 13]), (0, [0, 0])],  # base + adapter row of one token
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("n_q,n_kv", [(2, 2), (6, 2), (4, 1)], ids=["gqa1", "gqa3", "gqa4"])
def test_write_and_attention_equal_the_reference(scenario, n_q, n_kv):
    gen = torch.Generator().manual_seed(list(SCENARIOS).index(scenario) * 10 + n_q)
    block_size, n_blocks, d = 4, 16, 8
    tables, row_seq, positions, slots = random_batch(gen, block_size, n_blocks, SCENARIOS[scenario])
    meta = build_attention_metadata(row_seq, positions, slots, tables, block_size, device=DEVICE)
    k_cache = torch.randn(n_blocks, block_size, n_kv, d, generator=gen).to(DEVICE)
    v_cache = torch.randn(n_blocks, block_size, n_kv, d, generator=gen).to(DEVICE)
    rows = len(row_seq)
    q = torch.randn(rows, n_q, d, generator=gen).to(DEVICE)
    k = torch.randn(rows, n_kv, d, generator=gen).to(DEVICE)
    v = torch.randn(rows, n_kv, d, generator=gen).to(DEVICE)

    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    REF.write_kv(ref_k, ref_v, k, v, meta.slot_mapping, meta.write_rows)
    FAST.write_kv(k_cache, v_cache, k, v, meta.slot_mapping, meta.write_rows)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)

    want = REF.paged_attention(q, ref_k, ref_v, meta, d ** -0.5)
    got = FAST.paged_attention(q, k_cache, v_cache, meta, d ** -0.5)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("prefetch", [True, False], ids=["table-ahead", "table-in-step"])
@pytest.mark.parametrize("splits", [1, 2, 3, 5])
@pytest.mark.parametrize("n_q,n_kv", [(6, 2), (4, 1)], ids=["gqa3", "gqa4"])
def test_attention_split_over_the_keys_equals_the_reference(splits, n_q, n_kv, prefetch, monkeypatch):
    """Flash decoding: each program takes a share of the keys and a second kernel merges
    them; sequences shorter than a share, ICaRus pairs, a prefill chunk and read-only rows
    leave some splits without keys for some rows. Block-table entries loaded in their step (the
    default) or a step ahead of their K/V (the variant the GPU sweep times)."""
    import kvshare.kernels.triton.attention as attention

    monkeypatch.setattr(attention, "_PREFETCH_TABLE", prefetch)
    gen = torch.Generator().manual_seed(splits * 10 + n_q)
    block_size, n_blocks, d = 4, 100, 8
    sequences = [(130, [130]), (20, [20]), (70, [70, 70]), (90, list(range(90, 96))), (40, [12])]
    tables, row_seq, positions, slots = random_batch(gen, block_size, n_blocks, sequences)
    meta = build_attention_metadata(row_seq, positions, slots, tables, block_size, device=DEVICE)
    k_cache = torch.randn(n_blocks, block_size, n_kv, d, generator=gen).to(DEVICE)
    v_cache = torch.randn(n_blocks, block_size, n_kv, d, generator=gen).to(DEVICE)
    q = torch.randn(len(row_seq), n_q, d, generator=gen).to(DEVICE)
    want = REF.paged_attention(q, k_cache, v_cache, meta, d ** -0.5)
    got = tk.paged_attention(q, k_cache, v_cache, meta, d ** -0.5, splits=splits)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_split_keys_leave_a_graphs_pad_rows_zero_whatever_the_scratch_held():
    """A CUDA graph runs a fixed number of rows; the rows past the step's last sequence get no
    partials, and their merge must not read what the scratch held before (NaN here)."""
    from kvshare.kernels.triton.attention import launch_paged_attention, launch_shape

    gen = torch.Generator().manual_seed(5)
    block_size, n_blocks, n_q, n_kv, d, pad = 4, 60, 4, 2, 8, 3
    tables, row_seq, positions, slots = random_batch(gen, block_size, n_blocks, [(50, [50]), (30, [30, 30])])
    meta = build_attention_metadata(row_seq, positions, slots, tables, block_size, device=DEVICE)
    k_cache = torch.randn(n_blocks, block_size, n_kv, d, generator=gen).to(DEVICE)
    v_cache = torch.randn(n_blocks, block_size, n_kv, d, generator=gen).to(DEVICE)
    rows = len(row_seq)
    q = torch.randn(rows + pad, n_q, d, generator=gen).to(DEVICE)
    size = rows + pad  # the graph's rows: pad sequences without rows, as serve/exec/cuda_graphs.py lays them out
    loc = torch.cat([meta.query_start_loc, torch.full((size - 2,), rows, dtype=torch.int32, device=DEVICE)])
    table = torch.zeros(size, meta.block_tables.shape[1], dtype=meta.block_tables.dtype, device=DEVICE)
    table[:2] = meta.block_tables
    positions_padded = torch.cat([meta.positions, torch.zeros(pad, dtype=meta.positions.dtype, device=DEVICE)])
    launch = launch_shape(n_q, n_kv, size, 2, 51, q.device, splits=3)
    nan = torch.full((size, n_q, 3), float("nan"), device=DEVICE)
    partials = torch.full((size, n_q, 3, d), float("nan"), device=DEVICE), nan, nan.clone()
    out = torch.full_like(q, float("nan"))
    launch_paged_attention(out, partials, q, k_cache, v_cache, positions_padded, loc, table, block_size,
                           d ** -0.5, launch)
    torch.testing.assert_close(out[:rows], REF.paged_attention(q[:rows], k_cache, v_cache, meta, d ** -0.5),
                               atol=1e-5, rtol=1e-5)
    assert torch.equal(out[rows:], torch.zeros_like(out[rows:]))


def test_keys_are_split_only_while_the_grid_leaves_the_gpu_idle(monkeypatch):
    import kvshare.kernels.triton.attention as attention

    gpu, sms = torch.device("cuda", 0), 132
    monkeypatch.setitem(attention._SMS, 0, sms)  # an H100's count, without asking a device
    key_splits = attention.key_splits
    assert key_splits(3, 4096, gpu) == 16  # one sequence, 3 KV heads: 264 / 3 programs, 4096 / 256 keys
    assert key_splits(3, 1024, gpu) == 4  # no split shorter than 256 keys
    assert key_splits(3, 300, gpu) == 1  # too short to split
    assert key_splits(2 * sms, 4096, gpu) == 1  # the grid fills the GPU
    assert key_splits(100, 4096, gpu) == 3


def test_attention_reads_a_strided_layer_of_the_engine_cache():
    """The engine passes block-major kv_cache[:, layer, 0] views (blocks a whole block of
    every layer apart); a row's rows past the tile size split into several programs (a
    prefill longer than one tile)."""
    gen = torch.Generator().manual_seed(7)
    block_size, n_blocks, n_kv, n_q, d = 3, 24, 1, 4, 16
    tables, row_seq, positions, slots = random_batch(gen, block_size, n_blocks, [(0, list(range(21))), (4, [4])])
    meta = build_attention_metadata(row_seq, positions, slots, tables, block_size, device=DEVICE)
    cache = torch.randn(n_blocks, 2, 2, block_size, n_kv, d, generator=gen).to(DEVICE)
    q = torch.randn(len(row_seq), n_q, d, generator=gen).to(DEVICE)
    want = REF.paged_attention(q, cache[:, 1, 0], cache[:, 1, 1], meta, 0.3)
    got = FAST.paged_attention(q, cache[:, 1, 0], cache[:, 1, 1], meta, 0.3)
    dense = cache[:, 1].contiguous()  # the same numbers, blocks back to back
    torch.testing.assert_close(want, REF.paged_attention(q, dense[:, 0], dense[:, 1], meta, 0.3), atol=0, rtol=0)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    heads_last = q.transpose(1, 2).contiguous().transpose(1, 2)  # the same q, head dims strided
    torch.testing.assert_close(FAST.paged_attention(heads_last, cache[:, 1, 0], cache[:, 1, 1], meta, 0.3), want,
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("scenario", ["mixed", "icarus-pairs"])
@pytest.mark.parametrize("d", [12, 20])
def test_head_dims_that_are_not_a_power_of_two(scenario, d):
    """Head dims such as Phi's 80 or Phi-3's 96 pad to the next power of two in registers
    (masked): written, attended, with and without key splits, as the reference."""
    gen = torch.Generator().manual_seed(d)
    block_size, n_blocks, n_q, n_kv = 4, 40, 6, 2
    sequences = SCENARIOS[scenario] + [(60, [60])]  # long enough to split
    tables, row_seq, positions, slots = random_batch(gen, block_size, n_blocks, sequences)
    meta = build_attention_metadata(row_seq, positions, slots, tables, block_size, device=DEVICE)
    k_cache = torch.randn(n_blocks, block_size, n_kv, d, generator=gen).to(DEVICE)
    v_cache = torch.randn(n_blocks, block_size, n_kv, d, generator=gen).to(DEVICE)
    rows = len(row_seq)
    q = torch.randn(rows, n_q, d, generator=gen).to(DEVICE)
    k, v = (torch.randn(rows, n_kv, d, generator=gen).to(DEVICE) for _ in range(2))
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    REF.write_kv(ref_k, ref_v, k, v, meta.slot_mapping, meta.write_rows)
    FAST.write_kv(k_cache, v_cache, k, v, meta.slot_mapping, meta.write_rows)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
    want = REF.paged_attention(q, ref_k, ref_v, meta, d ** -0.5)
    for splits in (None, 3):
        got = tk.paged_attention(q, k_cache, v_cache, meta, d ** -0.5, splits=splits)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [
    torch.float32,
    torch.float16,  # the interpreter computes float16 right (not bfloat16)
    pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
        tk.INTERPRETED, reason="Triton 3.9's interpreter computes bfloat16 tl.dot wrongly")),
])
def test_model_dtype_tensors_through_every_kernel(dtype):
    """The engine's own dtype end to end (bfloat16 or float16 on a GPU): K/V written, attended, adapted."""
    gen = torch.Generator().manual_seed(3)
    block_size, n_blocks, n_kv, n_q, d = 4, 8, 2, 4, 16
    tables, row_seq, positions, slots = random_batch(gen, block_size, n_blocks, [(0, [0, 1, 2]), (5, [5, 5])])
    meta = build_attention_metadata(row_seq, positions, slots, tables, block_size, device=DEVICE)
    rows = len(row_seq)
    cache = torch.randn(2, n_blocks, block_size, n_kv, d, generator=gen).to(DEVICE, dtype)
    q, k, v = (torch.randn(rows, h, d, generator=gen).to(DEVICE, dtype) for h in (n_q, n_kv, n_kv))
    ref_cache = cache.clone()
    REF.write_kv(ref_cache[0], ref_cache[1], k, v, meta.slot_mapping, meta.write_rows)
    FAST.write_kv(cache[0], cache[1], k, v, meta.slot_mapping, meta.write_rows)
    assert torch.equal(cache, ref_cache)
    tolerance = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.float16: {"atol": 5e-3, "rtol": 5e-3},
                 torch.bfloat16: {"atol": 3e-2, "rtol": 2e-2}}[dtype]
    got = FAST.paged_attention(q, cache[0], cache[1], meta, d ** -0.5)
    assert got.dtype == dtype
    torch.testing.assert_close(got, REF.paged_attention(q, cache[0], cache[1], meta, d ** -0.5), **tolerance)
    weights = [(torch.randn(4, n_q * d, generator=gen).to(DEVICE, dtype) / 8,
                torch.randn(n_q * d, 4, generator=gen).to(DEVICE, dtype) / 2, 2.0)]
    x, base = got.reshape(rows, -1), torch.randn(rows, n_q * d, generator=gen).to(DEVICE, dtype)
    groups = lora_groups([0, -1, 0, 0, -1], DEVICE)
    lora = FAST.gathered_lora(x, base, groups, weights)
    assert lora.dtype == dtype
    torch.testing.assert_close(lora, REF.gathered_lora(x, base, groups, weights), **tolerance)


def lora_weights(gen, ranks: list[int | None], d_in: int, d_out: int):
    return [None if r is None else (torch.randn(r, d_in, generator=gen).to(DEVICE),
                                    torch.randn(d_out, r, generator=gen).to(DEVICE), 0.5 + s)
            for s, r in enumerate(ranks)]


def test_gathered_lora_equals_the_reference():
    gen = torch.Generator().manual_seed(0)
    d_in, d_out, rows = 40, 36, 21
    # slot 1 does not adapt this projection; ranks differ (stacked zero-padded)
    weights = lora_weights(gen, [4, None, 8, 3], d_in, d_out)
    slots = torch.randint(-1, 4, (rows,), generator=gen).tolist()
    slots[:4] = [-1, 1, 0, 3]
    slots[4:] = [2 if s == 3 else s for s in slots[4:]]  # slot 2 has > 16 rows: two row tiles
    x = torch.randn(rows, d_in, generator=gen).to(DEVICE)
    base = torch.randn(rows, d_out, generator=gen).to(DEVICE)
    groups = lora_groups(slots, DEVICE)
    kept = base.clone()
    got = FAST.gathered_lora(x, base, groups, weights)
    torch.testing.assert_close(got, REF.gathered_lora(x, base, groups, weights), atol=1e-4, rtol=1e-5)
    assert torch.equal(base, kept)  # out of place, like the reference
    unadapted = [r for r, s in enumerate(slots) if s in (-1, 1)]
    assert torch.equal(got[unadapted], base[unadapted])
    # only adapters that leave the projection alone: nothing to add
    assert torch.equal(FAST.gathered_lora(x, base, lora_groups([1] * rows, DEVICE), weights), base)
    # the engine's way: into the projection output it has just computed
    assert FAST.gathered_lora(x, kept, groups, weights, inplace=True) is kept
    torch.testing.assert_close(kept, got, atol=0, rtol=0)


def test_lora_shrink_writes_into_a_given_buffer():
    """x·A lands in the caller's buffer at the rows it names; other rows stay untouched."""
    gen = torch.Generator().manual_seed(1)
    weights = lora_weights(gen, [None, 5, 2], 24, 8)
    slots = [2, -1, 1, 1, 2]
    x = torch.randn(len(slots), 24, generator=gen).to(DEVICE)
    groups = lora_groups(slots, DEVICE)
    segments = tk.lora_segments(groups, weights)
    assert tk.lora_segments(groups, weights) is segments  # built once per step's groups
    assert tk.lora_segments(lora_groups(slots, DEVICE), weights) is not segments  # a new step's rows
    stacked = tk.stack_lora_weights(weights)
    assert tk.stack_lora_weights(weights) is stacked  # built once per weights list
    pool = torch.full((10, 6), 7.0, device=DEVICE)
    destination = torch.tensor([9, 4, 0, 2], device=DEVICE)  # segment rows: 2, 3 (slot 1), 0, 4 (slot 2)
    tk.lora_shrink(x, stacked.a, segments, out=pool, out_rows=destination)
    for row, dest in zip(segments.rows.tolist(), destination.tolist()):
        a = weights[slots[row]][0]
        torch.testing.assert_close(pool[dest, :a.shape[0]], x[row] @ a.T, atol=1e-5, rtol=1e-5)
        assert torch.all(pool[dest, a.shape[0]:5] == 0)  # zero padding past the adapter's rank
    untouched = [r for r in range(10) if r not in destination.tolist()]
    assert torch.all(pool[untouched] == 7.0)


@pytest.mark.parametrize("launches", [1, 2])
@pytest.mark.parametrize("rank,d_in,d_out,tile", [(8, 40, 36, None), (16, 300, 290, None), (16, 300, 290, 1024)])
def test_bgmv_adds_each_rows_slot_delta_in_place_as_the_reference(rank, d_in, d_out, tile, launches, monkeypatch):
    """The CUDA-graph step's LoRA: each row's slot and scale read on the device; rows of scale
    0 (no adapter, an ICaRus base row, pad rows) untouched; into a column slice of a wider
    output, as the fused projections give it; several feature tiles and a loop over the input
    features when the features are many for a tile; shrink and expand in one launch (small
    projections) or two."""
    from kvshare.kernels.triton import bgmv
    from kvshare.serve.exec.lora_slots import lora_delta

    if launches == 2:
        monkeypatch.setattr(bgmv, "_FUSED_READS", 0)
    if tile is not None:  # 1024 elements at rank 16: 64 features a tile, so 5 of each and a 5-step loop
        monkeypatch.setattr(bgmv, "_TILE", tile)

    gen = torch.Generator().manual_seed(4)
    slots, rows, first = 3, 7, 5
    a = torch.randn(slots, rank, d_in, generator=gen).to(DEVICE)
    b_t = torch.randn(slots, rank, d_out, generator=gen).to(DEVICE)
    a[1, rank // 2:] = 0  # a smaller adapter, zero-padded in the stack
    b_t[1, rank // 2:] = 0
    x = torch.randn(rows, d_in, generator=gen).to(DEVICE)
    index = torch.tensor([2, 0, 1, 0, 2, 1, 0], device=DEVICE)
    scale = torch.tensor([0.5, 0.0, 2.0, 1.0, 0.0, 0.25, 0.0], device=DEVICE)
    wide = torch.randn(rows, first + d_out + 3, generator=gen).to(DEVICE)
    want = wide.clone()
    want[:, first:first + d_out] += lora_delta(x, a, b_t, index, scale)
    tk.bgmv_lora_add(wide[:, first:first + d_out], x, a, b_t, index, scale)
    torch.testing.assert_close(wide, want, atol=1e-4, rtol=1e-5)
    unadapted = (scale == 0).nonzero().flatten()
    assert torch.equal(wide[unadapted], want[unadapted])  # bit for bit: never written
    kept = wide.clone()
    tk.bgmv_lora_add(wide, x, a[:, :0], b_t[:, :0], index, scale)  # rank 0: a projection no adapter adapts
    assert torch.equal(wide, kept)


@pytest.mark.parametrize("widths", [(36, 12, 12), (40, 40), (20,), ()])
def test_bgmv_parts_of_a_fused_projection_are_one_launch_equal_to_each_part_alone(widths):
    """q/k/v or gate/up of one fused output, each part's A and B in its own stack (as the slot
    stacks hold them, of different widths), and a part no adapter adapts left out: one launch
    (one part: the plain kernel), each part's columns as :func:`bgmv_lora_add` of that part
    alone, the rest untouched."""
    from kvshare.kernels.triton.bgmv import bgmv_lora_add_parts
    from kvshare.kernels.triton.launch_count import count_launches
    from kvshare.serve.exec.lora_slots import lora_delta

    gen = torch.Generator().manual_seed(5)
    slots, rows, rank, d_in = 3, 5, 8, 24
    index = torch.tensor([2, 0, 1, 1, 0], device=DEVICE)
    scale = torch.tensor([0.5, 0.0, 2.0, 1.0, 0.25], device=DEVICE)
    x = torch.randn(rows, d_in, generator=gen).to(DEVICE)
    total = sum(widths) + 7  # 7 columns of a part no adapter adapts, between the first two
    y = torch.randn(rows, total, generator=gen).to(DEVICE)
    want, parts, first = y.clone(), [], 0
    for n, width in enumerate(widths):
        a = torch.randn(slots, rank, d_in, generator=gen).to(DEVICE)
        b_t = torch.randn(slots, rank, width, generator=gen).to(DEVICE)
        want[:, first:first + width] += lora_delta(x, a, b_t, index, scale)
        parts.append((first, a, b_t))
        first += width + (7 if n == 0 else 0)
    with count_launches() as launched:
        bgmv_lora_add_parts(y, x, parts, index, scale)
    torch.testing.assert_close(y, want, atol=1e-4, rtol=1e-5)
    gap = widths[0] if widths else 0
    assert torch.equal(y[:, gap:gap + 7], want[:, gap:gap + 7])  # never written
    assert sum(launched.values()) == (1 if widths else 0), launched  # no adapted part (an aLoRA's o): nothing


@pytest.mark.parametrize("rows,adapted_widths,bias", [
    (2, ((0, 32),), True),  # an ICaRus pair's q of a q/k/v projection: k and v columns get no delta
    (5, ((0, 32), (48, 32)), False),  # gate/up: both parts, a gap between them
    (16, ((16, 16), (32, 32), (64, 16)), True),  # three parts, a full tile of rows
    (1, (), True),  # no adapted part: a plain projection
    (1, ((16, 48),), False),  # one row: a single LoRA agent's step
    (3, ((0, 80),), False),  # a part wider than a tile, output columns past a tile's edge
])
def test_linear_lora_is_the_projection_plus_each_rows_delta(rows, adapted_widths, bias):
    """The fused decode projection: ``x W^T + b`` and each row's LoRA delta from its own slot
    (rows of scale 0 get the projection alone, their slot never read: -1 here), equal to
    ``F.linear`` plus :func:`lora_delta` of each adapted part, in one launch."""
    import torch.nn.functional as F

    from kvshare.kernels.triton.launch_count import count_launches
    from kvshare.kernels.triton.linear_lora import fits, linear_lora
    from kvshare.serve.exec.lora_slots import lora_delta

    gen = torch.Generator().manual_seed(7)
    slots, rank, d_in, d_out = 3, 8, 72, 100
    x = torch.randn(rows, d_in, generator=gen).to(DEVICE)
    weight = torch.randn(d_out, d_in, generator=gen).to(DEVICE)
    b = torch.randn(d_out, generator=gen).to(DEVICE) if bias else None
    scale = torch.tensor([0.0, 0.5, 2.0, 0.0, 1.0] * 4, device=DEVICE)[:rows]
    if rows == 1:
        scale = torch.tensor([1.5], device=DEVICE)
    index = torch.randint(0, slots, (rows,), generator=gen).to(DEVICE)
    index[scale == 0] = -1  # no slot: read, it would fault on a GPU or take the last one here
    want, parts = F.linear(x, weight, b), []
    for first, width in adapted_widths:
        a = torch.randn(slots, rank, d_in, generator=gen).to(DEVICE)
        b_t = torch.randn(slots, rank, width, generator=gen).to(DEVICE)
        a[1, rank // 2:], b_t[1, rank // 2:] = 0, 0  # a smaller adapter, zero-padded in the stack
        want[:, first:first + width] += lora_delta(x, a, b_t, index, scale)
        parts.append((first, a, b_t))
    assert fits(x, weight, parts)
    with count_launches() as launched:
        y = linear_lora(x, weight, b, parts, index, scale)
    torch.testing.assert_close(y, want, atol=1e-4, rtol=1e-5)
    assert sum(launched.values()) == 1, launched


@pytest.mark.parametrize("rows", [2, 5])
def test_linear_lora_keeps_one_rows_nan_delta_to_that_row(rows):
    """A tenant's adapter gone NaN (or an overflowed delta) spoils its own row only: an ICaRus
    pair's base row and every other row keep ``x W^T`` exactly, as in the reference."""
    import torch.nn.functional as F

    from kvshare.kernels.triton.linear_lora import fits, linear_lora

    gen = torch.Generator().manual_seed(11)
    slots, rank, d_in, d_out = 2, 8, 64, 64
    x = torch.randn(rows, d_in, generator=gen).to(DEVICE)
    weight = torch.randn(d_out, d_in, generator=gen).to(DEVICE)
    a = torch.randn(slots, rank, d_in, generator=gen).to(DEVICE)
    b_t = torch.randn(slots, rank, d_out, generator=gen).to(DEVICE)
    a[1, 0, 0] = float("nan")
    index = torch.tensor([-1, 1, 0, -1, 0][:rows], device=DEVICE)
    scale = torch.tensor([0.0, 1.0, 1.0, 0.0, 1.0][:rows], device=DEVICE)
    assert fits(x, weight, [(0, a, b_t)])
    y = linear_lora(x, weight, None, [(0, a, b_t)], index, scale)
    assert torch.isnan(y[1]).all()
    clean = [r for r in range(rows) if r != 1]
    assert torch.isfinite(y[clean]).all()
    torch.testing.assert_close(y[0], F.linear(x, weight)[0], atol=1e-4, rtol=1e-5)


def test_linear_lora_declines_what_it_cannot_take():
    """Too many rows, a weight of another dtype or kind, features that do not match, parts whose
    edges a tile cannot follow, that differ in rank, or of a rank too large beside a tile: the
    caller keeps cuBLAS and the BGMV kernel."""
    from kvshare.kernels.triton.linear_lora import MAX_ROWS, fits

    x, w = torch.randn(2, 32), torch.randn(64, 32)
    a, b_t = torch.randn(2, 4, 32), torch.randn(2, 4, 32)
    assert fits(x, w, [(0, a, b_t)]) and fits(x, w, [])
    assert not fits(torch.randn(MAX_ROWS + 1, 32), w, [(0, a, b_t)])
    assert not fits(x, w.double(), [(0, a, b_t)])
    assert not fits(x, object(), [(0, a, b_t)])  # a packed or quantised weight
    assert not fits(torch.randn(2, 16), w, [])  # features that are not the weight's
    assert not fits(x, w, [(8, a, b_t[..., :24])])  # edges at 8 and 32 columns: no 16-column tile follows
    assert not fits(x, w, [(48, a, b_t)])  # past the projection's columns
    assert not fits(x, w, [(0, a, b_t), (32, a[:, :2], b_t[:, :2])])  # ranks differ
    assert not fits(x, w, [(0, torch.randn(2, 64, 32), torch.randn(2, 64, 32))])  # rank 64: a tile reads A more than W


def test_a_linear_lora_kernel_that_cannot_compile_leaves_projections_to_cublas_and_bgmv(monkeypatch, caplog):
    """On a GPU whose compiler rejects the kernel, it is tried once (logged), returns None so the
    graph step takes the projection and its LoRA apart, and is never offered again."""
    from kvshare.kernels.triton import linear_lora as ll

    def rejected(*args):
        raise RuntimeError("PassManager::run failed\nmore")

    monkeypatch.setattr(ll, "_launch", rejected)
    monkeypatch.setattr(ll, "INTERPRETED", False)  # compiled mode, as on a GPU
    monkeypatch.setattr(ll, "require_gpu_tensor", lambda t, interpreted: None)
    monkeypatch.setattr(ll, "_failed", None)
    x, w = torch.randn(2, 32), torch.randn(64, 32)
    parts = [(0, torch.randn(2, 4, 32), torch.randn(2, 4, 32))]
    assert ll.fits(x, w, parts)
    with caplog.at_level("WARNING"):
        assert ll.linear_lora(x, w, None, parts, torch.zeros(2, dtype=torch.long), torch.ones(2)) is None
    assert ll._failed == "RuntimeError: PassManager::run failed" and not ll.fits(x, w, parts)
    assert caplog.text.count("projections and their LoRA launch apart") == 1


def test_a_multi_part_kernel_that_cannot_compile_falls_back_to_one_launch_a_part(monkeypatch, caplog):
    """On a GPU whose compiler rejects the multi-part kernel, the parts launch one by one
    (logged once, never tried again) instead of failing the graph and the engine's speed."""
    from kvshare.kernels.triton import bgmv
    from kvshare.serve.exec.lora_slots import lora_delta

    tried = []

    class Rejected:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                tried.append(grid)
                raise RuntimeError("PassManager::run failed\nmore")
            return launch

    monkeypatch.setattr(bgmv, "_parts_kernel", Rejected())
    monkeypatch.setattr(bgmv, "INTERPRETED", False)  # compiled mode, as on a GPU
    monkeypatch.setattr(bgmv, "require_gpu_tensor", lambda t, interpreted: None)
    monkeypatch.setattr(bgmv, "_parts_failed", None)
    monkeypatch.setattr(bgmv, "bgmv_lora_add",
                        lambda y, x, a, b_t, index, scale: y.add_(lora_delta(x, a, b_t, index, scale)))
    gen = torch.Generator().manual_seed(6)
    x, index, scale = torch.randn(3, 16, generator=gen), torch.tensor([0, 1, 0]), torch.tensor([1.0, 0.5, 0.0])
    parts = [(0, torch.randn(2, 8, 16, generator=gen), torch.randn(2, 8, 10, generator=gen)),
             (10, torch.randn(2, 8, 16, generator=gen), torch.randn(2, 8, 10, generator=gen))]
    want = torch.cat([lora_delta(x, a, b_t, index, scale) for _, a, b_t in parts], dim=1)
    for _ in range(2):
        y = torch.zeros(3, 20)
        with caplog.at_level("WARNING"):
            bgmv.bgmv_lora_add_parts(y, x, parts, index, scale)
        torch.testing.assert_close(y, want)
    assert len(tried) == 1 and bgmv._parts_failed == "RuntimeError: PassManager::run failed"
    assert caplog.text.count("LoRA parts launch one by one") == 1


def test_triton_engine_generates_what_the_torch_engine_generates(tiny_models, tmp_path):
    """A whole engine on the Triton kernels: a base, a LoRA and an ICaRus request together
    (paired decode rows, prefill, LoRA over mixed rows) give the same greedy tokens."""
    from kvshare.export import export_adapter
    from kvshare.serve import LLM, SamplingParams
    from kvshare.testing import make_peft_adapter

    base = tiny_models("llama")
    adapters = []
    for kind, targets, seed in [("lora", ["q_proj", "v_proj", "down_proj"], 1), ("icarus", ["q_proj", "o_proj"], 2)]:
        ckpt = make_peft_adapter(base, tmp_path / f"ckpt-{kind}", target_modules=targets, seed=seed)
        adapters.append(export_adapter(ckpt, kind=kind, base=base, out=tmp_path / kind))
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [14, 15, 16, 17, 18]]
    names = [None, "lora", "icarus"]

    def run(kernels: str) -> list[list[int]]:
        llm = LLM(base, adapters, kv_cache_tokens=256, block_size=4, kernels=kernels, device=DEVICE)
        engine = llm.engine
        assert set(engine.runner.kernels.choice.values()) == {kernels, "torch"}  # "linear" stays torch
        ids = [engine.add_request(p, params, adapter=a) for p, a in zip(prompts, names)]
        done = {}
        while engine.has_unfinished():
            done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
        return [done[i] for i in ids]

    assert run("triton") == run("torch")


def test_triton_engine_serves_forkkv_agents_as_the_torch_engine(tiny_models, tmp_path):
    """ForkKV in the engine on the Triton kernels (residual attention, KV and residual
    writes): two LoRA agents sharing a context's base part beside an exact request give
    the same greedy tokens as on the torch kernels."""
    from kvshare.random_adapters import random_adapter
    from kvshare.serve import LLM, SamplingParams

    base = tiny_models("llama")
    adapters = [random_adapter("lora", base, tmp_path, f"lora-{i}", seed=i) for i in range(2)]
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    context = list(range(5, 18))
    prompts = [context + [20], context + [21], [30, 31, 32]]

    def run(kernels: str) -> tuple[list[list[int]], int]:
        llm = LLM(base, [], kv_cache_tokens=256, block_size=4, kernels=kernels, device=DEVICE)
        assert llm.engine.runner.kernels.choice["residual_attention"] == kernels
        for i, path in enumerate(adapters):
            llm.engine.load_adapter(path, f"lora-{i}", kv_layout="forkkv")
        first = llm.generate(prompts[:1], params, adapter="lora-0")  # its base part is then shared
        rest = llm.generate(prompts[1:], params, adapter=["lora-1", None])
        return [o.token_ids for o in first + rest], llm.engine.stats()["forkkv_base_read_tokens"]

    triton_tokens, triton_reads = run("triton")
    assert triton_reads > 0 and (triton_tokens, triton_reads) == run("torch")


def test_compiled_kernels_refuse_cpu_tensors_with_a_clear_error():
    from kvshare.errors import KvshareError
    from kvshare.kernels.triton._common import require_gpu_tensor

    with pytest.raises(KvshareError, match="need tensors on a GPU"):
        require_gpu_tensor(torch.zeros(1), interpreted=False)
    require_gpu_tensor(torch.zeros(1), interpreted=True)  # the interpreter takes CPU tensors


def test_an_engine_on_the_cpu_refuses_compiled_triton_kernels_when_built(monkeypatch):
    """``--device cpu --kernels triton`` on a machine with a GPU: refused when the engine's
    kernels are chosen, not at its first step (the interpreter takes CPU tensors)."""
    from kvshare.errors import KvshareError

    if tk.INTERPRETED:
        assert Kernels("triton", "cpu").choice["paged_attention"] == "triton"
    monkeypatch.setattr(tk, "INTERPRETED", False)
    with pytest.raises(KvshareError, match="run on a GPU"):
        Kernels("triton", "cpu")
    Kernels("torch", "cpu")
