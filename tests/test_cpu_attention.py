"""The C++ CPU paged attention (backend "cpu") against the torch reference: random block
layouts, partial blocks, GQA ratios 1/3/4, head sizes the kernel specialises (64, 128) and
others, float32/bfloat16/float16, decode rows, ICaRus pairs, read-only rows, prompt rows, and prompt chunks
(left to SDPA, except in bfloat16 with 64-dim heads where the CPU has AMX tiles or AVX512-BF16
dot products: the kernel takes them). Also: "auto" picks it on CPU, and only the sequences
asked for are written."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch

from kvshare.kernels import Kernels, build_attention_metadata, cpu
from kvshare.kernels.attention import paged_attention_ref



def test_the_kernel_builds_here():
    """Else the backend quietly serves the reference, and the tests below compare it with itself."""
    assert cpu.available()


def test_a_build_killed_half_way_does_not_stall_the_next():
    """torch's build guard is a ``lock`` file that a killed build leaves behind; the next load
    waited on it forever. Loading the built extension again with such a file in its folder
    finishes, and the file goes."""
    assert cpu.available()
    folder = Path(cpu.extension().__file__).parent
    (folder / "lock").touch()
    loaded = []
    worker = threading.Thread(target=lambda: loaded.append(cpu._build()), daemon=True)
    worker.start()
    worker.join(timeout=120)
    assert loaded and loaded[0] is not None
    assert not (folder / "lock").exists()


def test_a_first_start_attends_on_the_reference_while_the_kernels_build(tmp_path, monkeypatch):
    """A home with no build yet (a first start on a machine): an eager step's attention starts
    the build in a background process and answers at once, on the torch reference, bit for bit;
    once the build is in, the kernel serves. The stand-in build waits for a file the test writes,
    so the step cannot have waited for it."""
    built = cpu.extension()
    release = tmp_path / "release"
    monkeypatch.setattr(cpu, "_build_command", lambda: [sys.executable, "-c", _WAIT_FOR.format(path=str(release))])
    monkeypatch.setattr(cpu, "_build", lambda: built)  # what loading the finished build gives
    monkeypatch.setattr(cpu, "_built", [])
    monkeypatch.setattr(cpu, "_background", [])
    monkeypatch.setenv("KVSHARE_HOME", str(tmp_path / "home"))
    q, k, v, meta = _case(torch.Generator().manual_seed(3), [[37], [2], [16]], 4, 2, 32, 16, torch.float32)
    for _ in range(2):  # the second step too: one build, no wait
        out = cpu.paged_attention_cpu(q, k, v, meta, 0.125)
        assert torch.equal(out, paged_attention_ref(q, k, v, meta, 0.125))
        assert cpu.building() and cpu._built == [] and len(cpu._background) == 1
    release.write_text("")
    cpu._background[0].join(timeout=60)
    assert cpu._built == [built] and not cpu.building()
    torch.testing.assert_close(cpu.paged_attention_cpu(q, k, v, meta, 0.125), paged_attention_ref(q, k, v, meta, 0.125))


_WAIT_FOR = "import os, time\nwhile not os.path.exists({path!r}): time.sleep(0.05)"
_EXIT_WHILE_BUILDING = """
import os, sys, time
import kvshare.kernels.cpu as cpu
cpu._build_command = lambda: [sys.executable, "-c", "import os, time; open({pid!r}, 'w').write(str(os.getpid())); time.sleep(600)"]
assert cpu.extension(wait=False) is None
while not os.path.exists({pid!r}): time.sleep(0.05)
"""


def test_a_short_job_leaves_no_build_running_behind_it(tmp_path):
    """A process that exits while its kernels build in the background ends the build with it."""
    pid_file = tmp_path / "build.pid"
    env = dict(os.environ, KVSHARE_HOME=str(tmp_path / "home"))
    done = subprocess.run([sys.executable, "-c", _EXIT_WHILE_BUILDING.format(pid=str(pid_file))], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "building kvshare's C++ CPU kernels in the background" in done.stderr
    build = int(pid_file.read_text())
    deadline = time.monotonic() + 20
    while psutil.pid_exists(build) and psutil.Process(build).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the build outlived the process that started it"
        time.sleep(0.1)


def test_a_build_the_thread_starts_after_the_exit_handler_never_runs(monkeypatch):
    """A job exiting right after it asked for the kernels: the exit handler may run before the
    background thread starts the build. Such a build ran to its end (over a minute) holding the
    job's stdout and stderr, and a parent reading them waited for it."""
    monkeypatch.setattr(cpu, "_built", [])
    monkeypatch.setattr(cpu, "_background", [])
    monkeypatch.setattr(cpu, "_children", [])
    monkeypatch.setattr(cpu, "_exiting", threading.Event())
    monkeypatch.setattr(cpu, "_build_command", lambda: [sys.executable, "-c", "import time; time.sleep(600)"])
    popen = subprocess.Popen
    monkeypatch.setattr(cpu.subprocess, "Popen", lambda *a, **kw: (time.sleep(0.5), popen(*a, **kw))[1])
    cpu._build_in_background()
    cpu._stop_builds()  # as at exit, while the thread is on its way to start the build
    cpu._background[0].join(timeout=30)
    assert not cpu._background[0].is_alive()
    assert all(child.poll() is not None for child in cpu._children)


def test_a_build_on_disk_loads_at_once():
    """Where the extension is built already, a step waits the second it takes to load it rather
    than run the reference."""
    cpu.extension()
    cpu._built.clear()
    assert cpu.extension(wait=False) is not None and not cpu.building()


def _case(gen: torch.Generator, rows_per_seq: list[list[int]], n_q: int, n_kv: int, d: int, block: int,
          dtype: torch.dtype, n_blocks: int = 96):
    """A block-major cache of random K/V and metadata for sequences with rows at the given positions."""
    kv = torch.randn(n_blocks, 2, 2, block, n_kv, d, generator=gen).to(dtype)  # (blocks, layers, K/V, ...)
    free = torch.randperm(n_blocks, generator=gen).tolist()
    row_seq, positions, writes, tables = [], [], [], []
    for s, rows in enumerate(rows_per_seq):
        length = max(rows) + 1
        table = [free.pop() for _ in range((length + block - 1) // block)]
        tables.append(table)
        row_seq += [s] * len(rows)
        positions += rows
        writes += [-1] * len(rows)
    meta = build_attention_metadata(row_seq, positions, writes, tables, block)
    q = torch.randn(len(row_seq), n_q, d, generator=gen).to(dtype)
    return q, kv[:, 1, 0], kv[:, 1, 1], meta  # layer 1: blocks are not back to back


LAYOUTS = {
    "decode rows, unequal lengths": [[37], [2], [16], [63]],
    "ICaRus pairs": [[20, 20], [45, 45]],
    "prompt rows after a cached prefix": [[30, 31, 32, 33], [9]],
    "a causal prompt": [list(range(12))],
    "a long chunk beside decode rows": [list(range(5, 5 + cpu.FEW_ROWS + 3)), [40]],
    # on AMX: groups of 16 vectors, the last one partial; chunks split between tasks
    "two chunks after cached prefixes and a pair": [list(range(70, 141)), list(range(3, 40)), [33, 33]],
    "a causal prompt of many groups": [list(range(90))],
}
HEADS = [(4, 4), (6, 2), (8, 2)]  # GQA ratios 1, 3, 4


@pytest.mark.parametrize("d", [64, 128, 24])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"gqa{h[0] // h[1]}")
@pytest.mark.parametrize("layout", LAYOUTS)
def test_cpu_kernel_equals_the_reference_in_float32(layout, heads, d):
    gen = torch.Generator().manual_seed(d + heads[0])
    q, k_cache, v_cache, meta = _case(gen, LAYOUTS[layout], *heads, d, block=16 if d != 24 else 5,
                                      dtype=torch.float32)
    got = Kernels("cpu").paged_attention(q, k_cache, v_cache, meta, d ** -0.5)
    want = paged_attention_ref(q, k_cache, v_cache, meta, d ** -0.5)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cpu_kernel_in_half_precision_stays_within_rounding(dtype):
    """The kernel accumulates in float32, SDPA too; both round the output to the dtype."""
    gen = torch.Generator().manual_seed(3)
    q, k_cache, v_cache, meta = _case(gen, [[50, 50], [7], list(range(9))], 9, 3, 64, 16, dtype)
    got = cpu.paged_attention_cpu(q, k_cache, v_cache, meta, 0.125)
    want = paged_attention_ref(q.float(), k_cache.float(), v_cache.float(), meta, 0.125)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


def _cpu_flags() -> set[str]:
    return set(next((line for line in open("/proc/cpuinfo") if line.startswith("flags")), "").split())


def _has_amx() -> bool:
    return {"amx_tile", "amx_bf16", "avx512f", "avx512_bf16"} <= _cpu_flags()


def _has_avx512_bf16() -> bool:
    return {"avx512f", "avx512_bf16"} <= _cpu_flags()


def test_bfloat16_with_64_dim_heads_takes_amx_where_the_cpu_has_it():
    """Else the AMX and dot-product paths below would be tested only where they do not run."""
    ext = cpu.extension()
    assert ext.paged_attention_uses_amx() == _has_amx()
    want = "amx" if _has_amx() else "avx512bf16" if _has_avx512_bf16() else ""
    assert ext.paged_attention_chunk_path() == want


@pytest.fixture(params=["amx", "avx512bf16", "generic"])
def chunk_path(request):
    """Each path of bfloat16 64-dim heads: AMX tiles, AVX512-BF16 dot products (prompt chunks
    and sequences of 2-16 rows; a single row takes the generic path there), neither (chunks to
    SDPA). Yields the chunk path this machine then runs ("" where it lacks the asked one)."""
    ext = cpu.extension()
    ext.paged_attention_set_amx(request.param == "amx")
    ext.paged_attention_set_dpbf16(request.param == "avx512bf16")
    has = {"amx": _has_amx(), "avx512bf16": _has_avx512_bf16(), "generic": False}[request.param]
    yield request.param if has else ""
    ext.paged_attention_set_amx(True)
    ext.paged_attention_set_dpbf16(True)


@pytest.mark.parametrize("block", [16, 5, 32])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"gqa{h[0] // h[1]}")
@pytest.mark.parametrize("layout", LAYOUTS)
def test_bfloat16_64_dim_heads_equal_the_reference(layout, heads, block, chunk_path):
    """Tiles of 16 keys across blocks of 5, 16 and 32 keys, groups of 1 to 8 vectors (ICaRus
    pairs at GQA 4 fill one), rows of unequal lengths; every path."""
    assert cpu.extension().paged_attention_chunk_path() == chunk_path
    gen = torch.Generator().manual_seed(block + heads[0])
    q, k_cache, v_cache, meta = _case(gen, LAYOUTS[layout], *heads, 64, block, torch.bfloat16)
    got = cpu.paged_attention_cpu(q, k_cache, v_cache, meta, 0.125)
    want = paged_attention_ref(q.float(), k_cache.float(), v_cache.float(), meta, 0.125)
    torch.testing.assert_close(got.float(), want, atol=1e-2, rtol=1e-2)


def test_chunks_take_the_kernel_on_amx_or_avx512_bf16_and_sdpa_elsewhere(monkeypatch, chunk_path):
    """In bfloat16 with 64-dim heads a chunk's weighted values are tile or dot products too
    (weights rounded to bfloat16, as SDPA's CPU flash attention rounds them); scores spread
    over a wide range (near-zero weights, exponents far below 0) still match the reference."""
    import torch.nn.functional as F

    calls = []
    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **k: calls.append(1) or sdpa(*a, **k))
    gen = torch.Generator().manual_seed(11)
    q, k_cache, v_cache, meta = _case(gen, [list(range(40, 100)), [7, 7]], 9, 3, 64, 16, torch.bfloat16)
    q = q * 8  # scores of about +-60
    got = cpu.paged_attention_cpu(q, k_cache, v_cache, meta, 0.125)
    assert bool(calls) == (chunk_path == "") and cpu.chunks_in_kernel(q) == (chunk_path != "")
    want = paged_attention_ref(q.float(), k_cache.float(), v_cache.float(), meta, 0.125)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


def test_the_chunk_boundary_is_the_kernels():
    assert cpu.extension().paged_attention_chunk_rows() == cpu.FEW_ROWS


def test_only_the_sequences_asked_for_are_written():
    gen = torch.Generator().manual_seed(4)
    q, k_cache, v_cache, meta = _case(gen, [[10], [20, 20], [5]], 6, 2, 64, 16, torch.float32)
    layout = cpu.Layout(meta)
    layout.seqs = torch.tensor([1], dtype=torch.int32)
    out = torch.full_like(q, 7.0)
    cpu.attend(q, k_cache, v_cache, layout, meta, 0.125, out)
    want = paged_attention_ref(q, k_cache, v_cache, meta, 0.125)
    torch.testing.assert_close(out[1:3], want[1:3], atol=2e-5, rtol=2e-5)
    assert (out[0] == 7).all() and (out[3] == 7).all()


def test_auto_picks_the_cpu_kernel_on_cpu_and_the_references_elsewhere():
    assert Kernels("auto").choice["paged_attention"] == "cpu"
    assert Kernels("auto", "cuda").choice["paged_attention"] == "torch"
    both = Kernels("int8,cpu").choice
    assert (both["linear"], both["paged_attention"], both["write_kv"]) == ("int8", "cpu", "torch")
