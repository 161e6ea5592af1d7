"""The compiled CPU step: the whole decoder, per batch-size bucket, through torch.compile.

On a 2-core CPU a decode step is 70% dense projections, and ``F.linear`` reads a weight at
about a third of the memory bandwidth for one to a few rows. Inductor with frozen weights
and its C++ GEMM template (``max_autotune``) packs each weight once into a layout its
micro-kernel streams, and fuses the small per-layer ops (RMSNorm, RoPE, SiLU * up, the
residual adds) into a few loops; the Python cost of 30 layers' ops goes too. Measured on
a 30-layer stack of SmolLM2's projections: 2.4x at one row, 3.3x at two rows.

What torch.compile cannot trace stays eager, behind an opaque custom op that reads the
step's structure from a thread-local context: writing KV and paged attention (a flat batch
of many sequences, with host-side lists; what every layer shares is worked out once per
step, :mod:`kvshare.kernels.step_attention`). Where the C++ attention runs, the op is C++ too
(``kvshare::step_attention_cpu``, :func:`native_rows`), its plan handed over once per step:
the Python op cost 41-43 us a layer around a 13 us kernel
(results/engine-cpu-bf16/session31-spr/op_parts.txt). The adapters' LoRA deltas run inside the
graph, from slot stacks that are graph inputs (:mod:`.lora_slots`): adapters come and go at
run time without a recompile. The graph has static shapes: a step's rows are padded up to
a bucket (1, 2, 4, 8 or 16 rows; up to 128 with ``compile_max_rows``, so that a short prompt
chunk, an agent turn's new tokens, runs in one graph with the decode rows beside it); pad rows
run the dense math on token 0 and are never written to the cache nor read back. Larger steps
(prefill chunks, compute-bound) and
anything unusual (ForkKV rows, a layer-streaming cache, hidden-state capture, a non-torch
linear backend, an adapter outside the slot stacks) run the eager forward. Inductor's
on-disk caches live under ``$KVSHARE_HOME/compile`` (unless ``TORCHINDUCTOR_CACHE_DIR`` is
set): its C++ kernels, autotuning choices and, keyed by a digest of the weights' bytes
(:mod:`.graph_cache`), the lowered graphs themselves, so a later process on the same
weights loads each bucket's graph instead of lowering it again.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import threading
import time
import weakref
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from tqdm import tqdm

from ...errors import KvshareError
from ...hardware import cpu_has_fast_bf16
from ...kernels import build_attention_metadata, cpu
from ...kernels.cpu import linear as cpu_linear
from ...kernels.quant import Int4Weight, Int8Weight
from ...kernels.step_attention import StepAttention, layer_rows
from ...paths import kvshare_home
from .adapters import AdapterSet
from .background_compile import compile_worker
from .batch import Batch
from ..config import DEFAULT_COMPILE_MAX_ROWS
from .fresh_stack import call_in_fresh_chunk
from .graph_cache import WeightsKey, cache_frozen_graphs, weights_digest
from .lora_slots import PARTS, lora_delta
from ...kernels.pointwise import TorchPointwise
from .model import Model
from .shared_constants import graph_modules, return_freed_memory, share_constants
from .step_buckets import BucketedStep, StepUnavailable

log = logging.getLogger(__name__)

MODES = ("auto", "on", "off")
INDUCTOR_OPTIONS = {"max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN",
                    "autotune_num_choices_displayed": 0, "max_autotune_report_choices_stats": False}  # quiet
# The graph with adapters is called from C++ (Inductor's ``cpp_wrapper``): its Python ``call()``
# spent about 1.4 ms of a 22 ms batch-1 ICaRus pair step calling the LoRA matmuls and the op
# (1.16x a base step; 1.10x from C++, results/engine-cpu-bf16/session18). The base graph gains
# nothing measurable there, and a C++ wrapper costs about 25% more to compile on a cache miss.
GRAPH_OPTIONS = {adapted: {**INDUCTOR_OPTIONS, "cpp_wrapper": adapted} for adapted in (False, True)}
# every bucket, variant and engine of the process is a recompile of the same code (Dynamo's
# defaults, 8 and 256, made a server's ninth graph fail after the first eight had been paid for)
RECOMPILE_LIMITS = {"recompile_limit": 1024, "accumulated_recompile_limit": 8192}
_PROJECTIONS = ("_qkv", "_o", "_gate_up", "_down")  # the weights ``_linear`` multiplies by
_LAYER_KEYS = ("input_norm", "post_norm", "qkv", "qkv_bias", "o", "gate_up", "down", "q_norm", "k_norm")

_step = threading.local()  # the running step's context, read by the opaque op
# Dynamo's stance (which guards a call runs) is process-wide (its and Inductor's configs are per
# thread): whoever sets it holds this lock, so that a compile (a first call, on an engine's
# thread or the background worker) never runs on another call's reduced guards. A call of a
# graph already compiled that finds the lock taken leaves the stance alone: full guards.
_stance_lock = threading.Lock()

# The op is declared without mutated arguments: the KV memory it writes is not a graph input,
# and nothing in the graph reads it but the same op of the same layer, after its write.


class _StepContext:
    __slots__ = ("model", "kv_cache", "batch", "rows", "layer_rows", "attention", "plan")

    def __init__(self, model: Model, kv_cache: torch.Tensor, batch: Batch, rows: int,
                 layer_rows: list[tuple[torch.Tensor, ...]], ratio: int, native: bool):
        """``native``: the graph calls ``kvshare::step_attention_cpu``, which takes the step's
        :class:`cpu.StepPlan` (``plan``); else ``kvshare::step_attention`` below."""
        self.model, self.kv_cache, self.batch, self.rows = model, kv_cache, batch, rows
        self.layer_rows = layer_rows
        self.attention, self.plan = None, None
        if native:
            self.plan = cpu.StepPlan(batch.attention, rows, cpu.chunk_kernel_takes(model.dtype, model.head_dim))
            return
        # the torch or cpu kernels' work shared by every layer, done once (another backend gets the step as it is)
        choice = model.kernels.choice
        kernel = choice["paged_attention"] == "cpu" and kv_cache.dtype == model.dtype and cpu.available()
        ours = choice["write_kv"] == "torch" and (choice["paged_attention"] == "torch" or kernel)
        self.attention = StepAttention(batch.attention, rows, ratio, kernel) if ours else None


def native_rows(model: Model) -> int:
    """Buckets up to this many rows call the C++ op ``kvshare::step_attention_cpu`` for their KV
    writes and attention (:file:`kvshare/kernels/cpu/step_attention.cpp`: no Python a layer):
    where the "cpu" attention and the torch KV write are chosen and the extension is built; every
    bucket where the kernel runs prompt chunks too, else the buckets whose sequences cannot hold a
    prompt chunk (:data:`cpu.FEW_ROWS` rows). 0: none (the Python op, whatever the backends)."""
    choice = model.kernels.choice
    if choice["paged_attention"] != "cpu" or choice["write_kv"] != "torch" or not cpu.available():
        return 0
    cpu.register_step_op()  # before a graph that calls the op is traced or loaded from the cache
    return sys.maxsize if cpu.chunk_kernel_takes(model.dtype, model.head_dim) else cpu.FEW_ROWS


@torch.library.custom_op("kvshare::step_attention", mutates_args=())
def step_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    """Write the real rows' K/V of ``layer`` and attend over the paged cache (eager kernels)."""
    s = _step.context
    if s.attention is not None:
        k_rows, v_rows, k_blocks, v_blocks = s.layer_rows[layer]
        return s.attention(q, k, v, k_rows, v_rows, s.model.scale, k_blocks, v_blocks)
    model, meta, n = s.model, s.batch.attention, s.rows
    k_cache, v_cache = s.kv_cache[:, layer, 0], s.kv_cache[:, layer, 1]
    kernels = model.kernels
    kernels.write_kv(k_cache, v_cache, k[:n], v[:n], meta.slot_mapping, meta.write_rows)
    out = kernels.paged_attention(q[:n], k_cache, v_cache, meta, model.scale)
    if n == q.shape[0]:
        return out
    return torch.cat([out, out.new_zeros(q.shape[0] - n, *out.shape[1:])])


@step_attention.register_fake
def _(q, k, v, layer):
    return torch.empty_like(q)


class VnniWeight(NamedTuple):
    """A bfloat16 weight and its copy in the dot-product kernel's order (:mod:`kvshare.kernels.cpu.linear`)."""
    plain: torch.Tensor
    packed: torch.Tensor


class OneDnnWeight(NamedTuple):
    """A float32 weight and its one copy in oneDNN's blocked order (:func:`packs_float32`)."""
    plain: torch.Tensor
    packed: torch.Tensor


UNPACKED_INT8 = ("the compiled step takes int8 weights of bfloat16 models whose input size is a multiple of 16; "
                 "run this one with --compile off")


def packs_float32(model: Model) -> bool:
    """Whether the float32 graphs multiply the projections by one oneDNN-packed copy of each
    weight, made once per engine: ``KVSHARE_CPU_GEMM=onednn``, the lowest peak while compiling.
    Else Inductor's GEMM template packs the weights, one copy kept for every graph
    (:mod:`.shared_constants`), which it needs for its speed below 16 rows. Measured on 2 AMD
    EPYC cores (AVX512-BF16), SmolLM2-135M in float32, template against the oneDNN copy: 29
    against 26 tok/s at 1 row, 92 against 66 at 4, 145 against 127 at 8, 193 against 200 at 16;
    peak RSS with the five buckets 3.1 GB against 2.1 GB (results/compiled-memory/)."""
    return (model.dtype == torch.float32 and cpu_linear.gemm_choice() == "onednn"
            and torch.backends.mkldnn.is_available())


def gemm_options(model: Model) -> dict:
    """Inductor options for the projections. ``onednn`` (:func:`packs_float32`): no autotuning,
    which would put the template in the running and pack a copy anyway. Float32 on AVX-512: the
    template for every bucket, ATen's GEMM out of the running: autotuning picked ATen's
    MKL-packed GEMM at 16 rows, which packed that graph a 1.4 GB copy of SmolLM2's 0.4 GB of
    projections and decoded slower end to end (140 against 193 tok/s, AMD EPYC AVX512-BF16,
    results/compiled-memory/); the template's copies are alike in every bucket, so they are
    kept once (:mod:`.shared_constants`). Elsewhere (AVX2 only, not measured) autotuning picks."""
    if packs_float32(model):
        return {"max_autotune": False}
    if model.dtype == torch.float32 and torch.backends.cpu.get_cpu_capability() == "AVX512":
        return {"max_autotune_gemm_backends": "CPP"}
    return {}


@contextmanager
def _freed_at_compile_end():
    """Free a compile's garbage as Dynamo's compile ends, before the new graph first runs (and
    pages in its packed constants): the frozen graph and the weights freezing prepacked for it
    would otherwise still be in memory then, at the start's peak."""
    handler = torch._dynamo.callback_handler
    callback = lambda args: return_freed_memory()  # noqa: E731
    handler.register_end_callback(callback)
    try:
        yield
    finally:
        handler.remove_end_callback(callback)


def _linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``; for a :class:`VnniWeight`, up to ``cpu_linear.MAX_ROWS`` rows (a decode
    bucket; the shapes are static) in AVX512-BF16 dot products; for an int8 weight (a (q, scale)
    pair) PyTorch's weight-only int8 product, which Inductor lowers to its C++ int8 GEMM template (the weight read as int8, a quarter of
    float32's bytes, dequantised in registers); for an int4 weight (packed, scales and zeros,
    group) its int4 product, which Inductor lowers to its WOQ int4 GEMM template."""
    if not isinstance(weight, tuple):
        return F.linear(x, weight, bias)
    if isinstance(weight, OneDnnWeight):
        return torch.ops.mkldnn._linear_pointwise(x, weight.packed, bias, "none", [], "")
    if isinstance(weight, VnniWeight):
        if x.numel() // x.shape[-1] <= cpu_linear.MAX_ROWS:
            return torch.ops.kvshare.linear_vnni(x, weight.packed, bias)
        return F.linear(x, weight.plain, bias)
    rows = x.reshape(-1, x.shape[-1])
    if len(weight) == 3:
        packed, scales_zeros, group = weight
        y = torch._weight_int4pack_mm_for_cpu(rows.contiguous(), packed, group, scales_zeros)
    else:
        q, scale = weight
        y = torch._weight_int8pack_mm(rows, q, scale)
    y = y.reshape(*x.shape[:-1], -1)
    return y if bias is None else y + bias


class _Decoder(torch.nn.Module):
    """The model's weights as parameters of one module (so Inductor freezes and packs them) and
    its forward over padded rows: embedding, every layer, final norm (the head runs after the
    graph, on the logit rows: :meth:`CompiledStep._head`). An int8 weight
    (:class:`~kvshare.kernels.quant.Int8Weight`) becomes two parameters, its int8 rows and scales;
    an int4 one (:class:`~kvshare.kernels.quant.Int4Weight`) its packed groups and their scales and zeros."""

    def __init__(self, model: Model, adapted: bool, packed: dict[str, torch.Tensor], native: int):
        """``packed``: weights already in the dot-product kernel's order, by name, shared by the
        graphs with and without adapters (filled by whichever is made first); ``native``:
        :func:`native_rows`."""
        super().__init__()
        self.model = model
        self.native = native
        self.packed = packed
        self.adapted = adapted  # this graph adds LoRA deltas from the slot stacks (steps with adapters) or not
        self.int4_groups: dict[str, int] = {}  # int4 weights' group sizes, by weight name
        self.vnni = cpu_linear.wanted()  # projections of decode buckets in dot products (bfloat16 weights)
        self.onednn = packs_float32(model)  # float32 projections by one shared packed copy of each weight
        for name in ("embed", "final_norm"):  # the head runs after the graph, on the logit rows only
            self._weight(name, getattr(model, name))
        self.present: list[tuple[str, ...]] = []
        for i, layer in enumerate(model.layers):
            names = tuple(key for key in _LAYER_KEYS if layer[key] is not None)
            for key in names:
                self._weight(f"l{i}_{key}", layer[key])
            self.present.append(names)

    def _weight(self, name: str, value) -> None:
        """Register ``value`` (same storage) as parameter ``name``, or an int8 weight as two."""
        param = lambda t: torch.nn.Parameter(t, requires_grad=False)  # noqa: E731
        if isinstance(value, Int8Weight):
            if not value.packed_kernel:
                raise KvshareError(UNPACKED_INT8)
            setattr(self, f"{name}_q", param(value.q))
            setattr(self, f"{name}_scale", param(value.scale))
        elif isinstance(value, Int4Weight):
            setattr(self, f"{name}_q4", param(value.packed))
            setattr(self, f"{name}_sz", param(value.scales_zeros))
            self.int4_groups[name] = value.group
        else:
            setattr(self, name, param(value))
            if self.vnni and name.endswith(_PROJECTIONS) and cpu_linear.packable(value):
                if name not in self.packed:
                    self.packed[name] = cpu_linear.pack(value)
                setattr(self, f"{name}_vnni", param(self.packed[name]))
            elif self.onednn and name.endswith(_PROJECTIONS) and value.dtype == torch.float32 and value.dim() == 2:
                if name not in self.packed:  # packed for one row: the layout every row count runs fastest on
                    self.packed[name] = torch.ops.mkldnn._reorder_linear_weight(value, 1)
                setattr(self, f"{name}_onednn", param(self.packed[name]))

    def _param(self, name: str):
        """What ``_linear`` takes for weight ``name``: the parameter, a :class:`VnniWeight`, an
        int8 (q, scale) pair or an int4 (packed, scales and zeros, group) triple."""
        if hasattr(self, f"{name}_q"):
            return getattr(self, f"{name}_q"), getattr(self, f"{name}_scale")
        if name in self.int4_groups:
            return getattr(self, f"{name}_q4"), getattr(self, f"{name}_sz"), self.int4_groups[name]
        if hasattr(self, f"{name}_vnni"):
            return VnniWeight(getattr(self, name), getattr(self, f"{name}_vnni"))
        if hasattr(self, f"{name}_onednn"):
            return OneDnnWeight(getattr(self, name), getattr(self, f"{name}_onednn"))
        return getattr(self, name)

    def _layers(self) -> list[dict]:
        return [{key: self._param(f"l{i}_{key}") if key in names else None for key in _LAYER_KEYS}
                for i, names in enumerate(self.present)]

    def _run(self, tokens: torch.Tensor, positions: torch.Tensor, project) -> torch.Tensor:
        m = self.model
        h = F.embedding(tokens, self.embed)
        cos, sin = m.rope(h, positions)
        op = torch.ops.kvshare.step_attention_cpu if len(tokens) <= self.native else torch.ops.kvshare.step_attention
        attend = lambda i, q, k, v, x: op(q, k, v, i)  # noqa: E731
        h = m.decoder(h, cos, sin, self._layers(), project, attend)
        return TorchPointwise.rms_norm(h, self.final_norm, m.eps)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, *lora: torch.Tensor) -> torch.Tensor:
        """``lora`` (the graph with adapters): each row's slot and scale, then the slot stacks
        (:meth:`LoraSlots.inputs`)."""
        if not self.adapted:
            return self._run(tokens, positions, lambda i, fused, x, weight, bias=None: _linear(x, weight, bias))
        index, scale, *stacks = lora
        weights = dict(zip(PARTS, zip(stacks[0::2], stacks[1::2])))

        def project(i: int, fused: str, x: torch.Tensor, weight, bias=None) -> torch.Tensor:
            parts, offset, adapted = self.model.fused[fused], 0, []  # (name, first column) of each part adapted
            for name, size in parts:
                if weights[name][0].shape[-2] > 0:
                    adapted.append((name, offset))
                offset += size
            if not adapted:
                return _linear(x, weight, bias)
            blocks = all(first % 16 == 0 and weights[name][1].shape[-1] % 16 == 0 for name, first in adapted)
            if isinstance(weight, VnniWeight) and x.shape[0] <= cpu_linear.MAX_ROWS and blocks:
                # the deltas in the projection's own pass (one op; rows of scale 0 skip them)
                return torch.ops.kvshare.linear_vnni_lora(  # registered by cpu_linear.wanted()
                    x, weight.packed, bias, [weights[name][0][i] for name, _ in adapted],
                    [weights[name][1][i] for name, _ in adapted], [first for _, first in adapted], index, scale)
            deltas = [lora_delta(x, weights[name][0][i], weights[name][1][i], index, scale) for name, _ in parts]
            delta = torch.cat(deltas, -1) if len(deltas) > 1 else deltas[0]  # float32: one rounding below
            y = _linear(x, weight, bias)
            # delta first: Inductor's freezing pass folds ``linear(...) + t`` into the linear's bias
            # assuming it packed the weight itself, which fails on the shared oneDNN copy
            return (delta + y.to(delta.dtype)).to(y.dtype)

        return self._run(tokens, positions, project)


def resolve_mode(mode: str) -> str:
    """``--compile`` as given, or for ``auto`` what ``KVSHARE_COMPILE`` says (the test suite
    sets it to off, to keep its time)."""
    if mode not in MODES:
        raise KvshareError(f"compile must be one of {', '.join(MODES)}, not {mode!r}")
    if mode == "auto":
        mode = os.environ.get("KVSHARE_COMPILE", "auto")
        if mode not in MODES:
            raise KvshareError(f"KVSHARE_COMPILE must be one of {', '.join(MODES)}, not {mode!r}")
    return mode


def unpacked_int8(model: Model) -> bool:
    """Whether an int8 weight of ``model`` lacks the packed kernel the compiled step takes (an
    input size not a multiple of 16): ``auto`` then runs eager, ``on`` is refused."""
    return any(isinstance(w, Int8Weight) and not w.packed_kernel for layer in model.layers for w in layer.values())


def inductor_cache_dir() -> Path:
    """Where Inductor writes the step's graphs: the user's ``TORCHINDUCTOR_CACHE_DIR``, else
    under kvshare's home (see :class:`CompiledStep`)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    return Path(chosen) if chosen not in (None, default_cache_dir()) else kvshare_home() / "compile"


def compiler_blocker() -> str | None:
    """Why Inductor cannot build the step here, or None. torch (2.13) passes its include and
    library folders and the cache's files to the C++ compiler unquoted, so any of them in a path
    with white space (a venv in ``/tmp/kv ci``) fails every graph's compile."""
    from torch.utils.cpp_extension import TORCH_LIB_PATH, include_paths

    for path in (*include_paths(), TORCH_LIB_PATH, str(inductor_cache_dir())):
        if any(char.isspace() for char in path):
            return f"torch's compiler cannot build in a path with spaces ({path!r})"
    return None


@functools.cache
def _warn_eager(reason: str) -> None:
    log.warning("kvshare: the compiled CPU step is off: %s; steps run eager", reason)


def compile_wanted(mode: str, device: torch.device, dtype: torch.dtype, kernels) -> bool:
    """Whether an engine runs the compiled step: ``on`` asks for it (an error where it cannot
    run), ``auto`` takes it on CPU in float32 with the torch linear backend, and in bfloat16
    (torch, int8 or int4 weights) where the CPU has bfloat16 instructions; ``off`` never.
    ``KVSHARE_COMPILE=off`` turns ``auto`` off (the test suite does, to keep its time)."""
    linear = kernels.choice["linear"]
    mode = resolve_mode(mode)
    if mode == "auto":
        wanted = device.type == "cpu" and (
            (dtype == torch.float32 and linear == "torch")
            or (dtype == torch.bfloat16 and linear in ("torch", "int8", "int4") and cpu_has_fast_bf16()))
        blocker = compiler_blocker() if wanted else None
        if blocker:
            _warn_eager(blocker)
        if device.type == "cpu" and linear in ("int8", "int4") and dtype == torch.float32:
            better = ("--dtype bfloat16 with them" if cpu_has_fast_bf16()
                      else "float32 with the default kernels (this CPU has no bfloat16 instructions)")
            _warn_eager(f"{linear} weights go through it with bfloat16 activations only, and run several times "
                        f"slower eager; {better} runs compiled")
        return wanted and blocker is None
    if mode != "on" or device.type != "cpu":  # on a GPU, "on" asks for CUDA graphs (:mod:`.cuda_graphs`)
        return False
    if compiler_blocker():
        raise KvshareError(f"the compiled step cannot run here: {compiler_blocker()}")
    if linear not in ("torch", "int8", "int4"):
        raise KvshareError(f"the compiled step packs the weights itself; it does not combine with the "
                           f"{linear!r} linear backend")
    if linear in ("int8", "int4") and dtype != torch.bfloat16:
        raise KvshareError(f"the compiled step takes {linear} weights with bfloat16 activations (--dtype bfloat16)")
    return True


class CompiledStep(BucketedStep):
    """One engine's compiled decoder: a graph per (bucket, with or without LoRA), compiled on
    first use in each process (or ahead, by :meth:`warm_up`)."""

    def __init__(self, model: Model, max_rows: int = DEFAULT_COMPILE_MAX_ROWS, max_loras: int = 8,
                 max_lora_rank: int = 64, background: bool = False):
        import torch._dynamo
        import torch._inductor.config

        # Inductor writes its default into the environment when first asked; only a user's own
        # choice is kept
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(inductor_cache_dir())

        super().__init__(model, max_rows, max_loras, max_lora_rank)
        if unpacked_int8(model):  # refused at start, not at the first compile
            raise KvshareError(UNPACKED_INT8)
        self._parts: tuple | None = None  # (native rows, graphs, packed head): :meth:`_prepare`
        self._parts_lock = threading.Lock()
        self._head_rows = cpu_linear.head_rows()
        self.traced: set[tuple[int, bool]] = set()  # (bucket, adapted) compiled so far
        self._weights_key: WeightsKey | None = None  # made at the first compile (hashing the weights)
        self._layer_rows: tuple = (None, [], 0)  # (KV memory, its per-layer slot views, ratio)
        self.shared_bytes = 0  # packed constants of new graphs pointed at an earlier graph's equal ones
        self.recompiles = 0  # graphs compiled for a bucket already compiled (a guard failed): should stay 0
        # background: a bucket without its graph runs eager while the graph is lowered on the
        # process's compile worker (:mod:`.background_compile`); else the step compiles it first
        self.background = background
        self._generation = 0  # bumped when the stacks are reallocated: a graph lowered for the old ones is dropped

    def _prepare(self) -> tuple[int, dict[bool, Callable], torch.Tensor | None]:
        """The graphs (not compiled yet) and the packed head, made at the first compile rather
        than with the engine: they need the C++ CPU kernels, which a first start on a machine
        builds in the background (:func:`kvshare.kernels.cpu.extension`) while steps run eager."""
        with self._parts_lock:
            if self._parts is None:
                model, packed = self.model, {}
                native = native_rows(model)
                graphs = {adapted: torch.compile(_Decoder(model, adapted, packed, native).eval(), fullgraph=True,
                                                 dynamic=False, options={**GRAPH_OPTIONS[adapted], **gemm_options(model)})
                          for adapted in (False, True)}
                head = model.lm_head  # in dot products for up to head_rows() rows wherever that kernel runs
                head_packed = cpu_linear.pack(head) if cpu_linear.packable(head) and cpu_linear.head_wanted() else None
                self._parts = (native, graphs, head_packed)
            return self._parts

    def forget_adapted(self) -> None:
        self._generation += 1
        self.traced = {key for key in self.traced if not key[1]}

    def graph_ready(self, size: int, adapted: bool, kv_cache: torch.Tensor) -> bool:
        """Whether a step of bucket ``size`` runs the graph now. In the background mode a graph
        not lowered yet is queued on the compile worker and the step runs eager."""
        if (size, adapted) in self.traced or not self.background:
            return True
        step, memory, generation = weakref.ref(self), weakref.ref(kv_cache), self._generation

        def build() -> None:  # held weakly: the job of an engine dropped meanwhile is skipped
            alive, kv = step(), memory()
            if alive is not None and kv is not None:
                alive._lower(size, adapted, kv, generation)

        compile_worker().submit(f"{id(self)}:{size}:{adapted}:{generation}", build)
        return False

    def _lower(self, size: int, adapted: bool, kv_cache: torch.Tensor, generation: int) -> None:
        """The worker's job: compile one graph with a step of no real rows, then let steps use it."""
        if generation != self._generation or self.unavailable is not None:
            return  # the stacks changed since it was queued: a step queues it again
        log.warning("kvshare: compiling the CPU step for %d rows%s in the background; steps of that size "
                    "run eager until it is ready", size, " with adapters" if adapted else "")
        start = time.perf_counter()
        tokens, positions, batch, lora = self._dummy_step(size, adapted, kv_cache.device)
        try:
            self._run(size, tokens, positions, lora, self._context(kv_cache, batch, 0, size), first=True)
        except StepUnavailable:
            return
        if generation == self._generation:
            self.traced.add((size, adapted))
            log.warning("kvshare: the CPU step for %d rows%s is compiled (%.0f s); steps of that size run it",
                        size, " with adapters" if adapted else "", time.perf_counter() - start)

    @torch.no_grad()
    def forward(self, batch: Batch, kv_cache: torch.Tensor) -> torch.Tensor:
        """Float32 logits of the batch's logit rows, as :meth:`Model.forward` gives them (for a
        batch :meth:`handles`)."""
        rows = len(batch.tokens)
        size = self.bucket(rows)
        tokens, positions = batch.tokens, batch.attention.positions
        if size > rows:
            pad = size - rows
            tokens = torch.cat([tokens, tokens.new_zeros(pad)])
            positions = torch.cat([positions, positions.new_zeros(pad)])
        lora = ()
        if batch.lora_groups:
            lora = (*self.lora.row_inputs(batch.lora_groups, size, tokens.device), *self.lora.inputs())
        first = (size, bool(lora)) not in self.traced  # only without the background worker
        if first:
            log.warning("kvshare: compiling the CPU step for %d rows%s (about a minute; cached for these weights)",
                        size, " with adapters" if lora else "")
            self.traced.add((size, bool(lora)))
        hidden = self._run(size, tokens, positions, lora, self._context(kv_cache, batch, rows, size), first)
        self.steps += 1
        return self._head(hidden.index_select(0, batch.logit_rows))

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits of the logit rows' final hidden states. Outside the graph, so that only
        the rows sampled from are scored: a bucket's pad rows, prompt-chunk rows and ICaRus base
        rows would otherwise each multiply by the head, the largest weight of a small model."""
        head_packed = self._prepare()[2]
        if head_packed is not None and len(hidden) <= self._head_rows:
            return torch.ops.kvshare.linear_vnni(hidden, head_packed, None).float()
        return self.model.head(hidden)

    @torch.no_grad()  # graphs are frozen for inference; a graph traced with grad on would not be
    def _run(self, size: int, tokens: torch.Tensor, positions: torch.Tensor, lora: tuple[torch.Tensor, ...],
             context: _StepContext, first: bool) -> torch.Tensor:
        """Call the graph; ``first``: compile it (holding the process's stance lock)."""
        from torch._dynamo.utils import counters

        adapted = bool(lora)
        owned = _stance_lock.acquire(blocking=first)  # a compiled graph beside a compile: full guards
        graphs = counters["stats"]["unique_graphs"]
        loaded = {id(m) for m in graph_modules()} if first else set()
        _step.context = context
        try:
            if context.plan is not None:  # the C++ op's plan for this step, on this thread
                context.plan.begin(context.kv_cache, self.model.scale)
            # freezing is read where torch.compile's options are not; set on every call, so that
            # any recompile freezes too (and is keyed by these weights in the on-disk cache).
            # From a fresh data-stack chunk: else the op's frames may map a chunk per layer (fresh_stack).
            # A graph traced before is called with Dynamo's differentiating guards only: its full
            # guards check each of SmolLM2's 302 weight tensors, 0.6 ms of a 9 ms batch-1 step. Those left
            # tell apart every variant seen (bucket, stack shapes, engine); a variant not seen
            # yet, or stacks reallocated (``traced`` forgets the graphs with adapters), runs
            # them all (``first``).
            with ExitStack() as settings:
                if owned:  # (Dynamo's and Inductor's configs are per thread: set where the compile runs)
                    settings.enter_context(torch._dynamo.config.patch(RECOMPILE_LIMITS))
                    settings.enter_context(torch._inductor.config.patch(freezing=True,
                                                                        post_grad_custom_post_pass=self._key()))
                    settings.enter_context(torch.compiler.set_stance(skip_guard_eval_unsafe=not first))
                if first:  # the compile's garbage goes before the new graph first runs
                    settings.enter_context(_freed_at_compile_end())
                hidden = call_in_fresh_chunk(self._prepare()[1][adapted], tokens, positions, *lora)
            if first:  # the new graph's packed weights: one copy with the earlier graphs' equal ones
                self.shared_bytes += share_constants([m for m in graph_modules() if id(m) not in loaded])
                return_freed_memory(collect=False)
            return hidden
        except Exception as err:
            if not first:
                raise
            self.traced.clear()  # no C++ toolchain, an op Inductor cannot build, a model we never ran
            raise self.give_up(err, "compiling the CPU step") from err
        finally:
            _step.context = None
            if context.plan is not None:
                cpu.end_step()
            # (only with the lock held: else the worker may be compiling another graph meanwhile)
            if owned and not first and counters["stats"]["unique_graphs"] != graphs:
                self.recompiles += 1
                log.warning("kvshare: the CPU step for %d rows was compiled again (a guard failed)", size)
            if owned:
                _stance_lock.release()

    def _key(self) -> WeightsKey | None:
        if self._weights_key is None and cache_frozen_graphs():
            weights = self._prepare()[1][False].named_parameters()  # (a oneDNN copy: digested as its weight)
            self._weights_key = WeightsKey(weights_digest([(n, t) for n, t in weights if t.layout == torch.strided]))
        return self._weights_key

    def warm_up(self, kv_cache: torch.Tensor, sizes: tuple[int, ...] | None = None, adapted: bool = False,
                adapters: AdapterSet | None = None) -> None:
        """Compile the given buckets now (default: all), the graph for steps without adapters or
        (``adapted``) with, so that no request waits for a compile. The warm-up step has no real
        rows: nothing is written or read. The graph with adapters is compiled for slot stacks of
        the current rank (at least the smallest) and the projections ``adapters`` adapts (every
        projection where none is loaded): adapters of a higher rank, or of a projection not yet
        adapted, compile it again."""
        todo = [size for size in (sizes or self.buckets) if (size, adapted) not in self.traced]
        if adapted and todo:
            # the stacks and projections of the adapters loaded, or, with none, every projection
            changed = self.lora.sync(adapters) if adapters is not None else False
            changed = self.lora.allocate() or changed
            changed = (not self.lora.parts and self.lora.adapt_parts(set(PARTS))) or changed
            if changed:
                self.forget_adapted()
        if self.unavailable is not None:  # a compile failed (logged): the engine serves eager
            return
        for size in tqdm(todo, desc="compile CPU step", unit="graph", disable=not todo):
            tokens, positions, batch, lora = self._dummy_step(size, adapted, kv_cache.device)
            self.traced.add((size, adapted))
            try:
                self._run(size, tokens, positions, lora, self._context(kv_cache, batch, 0, size), first=True)
            except StepUnavailable:
                return

    def _dummy_step(self, size: int, adapted: bool, device: torch.device) -> tuple:
        """A step of ``size`` pad rows and no real ones (nothing written or read): what compiles a graph."""
        # distinct tensors: Dynamo guards on aliasing, and a step's tokens and positions never alias
        tokens, positions = (torch.zeros(size, dtype=torch.long, device=device) for _ in range(2))
        empty = build_attention_metadata([], [], [], [], 1, device)
        batch = Batch(tokens, [], empty, torch.zeros(0, dtype=torch.long), [])
        lora = (*self.lora.row_inputs([], size, device), *self.lora.inputs()) if adapted else ()
        return tokens, positions, batch, lora

    def _context(self, kv_cache: torch.Tensor, batch: Batch, rows: int, size: int) -> _StepContext:
        if size <= self._prepare()[0]:
            return _StepContext(self.model, kv_cache, batch, rows, [], 0, native=True)
        if self._layer_rows[0] is not kv_cache:  # the views are the same every step: made once per KV memory
            self._layer_rows = (kv_cache, *layer_rows(kv_cache))
        _, views, ratio = self._layer_rows
        return _StepContext(self.model, kv_cache, batch, rows, views, ratio, native=False)
