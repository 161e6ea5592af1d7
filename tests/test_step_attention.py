"""The compiled CPU step's attention (:class:`StepAttention`, the per-layer work done once per
step) against the torch reference, over a block-major cache: the same KV writes and the same
outputs for decode rows of unequal lengths (one padded, masked SDPA call), ICaRus pairs,
read-only rows, a few prompt rows (per-sequence calls), GQA and pad rows; and the same with
the C++ CPU kernel attending (no gather; a long prompt chunk takes SDPA in float32)."""

from __future__ import annotations

import pytest
import torch

from kvshare.kernels import Kernels, build_attention_metadata, cpu
from kvshare.kernels.step_attention import StepAttention, layer_rows

REF = Kernels("torch")
BLOCK, LAYERS, N_KV, D = 4, 3, 2, 8

# per sequence: the positions of its rows and whether each row writes its KV (the cache's
# other slots hold random keys: the context before the step)
LAYOUTS = {
    "decode, unequal lengths": [([9], [True]), ([2], [True]), ([14], [True])],
    "decode, equal lengths": [([5], [True]), ([5], [True])],
    "ICaRus pairs": [([6, 6], [True, False]), ([11, 11], [True, False])],
    "a read-only row": [([6], [False]), ([3], [True])],
    "a pair beside decode rows": [([6, 6], [True, False]), ([3], [True]), ([9], [True])],  # writes 0, 2, 3
    "prompt rows beside decode rows": [([0, 1, 2, 3, 4], [True] * 5), ([8], [True])],
    "a prompt chunk": [([4, 5, 6], [True] * 3), ([2, 2], [True, False])],
    "a long prompt chunk beside a pair": [(list(range(3, 3 + cpu.FEW_ROWS + 2)), [True] * (cpu.FEW_ROWS + 2)),
                                           ([7, 7], [True, False])],
}


@pytest.mark.parametrize("kernel", [False, True], ids=["gather", "cpu-kernel"])
@pytest.mark.parametrize("n_q", [2, 6])  # GQA ratios 1 and 3
@pytest.mark.parametrize("pad", [0, 3])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_step_attention_equals_the_reference(layout, pad, n_q, kernel):
    if kernel and not cpu.available():
        pytest.fail("the C++ CPU attention kernel did not build (is a C++ compiler installed?)")
    gen = torch.Generator().manual_seed(len(layout) + pad)
    n_blocks = 32
    kv = torch.randn(n_blocks, LAYERS, 2, BLOCK, N_KV, D, generator=gen)
    free = torch.randperm(n_blocks, generator=gen).tolist()
    row_seq, positions, writes, tables = [], [], [], []
    for s, (rows, write) in enumerate(LAYOUTS[layout]):
        length = max(rows) + 1
        table = [free.pop() for _ in range((length + BLOCK - 1) // BLOCK)]
        tables.append(table)
        row_seq += [s] * len(rows)
        positions += rows
        writes += [table[p // BLOCK] * BLOCK + p % BLOCK if w else -1 for p, w in zip(rows, write)]
    rows = len(row_seq)
    meta = build_attention_metadata(row_seq, positions, writes, tables, BLOCK)
    q = torch.randn(rows + pad, n_q, D, generator=gen)
    k, v = (torch.randn(rows + pad, N_KV, D, generator=gen) for _ in range(2))
    want_kv = kv.clone()
    views, ratio = layer_rows(kv)
    attention = StepAttention(meta, rows, ratio, kernel)
    for layer in range(LAYERS):
        k_rows, v_rows, k_blocks, v_blocks = views[layer]
        got = attention(q, k, v, k_rows, v_rows, D ** -0.5, k_blocks, v_blocks)
        k_cache, v_cache = want_kv[:, layer, 0], want_kv[:, layer, 1]
        REF.write_kv(k_cache, v_cache, k[:rows], v[:rows], meta.slot_mapping, meta.write_rows)
        want = REF.paged_attention(q[:rows], k_cache, v_cache, meta, D ** -0.5)
        torch.testing.assert_close(got[:rows], want, atol=1e-5, rtol=1e-5)
        assert not got[rows:].any()  # pad rows read nothing
    assert torch.equal(kv, want_kv)  # the same slots written, pad rows and read-only rows nowhere
    # writing rows that step evenly are viewed, not copied (ICaRus pairs: every other row)
    assert isinstance(attention.write_rows, slice) == (layout in ("ICaRus pairs", "a read-only row", "a prompt chunk",
                                                                  "a long prompt chunk beside a pair"))
    one_call = ("decode, unequal lengths", "decode, equal lengths", "ICaRus pairs", "a read-only row")
    if kernel:  # the long chunk's sequence is left to SDPA, every other to the kernel
        assert attention.layout.large == ([0] if layout.startswith("a long") else [])
    else:
        assert attention.uniform == (layout in one_call)
