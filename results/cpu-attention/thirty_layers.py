"""A decode step's attention over all 30 layers of SmolLM2-135M, KV cold in memory.

``python results/cpu-attention/thirty_layers.py`` builds a block-major bfloat16 KV memory of
8 sequences of 1500-2000 tokens in shuffled blocks (30 layers; about 330 MB, far beyond the
caches) and times, per step (every layer once, as a decode step does, writing each sequence's new K/V): the compiled CPU step's
torch path (:class:`StepAttention`: gather, then one SDPA call) and the C++ kernel (``cpu``:
its generic path, ``cpu+amx``: AMX scores, where the CPU has AMX, and ``cpu+dpbf16``: AVX512-BF16
dot-product scores, where the CPU has those instructions), for decode rows and ICaRus pairs. Each figure is the mean of 20 steps after one untimed.
"""

import random
import time

import torch

from kvshare.kernels import build_attention_metadata, cpu
from kvshare.kernels.step_attention import StepAttention, layer_rows

LAYERS, BLOCK, HEADS, KV_HEADS, D, SEQS = 30, 16, 9, 3, 64, 8


def step_ms(fn, reps: int = 20) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps * 1000


if __name__ == "__main__":
    torch.manual_seed(0)
    random.seed(0)
    lengths = [random.randint(1500, 2000) for _ in range(SEQS)]
    n_blocks = sum(-(-n // BLOCK) for n in lengths) + 8
    kv = torch.randn(n_blocks, LAYERS, 2, BLOCK, KV_HEADS, D).bfloat16()
    order = list(range(n_blocks))
    random.shuffle(order)
    tables, used = [], 0
    for n in lengths:
        tables.append(order[used:used + -(-n // BLOCK)])
        used += len(tables[-1])
    views, ratio = layer_rows(kv)
    print(f"{SEQS} sequences, {sum(lengths)} tokens, KV {kv.numel() * 2 / 2**20:.0f} MiB, "
          f"threads {torch.get_num_threads()}")
    for rows_per_seq, what in ((1, "decode"), (2, "ICaRus pair")):
        row_seq = [s for s in range(SEQS) for _ in range(rows_per_seq)]
        positions = [lengths[s] - 1 for s in row_seq]
        # as in a decode step: each sequence's first row writes its last position's K/V (the
        # ICaRus adapter row is read-only)
        writes = [tables[s][(lengths[s] - 1) // BLOCK] * BLOCK + (lengths[s] - 1) % BLOCK
                  if r % rows_per_seq == 0 else -1 for r, s in enumerate(row_seq)]
        meta = build_attention_metadata(row_seq, positions, writes, tables, BLOCK)
        q = torch.randn(len(row_seq), HEADS, D).bfloat16()
        k, v = (torch.randn(len(row_seq), KV_HEADS, D).bfloat16() for _ in range(2))
        times = {}
        ext = cpu.extension()
        for name, kernel, path in (("torch", False, ""), ("cpu", True, ""), ("cpu+amx", True, "amx"),
                                   ("cpu+dpbf16", True, "avx512bf16")):
            ext.paged_attention_set_amx(path == "amx")
            ext.paged_attention_set_dpbf16(path == "avx512bf16")
            if ext.paged_attention_chunk_path() != path:
                continue  # this machine lacks that path
            attention = StepAttention(meta, len(row_seq), ratio, kernel)
            times[name] = step_ms(lambda: [attention(q, k, v, views[i][0], views[i][1], D ** -0.5, *views[i][2:])
                                           for i in range(LAYERS)])
        ext.paged_attention_set_amx(True)
        ext.paged_attention_set_dpbf16(True)
        by_name = "  ".join(f"{name} {ms:6.1f} ms" for name, ms in times.items())
        best = min(ms for name, ms in times.items() if name != "torch")
        print(f"{what:12s} {by_name}  torch / best cpu {times['torch'] / best:.2f}x"
              + "".join(f"  generic / {name[4:]} {times['cpu'] / times[name]:.2f}x"
                        for name in ("cpu+amx", "cpu+dpbf16") if name in times))
