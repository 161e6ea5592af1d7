"""``kvshare bench kernels``: each kernel backend against the others and against PyTorch's own
attention, on the engine's shapes.

Two questions a GPU user asks of our kernels, each answered in one run:

* **Paged attention.** How long the backend's paged attention takes over a batch's block
  tables, next to ``F.scaled_dot_product_attention`` over the *same K/V already gathered*
  into dense (batch, heads, keys, dim) tensors: the time attention would take if the cache
  were not paged. Decode rows (one per sequence) and ICaRus pairs (two rows of one token
  over the same keys) are both measured.
* **Multi-adapter LoRA.** The time of one projection's LoRA delta for a batch whose rows
  use 8 different adapters, against the same rows all using one adapter; a plain linear of
  the base weight gives the scale. With the triton backend, also the BGMV kernels the
  CUDA-graph step uses (column ``bgmv``).

K/V live in the engine's block-major memory (blocks, layers, 2, block_size, kv_heads, dim)
in shuffled blocks, so the kernels read a strided layer view as they do when serving.
On CUDA times are :func:`triton.testing.do_bench` medians (events, after warm-up); on CPU
the median of timed calls (the torch references and the C++ "cpu" backend: Triton's
interpreter is not a speed).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from ...errors import KvshareError
from ...kernels import Kernels, build_attention_metadata
from ...kernels.lora import lora_groups
from ...kernels.registry import backends
from ...kernels.shapes import SHAPES, Shape
from .common import write_report as _write


BLOCK_SIZE = 16
LORA_RANK = 16


def _timers(device: torch.device) -> dict:
    """Functions timing ``fn()`` in milliseconds, by name. CUDA: ``launch`` is Triton's do_bench
    median (events; the host's launch cost counts when it exceeds the GPU's work, as it does in
    an eager decode step), ``graph`` the same calls captured in a CUDA graph and replayed (the
    GPU's time alone, as a graph-captured decode step sees it; None when the call cannot be
    captured). CPU: ``launch`` is the median of host-timed calls."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return {"launch": lambda fn: do_bench(fn, warmup=25, rep=200, return_mode="median"),
                "graph": lambda fn: _graph_time(fn, do_bench)}

    def cpu(fn, reps: int = 10) -> float:
        fn()
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)

    return {"launch": cpu}


def _graph_time(fn, do_bench, calls: int = 20) -> float | None:
    """Per-call time of ``calls`` back-to-back calls of ``fn`` replayed from one CUDA graph."""
    fn()  # warm-up outside the capture: compiles kernels, fills per-step caches
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
    except RuntimeError:  # e.g. a host sync inside the call
        torch.cuda.synchronize()
        return None
    return do_bench(graph.replay, warmup=25, rep=200, return_mode="median") / calls


def _paged_batch(shape: Shape, batch: int, context: int, rows_per_seq: int, dtype: torch.dtype,
                 device: torch.device, gen: torch.Generator):
    """A block-major KV memory holding ``batch`` sequences of ``context`` tokens in shuffled
    blocks, one layer's K/V views, the step's metadata and queries, and the same keys gathered
    dense for SDPA."""
    per_seq = -(-context // BLOCK_SIZE)
    n_blocks = batch * per_seq + 8
    memory = torch.randn(n_blocks, 2, 2, BLOCK_SIZE, shape.kv_heads, shape.head_dim, generator=gen).to(device, dtype)
    k_cache, v_cache = memory[:, 1, 0], memory[:, 1, 1]  # layer 1 of 2: a strided view, as in the engine
    free = torch.randperm(n_blocks, generator=gen).tolist()
    tables = [[free.pop() for _ in range(per_seq)] for _ in range(batch)]
    row_seq = [s for s in range(batch) for _ in range(rows_per_seq)]
    positions = [context - 1] * len(row_seq)
    slots = [-1] * len(row_seq)  # read-only rows: the timed call leaves the cache as it is
    meta = build_attention_metadata(row_seq, positions, slots, tables, BLOCK_SIZE, device=device)
    q = torch.randn(len(row_seq), shape.q_heads, shape.head_dim, generator=gen).to(device, dtype)
    index = torch.tensor(tables, device=device)  # (batch, blocks): gather once, outside the timing
    dense_k = k_cache[index].flatten(1, 2)[:, :context].transpose(1, 2).contiguous()  # (B, kv, L, d)
    dense_v = v_cache[index].flatten(1, 2)[:, :context].transpose(1, 2).contiguous()
    dense_q = q.view(batch, rows_per_seq, shape.q_heads, shape.head_dim).transpose(1, 2).contiguous()
    return k_cache, v_cache, meta, q, (dense_q, dense_k, dense_v)


def _time_into(row: dict, name: str, fn, timers: dict) -> None:
    """``row[name_ms]`` (launch timing) and, on CUDA, ``row[name_graph_ms]``."""
    for kind, timer in timers.items():
        row[f"{name}_ms" if kind == "launch" else f"{name}_{kind}_ms"] = timer(fn)


def _attention_rows(shape_name: str, shape: Shape, kernels: dict[str, Kernels], dtype: torch.dtype,
                    device: torch.device, batches: tuple[int, ...], contexts: tuple[int, ...], timers: dict,
                    bar) -> list[dict]:
    rows = []
    gen = torch.Generator().manual_seed(0)
    scale = shape.head_dim ** -0.5
    for rows_per_seq, what in ((1, "decode"), (2, "icarus pair")):
        for batch in batches:
            for context in contexts:
                k_cache, v_cache, meta, q, (dq, dk, dv) = _paged_batch(
                    shape, batch, context, rows_per_seq, dtype, device, gen)
                sdpa = lambda: F.scaled_dot_product_attention(dq, dk, dv, scale=scale, enable_gqa=True)  # noqa: E731
                row = {"shape": shape_name, "rows": what, "batch": batch, "context": context}
                _time_into(row, "sdpa_gathered", sdpa, timers)
                expected = sdpa().transpose(1, 2).reshape(q.shape)
                for backend, k in kernels.items():
                    out = k.paged_attention(q, k_cache, v_cache, meta, scale)
                    err = float((out.float() - expected.float()).norm() / expected.float().norm())
                    if err > (1e-3 if dtype == torch.float32 else 2e-2):
                        raise KvshareError(f"{backend} paged attention differs from SDPA by {err:.2e} "
                                           f"({shape_name}, {what}, batch {batch}, context {context})")
                    _time_into(row, backend, lambda: k.paged_attention(q, k_cache, v_cache, meta, scale), timers)
                    row[f"{backend}_rel_err"] = err
                rows.append(row)
                bar.update()
    return rows


def _lora_weights(shape: Shape, n_adapters: int, dtype: torch.dtype, device: torch.device,
                  gen: torch.Generator) -> list[tuple[torch.Tensor, torch.Tensor, float]]:
    return [((torch.randn(LORA_RANK, shape.hidden, generator=gen) / shape.hidden ** 0.5).to(device, dtype),
             (torch.randn(shape.hidden, LORA_RANK, generator=gen) / LORA_RANK ** 0.5).to(device, dtype), 2.0)
            for _ in range(n_adapters)]


def _lora_rows(shape_name: str, shape: Shape, kernels: dict[str, Kernels], dtype: torch.dtype,
               device: torch.device, batch_rows: tuple[int, ...], timers: dict, bar) -> list[dict]:
    rows = []
    gen = torch.Generator().manual_seed(1)
    weights = _lora_weights(shape, 8, dtype, device, gen)
    base_weight = (torch.randn(shape.hidden, shape.hidden, generator=gen) / shape.hidden ** 0.5).to(device, dtype)
    for n_rows in batch_rows:
        x = torch.randn(n_rows, shape.hidden, generator=gen).to(device, dtype)
        base_out = F.linear(x, base_weight)
        row = {"shape": shape_name, "rows": n_rows}
        _time_into(row, "base_linear", lambda: F.linear(x, base_weight), timers)
        for n_adapters in (1, 8):
            slots = [r % n_adapters for r in range(n_rows)]  # rows interleaved: each adapter's rows scattered
            groups = lora_groups(slots, device)
            for backend, k in kernels.items():
                _time_into(row, f"{backend}_{n_adapters}_adapters", lambda: k.gathered_lora(x, base_out, groups, weights),
                           timers)
            if "triton" in kernels:
                _time_bgmv(row, n_adapters, x, base_out, slots, groups, weights, timers)
        rows.append(row)
        bar.update()
    return rows


def _time_bgmv(row: dict, n_adapters: int, x: torch.Tensor, base_out: torch.Tensor, slots: list[int],
               groups, weights, timers: dict) -> None:
    """The CUDA-graph step's LoRA (:mod:`kvshare.kernels.triton.bgmv`: each row's slot read on
    the device) over the same rows and adapters, checked against the reference first."""
    from ...kernels.triton.bgmv import bgmv_lora_add

    a = torch.stack([w[0] for w in weights])  # (slots, rank, in), as the slot stacks hold A
    b_t = torch.stack([w[1].T for w in weights]).contiguous()  # (slots, rank, out)
    index = torch.tensor(slots, device=x.device)
    scale = torch.full((len(slots),), weights[0][2], dtype=torch.float32, device=x.device)
    out = base_out.clone()
    bgmv_lora_add(out, x, a, b_t, index, scale)
    expected = Kernels("torch").gathered_lora(x, base_out, groups, weights)
    err = float((out.float() - expected.float()).norm() / expected.float().norm())
    if err > (1e-4 if x.dtype == torch.float32 else 2e-2):
        raise KvshareError(f"the BGMV LoRA kernels differ from the reference by {err:.2e}")
    _time_into(row, f"bgmv_{n_adapters}_adapters", lambda: bgmv_lora_add(out, x, a, b_t, index, scale), timers)


def run_kernel_bench(device: str = "cuda", dtype: str = "bfloat16", kernels: list[str] | None = None,
                     shapes: list[str] | None = None, batches: tuple[int, ...] = (1, 16, 64),
                     contexts: tuple[int, ...] = (1024, 4096), lora_rows: tuple[int, ...] = (16, 64, 256),
                     out_dir: str | Path | None = None) -> dict:
    """Time every backend's paged attention and multi-adapter LoRA (see the module docstring)."""
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise KvshareError("device 'cuda' was asked for, but torch sees no CUDA GPU")
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(dtype)
    if torch_dtype is None:
        raise KvshareError(f"dtype must be float32, bfloat16 or float16, not {dtype!r}")
    if kernels is None:  # Triton's interpreter (CPU) is a correctness tool, not a speed
        fast = ["cpu"] if dev.type == "cpu" else ["triton"] if "triton" in backends("paged_attention") else []
        kernels = ["torch"] + fast
    chosen = {name: Kernels(name) for name in kernels}
    shapes = shapes or list(SHAPES)
    for name in shapes:
        if name not in SHAPES:
            raise KvshareError(f"unknown shape {name!r}; known: {', '.join(SHAPES)}")
    timers = _timers(dev)
    results: dict = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                     "timings": list(timers),
                     "dtype": dtype, "backends": kernels, "block_size": BLOCK_SIZE, "lora_rank": LORA_RANK,
                     "torch": torch.__version__, "attention": [], "lora": []}
    total = len(shapes) * (2 * len(batches) * len(contexts) + len(lora_rows))
    with torch.no_grad(), tqdm(total=total, desc="bench kernels", unit="case") as bar:
        for name in shapes:
            shape = SHAPES[name]
            results["attention"] += _attention_rows(name, shape, chosen, torch_dtype, dev, batches, contexts, timers, bar)
            results["lora"] += _lora_rows(name, shape, chosen, torch_dtype, dev, lora_rows, timers, bar)
    if out_dir:
        _write(results, out_dir, "kernel_bench", markdown)
    return results


_TIMING_TITLES = {"launch": "Each call launched from Python (host launch cost included)",
                  "graph": "Calls replayed from a CUDA graph (the GPU's time alone)"}


def _ms(row: dict, name: str, suffix: str) -> float | None:
    return row.get(f"{name}{suffix}_ms")


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a is not None and b else "-"


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def markdown(results: dict) -> str:
    backends_ = results["backends"]
    lines = [f"Device: {results['device']}, {results['dtype']}, torch {results['torch']}; "
             f"block size {results['block_size']}, LoRA rank {results['lora_rank']}. Times in ms (median)."]
    for kind in results.get("timings", ["launch"]):
        suffix = "" if kind == "launch" else f"_{kind}"
        lines += ["", f"**{_TIMING_TITLES[kind]}.**", "",
                  "| shape | rows | batch | context | SDPA, gathered K/V | "
                  + " | ".join(f"{b} paged | {b} / SDPA" for b in backends_) + " |",
                  "|---" * (5 + 2 * len(backends_)) + "|"]
        for r in results["attention"]:
            sdpa = _ms(r, "sdpa_gathered", suffix)
            cells = " | ".join(f"{_cell(_ms(r, b, suffix))} | {_ratio(_ms(r, b, suffix), sdpa)}" for b in backends_)
            lines.append(f"| {r['shape']} | {r['rows']} | {r['batch']} | {r['context']} | {_cell(sdpa)} | {cells} |")
        lora = backends_ + (["bgmv"] if any("bgmv_1_adapters_ms" in r for r in results["lora"]) else [])
        lines += ["", "| shape | rows | base linear | "
                  + " | ".join(f"{b} 1 adapter | {b} 8 adapters | {b} 8 / 1" for b in lora) + " |",
                  "|---" * (3 + 3 * len(lora)) + "|"]
        for r in results["lora"]:
            cells = " | ".join(
                f"{_cell(_ms(r, f'{b}_1_adapters', suffix))} | {_cell(_ms(r, f'{b}_8_adapters', suffix))} | "
                f"{_ratio(_ms(r, f'{b}_8_adapters', suffix), _ms(r, f'{b}_1_adapters', suffix))}" for b in lora)
            lines.append(f"| {r['shape']} | {r['rows']} | {_cell(_ms(r, 'base_linear', suffix))} | {cells} |")
    return "\n".join(lines) + "\n"
