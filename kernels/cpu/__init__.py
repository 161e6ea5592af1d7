"""CPU kernels PyTorch lacks, in C++, built on first use (backend "cpu").

Paged attention for a few query rows per sequence (:file:`paged_attention.cpp`): PyTorch's
CPU SDPA needs each sequence's keys contiguous, so a decode step over long contexts gathers
its whole KV (a copy as large as what it reads) and reads it again. Measured on 2 Sapphire
Rapids cores, 8 sequences of about 1.8k tokens, SmolLM2's 30 layers: the gather and SDPA
took 85-95 ms a step, where reading the KV once costs about 16 ms (``results/cpu-attention/``).
The kernel reads K and V in place, once each. For bfloat16 caches with 64-dim heads on CPUs
with AMX it scores 16 keys against every query vector of a group in one tile product
(``paged_attention_uses_amx()`` says whether this machine does); on CPUs with AVX512-BF16 and
no AMX, groups of sequences with more than one row (ICaRus pairs) score in dot products.

It is built with ``torch.utils.cpp_extension`` (the compiler Inductor uses too) into
``$KVSHARE_HOME/ext/<source, torch and CPU digest>``, once per machine, with ``-march=native``
(hence the CPU in the digest). Where it cannot be built (no compiler), the backend is the
torch reference, with one warning. Sequences with more rows than :data:`FEW_ROWS` (prompt
chunks, compute-bound) take the kernel too in bfloat16 with 64-dim heads where the CPU has
AMX tiles or AVX512-BF16 dot products (``paged_attention_chunk_path()``: ``"amx"``,
``"avx512bf16"`` or ``""``), else SDPA.

The compiled CPU step calls the kernel through the torch op ``kvshare::step_attention_cpu``
(:file:`step_attention.cpp`), which also writes the layer's K/V, from a per-thread plan
(:class:`StepPlan`) handed over once per step. The same extension unpacks PyTorch's packed int4
weights for prompt chunks (:file:`int4_dequant.cpp`, used by :func:`kvshare.kernels.quant.int4_linear`)
and multiplies bfloat16 decode rows by weights in AVX512-BF16 dot products (:file:`linear_vnni.cpp`, the ops
``kvshare::linear_vnni`` and ``kvshare::linear_vnni_lora``, which adds each row's LoRA delta from
the slot stacks in the same pass; :mod:`.linear`), and runs ForkKV's residual attention for decode
rows, rebuilding each key where it reads it (:file:`residual_attention.cpp`, :mod:`.residual`).
The eager step's norms, RoPE and SiLU(gate) * up run fused (:file:`pointwise.cpp`, :mod:`.pointwise`).
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import shlex
import signal
import subprocess
import sys
import threading
from pathlib import Path

import torch
import torch.nn.functional as F

from ..metadata import AttentionMetadata

log = logging.getLogger(__name__)

FEW_ROWS = 16  # a sequence with more rows in a step is a prompt chunk: matrix units (tiles, dot products, SDPA) win
_SOURCES = [Path(__file__).with_name(name) for name in ("paged_attention.cpp", "step_attention.cpp", "int4_dequant.cpp",
                                                   "linear_vnni.cpp", "residual_attention.cpp", "pointwise.cpp",
                                                   "bindings.cpp")]
_lock = threading.Lock()  # held by the one build or load
_built: list = []  # [module or None] once tried
_start_lock = threading.Lock()
_background: list[threading.Thread] = []  # the background build's thread, once started
_children: list[subprocess.Popen] = []  # its build process
_children_lock = threading.Lock()  # held while a build starts, and while the exit handler stops them
_exiting = threading.Event()  # set by the exit handler: no build starts after it


def _cpu_digest() -> str:
    """What ``-march=native`` compiled for: the CPU's model and flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    lines = [line for line in text.splitlines() if line.startswith(("model name", "flags"))][:2]
    return "\n".join(lines)


def extension(wait: bool = True):
    """The built extension module, or None where it cannot be built (warned once).

    ``wait=False`` (an eager step's attention): where the extension is not built on this machine
    yet, start building it in a background process and return None now, so that a first request
    runs on the torch reference instead of waiting about a minute for the compiler; a build
    already on disk is loaded at once."""
    if _built:
        return _built[0]
    if not wait and (_background or not built_on_disk()):
        _build_in_background()  # (once)
        return None
    with _lock:
        if not _built:
            _built.append(_build())
    return _built[0]


def built_on_disk() -> bool:
    """Whether this machine's build of the extension is in kvshare's home (loads in a second)."""
    return _target(_home())[2].exists()


def building() -> bool:
    """Whether the extension is being built in the background right now."""
    thread = _background[0] if _background else None
    return thread is not None and thread.is_alive()


def _build_in_background() -> None:
    with _start_lock:
        if _background:
            return
        log.warning("kvshare: building kvshare's C++ CPU kernels in the background (about a minute, once "
                    "per machine); steps use the torch reference until they are built")
        thread = threading.Thread(target=_build_apart, name="kvshare-cpu-kernels", daemon=True)
        _background.append(thread)
        thread.start()


def _build_command() -> list[str]:
    return [sys.executable, "-c", "import kvshare.kernels.cpu as cpu; raise SystemExit(cpu.extension() is None)"]


def _build_apart() -> None:
    """The background build, in a child process of its own session, which :func:`_stop_builds`
    ends with this process: a short job leaves no compiler running behind it (ninja removes what
    it leaves half-made, and the next start builds again). A thread could not be stopped."""
    with _children_lock:  # a thread that reaches this after the exit handler ran starts nothing:
        if _exiting.is_set():  # else the build outlived a short job, holding its output pipes
            return
        child = subprocess.Popen(_build_command(), start_new_session=True, stdin=subprocess.DEVNULL)
        _children.append(child)
    if child.wait() == 0:
        extension()  # on disk now: loads at once
        return
    with _lock:  # it said why on stderr
        if not _built:
            _built.append(None)


@atexit.register
def _stop_builds() -> None:
    with _children_lock:
        _exiting.set()
    for child in _children:
        if child.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.wait(timeout=10)


def _home() -> Path:
    from ...paths import kvshare_home

    return kvshare_home()


@functools.cache
def _target(home: Path) -> tuple[str, Path, Path]:
    """The extension's module name, build folder and built file: one per source, torch and CPU."""
    sources = [path.read_text() for path in _SOURCES]
    # and where the sources and torch lie: two checkouts sharing a home wrote one build folder's
    # ninja file with their own source paths in turn, and each rebuilt the extension (75 s)
    where = (*map(str, _SOURCES), torch.__file__)
    digest = hashlib.sha256("\0".join((*sources, *where, torch.__version__, _cpu_digest())).encode()).hexdigest()[:16]
    name = f"kvshare_cpu_{digest}"
    folder = home / "ext" / f"cpu-{digest}"
    return name, folder, folder / f"{name}.so"


def _build():
    from torch.utils.cpp_extension import load

    try:  # everything, the build folder included (a read-only home): the reference serves instead
        name, folder, _ = _target(_home())
        folder.mkdir(parents=True, exist_ok=True)
        with _build_guard(folder), _quoted_torch_lib_path():
            return load(name=name, sources=[str(path) for path in _SOURCES], build_directory=str(folder),
                        extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math", "-mprefer-vector-width=512"],
                        extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as exc:  # no compiler, no ninja: the reference serves, slower
        log.warning("kvshare: the C++ CPU kernels could not be built (%s); using the torch "
                    "references", str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        return None


@contextlib.contextmanager
def _quoted_torch_lib_path():
    """torch (2.13) writes ``-L<torch/lib>`` unquoted into the ninja link command, so a venv in
    a path with spaces (``/tmp/kv ci/.venv``) fails to link; quoted for the shell, it links."""
    from torch.utils import cpp_extension

    plain = cpp_extension.TORCH_LIB_PATH
    cpp_extension.TORCH_LIB_PATH = shlex.quote(plain)
    try:
        yield
    finally:
        cpp_extension.TORCH_LIB_PATH = plain


@contextlib.contextmanager
def _build_guard(folder: Path):
    """One build or load of the extension at a time per folder, across processes, held by an
    OS lock that dies with its holder. torch's own guard is a ``lock`` file that a build killed
    half-way leaves behind, and every later process then waits on it forever; holding our lock
    proves no build runs, so such a file is stale and goes."""
    with open(folder / "kvshare-build.lock", "a") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        try:
            (folder / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(guard, fcntl.LOCK_UN)


def available() -> bool:
    return extension() is not None


class Layout:
    """A step's query rows as the kernel takes them (worked out once per step, shared by every
    layer): each row's key count, the sequences it computes, and those left to SDPA."""

    def __init__(self, meta: AttentionMetadata, rows: int | None = None):
        device = meta.positions.device
        rows = len(meta.positions) if rows is None else rows
        self.row_lens = (meta.positions[:rows] + 1).to(torch.int32)
        few = [end - start <= FEW_ROWS for start, end in meta.seq_bounds]
        self.large = [s for s, is_few in enumerate(few) if not is_few]
        self.seqs = torch.tensor([s for s, is_few in enumerate(few) if is_few], dtype=torch.int32, device=device)
        self.every_seq = torch.arange(len(few), dtype=torch.int32, device=device)  # chunks in the kernel too
        self.starts, self.tables = meta.query_start_loc, meta.block_tables  # int32, contiguous (the kernel checks)


def chunks_in_kernel(q: torch.Tensor) -> bool:
    """:func:`chunk_kernel_takes` for ``q``'s dtype and head size."""
    return chunk_kernel_takes(q.dtype, q.shape[-1])


def chunk_kernel_takes(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the kernel runs prompt chunks of this dtype and head size, both the scores and
    the weighted values: bfloat16 with 64-dim heads, on AMX tiles or else in AVX512-BF16 dot
    products. Measured on 2 Sapphire Rapids cores, 30 layers: a 60-row chunk after 1.5k cached
    keys took 20 ms on tiles against 32 ms for SDPA, a 1,024-row causal prompt 89 against 103 ms
    (results/cpu-attention/session19/chunk_sweep.md). On 2 AMD EPYC cores (AVX512-BF16, no AMX),
    where SDPA's CPU flash attention runs bfloat16 no faster than float32: see
    results/cpu-attention/session20/."""
    ext = extension()
    return dtype == torch.bfloat16 and head_dim == 64 and ext.paged_attention_chunk_path() != ""


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, layout: Layout, meta: AttentionMetadata,
           scale: float, out: torch.Tensor) -> torch.Tensor:
    """Fill ``out`` (like ``q``) with the attention of the step's rows over the paged cache:
    few-row sequences by the kernel; prompt chunks by the kernel where it runs them
    (:func:`chunks_in_kernel`), else by SDPA over their gathered keys."""
    seqs, large = (layout.every_seq, ()) if layout.large and chunks_in_kernel(q) else (layout.seqs, layout.large)
    if len(seqs):
        extension().paged_attention(q, k_cache, v_cache, layout.tables, layout.starts, layout.row_lens, seqs,
                                    scale, out)
    for s in large:
        start, end = meta.seq_bounds[s]
        length = meta.seq_context[s]
        table = meta.block_tables[s, :(length + k_cache.shape[1] - 1) // k_cache.shape[1]].long()
        keys = k_cache.index_select(0, table).flatten(0, 1)[:length].transpose(0, 1).unsqueeze(0)
        values = v_cache.index_select(0, table).flatten(0, 1)[:length].transpose(0, 1).unsqueeze(0)
        query = q[start:end].transpose(0, 1).unsqueeze(0)
        mask = None
        if not meta.seq_causal[s]:
            positions = meta.positions[start:end]
            mask = (torch.arange(length, device=q.device)[None, :] <= positions[:, None])[None, None]
        attn = F.scaled_dot_product_attention(query, keys.to(q.dtype), values.to(q.dtype), attn_mask=mask,
                                              scale=scale, is_causal=meta.seq_causal[s],
                                              enable_gqa=q.shape[1] != k_cache.shape[2])
        out[start:end] = attn[0].transpose(0, 1)
    return out


_last: tuple = (None, None)  # (meta, its Layout): every layer of an eager step asks for the same


def paged_attention_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                        scale: float) -> torch.Tensor:
    """Backend "cpu" of ``paged_attention``: the reference's contract, on CPU tensors of one dtype."""
    global _last
    from ..attention import paged_attention_ref

    if q.device.type != "cpu" or k_cache.dtype != q.dtype or extension(wait=False) is None:
        return paged_attention_ref(q, k_cache, v_cache, meta, scale)
    last = _last  # read once: engines stepped from two threads each replace it
    layout = last[1] if last[0] is meta else Layout(meta)
    _last = (meta, layout)
    return attend(q, k_cache, v_cache, layout, meta, scale, torch.empty_like(q))


class StepPlan:
    """A compiled step's rows as ``kvshare::step_attention_cpu`` (:file:`step_attention.cpp`) takes
    them, handed to the extension once per step (:meth:`begin`) rather than once per layer: the
    rows that write and their slots, and :class:`Layout`'s index tensors. Every sequence runs in
    the kernel: a graph takes this op only where no prompt chunk would need SDPA (``chunks``:
    the kernel runs them; else its buckets have at most :data:`FEW_ROWS` rows)."""

    def __init__(self, meta: AttentionMetadata, rows: int, chunks: bool):
        layout = Layout(meta, rows)
        if layout.large and not chunks:
            raise ValueError(f"a step of {rows} rows has prompt chunks the kernel does not run here")
        self.seqs = layout.every_seq if layout.large else layout.seqs
        self.layout, self.rows = layout, rows
        self.write_rows = meta.write_rows
        self.write_slots = meta.slot_mapping.index_select(0, meta.write_rows)

    def begin(self, kv_cache: torch.Tensor, scale: float) -> None:
        """Make this the plan of the step the calling thread runs next (until :func:`end_step`)."""
        layout = self.layout
        extension().step_attention_begin(kv_cache, self.write_rows, self.write_slots, layout.tables, layout.starts,
                                         layout.row_lens, self.seqs, scale, self.rows)


def end_step() -> None:
    """Drop the calling thread's plan (its tensors are the step's)."""
    extension().step_attention_end()


@functools.cache
def register_step_op() -> None:
    """Give ``kvshare::step_attention_cpu`` (defined in C++ by the extension) its fake (shape)
    function for tracing, once per process."""
    if extension() is None:
        raise RuntimeError("the C++ CPU kernels could not be built here")
    torch.library.register_fake("kvshare::step_attention_cpu")(lambda q, k, v, layer: torch.empty_like(q))
