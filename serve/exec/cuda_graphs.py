"""Decode steps replayed from CUDA graphs, per row bucket: the GPU's counterpart of :mod:`.compiled`.

On a GPU a small model's decode step is bound by kernel launches, not by the GPU: on an H100
SmolLM2-135M's batch-1 step was about 4 ms of GPU work and 19-32 ms of wall time, some 1,100
launches from Python, and an ICaRus pair step paid 240 more for its LoRA (1.82x a base step,
``results/engine-gpu``). vLLM's answer, and ours: record each bucket's whole decoder once in a
CUDA graph and replay it, one launch from the host per step.

A graph replays fixed kernels over fixed memory, so everything a step varies lives in static
buffers that the step fills before the replay (tokens, positions, KV slots, the block tables,
where each sequence's rows start, each row's adapter slot and scale), sized for the largest
bucket and shared by every graph. Pad rows write no KV (slot -1) and belong to no sequence;
pad sequences have no rows; programs of the attention grid past a step's sequences return at
once (:class:`~kvshare.kernels.triton.attention.AttentionLaunch`, fixed per graph). Adapters come
from the slot stacks (:mod:`.lora_slots`), rewritten in place, so loading one needs no new graph
unless the stacks grow; each row's delta is added by the BGMV kernels
(:mod:`kvshare.kernels.triton.bgmv`: for a small model one launch a fused projection, whatever
its adapted parts, where the gather form the CPU graph uses would record eight to ten a part),
or with ``KVSHARE_GRAPH_LORA=fused`` computed with the projection in its launch
(:mod:`kvshare.kernels.triton.linear_lora`).
The head runs after the replay, on the logit rows only.

A graph is recorded on first use of its (bucket, with adapters or not, rows per sequence)
key, or ahead by :meth:`GraphedStep.warm_up`; ``capture=False`` runs the same code on the same
buffers without recording, which is how the tests check it on CPU (Triton's interpreter).
"""

from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F

from ...errors import KvshareError
from .adapters import AdapterSet
from .batch import Batch
from .compiled import resolve_mode
from ..config import DEFAULT_COMPILE_MAX_ROWS
from .lora_slots import PARTS
from ...kernels.pointwise import TorchPointwise
from .model import Model
from .step_buckets import BucketedStep, StepUnavailable

log = logging.getLogger(__name__)

_FIRST_TABLE_BLOCKS = 64  # block-table columns the buffers start with; doubled when a step needs more


def _power_of_two(n: int) -> int:
    """The smallest power of two >= ``n``."""
    return 1 << max(0, n - 1).bit_length()


GRAPH_LORA_KERNELS = ("bgmv", "fused")


def graph_lora_kernel() -> str:
    """How an adapted graph step adds its rows' LoRA deltas (``KVSHARE_GRAPH_LORA``): ``bgmv``
    (default, timed on an H200 in session 27: cuBLAS's projection, then one BGMV launch for
    its adapted parts) or ``fused`` (the projection and the deltas in one Triton launch,
    :mod:`kvshare.kernels.triton.linear_lora`, for steps of at most 16 rows; tested, not yet
    timed on a GPU: ``results/engine-gpu/scripts/bgmv_sweep.py`` compares the two)."""
    kernel = os.environ.get("KVSHARE_GRAPH_LORA", "bgmv")
    if kernel not in GRAPH_LORA_KERNELS:
        raise KvshareError(f"KVSHARE_GRAPH_LORA must be one of {', '.join(GRAPH_LORA_KERNELS)}, not {kernel!r}")
    return kernel


def graphs_wanted(mode: str, device: torch.device, model: Model) -> bool:
    """Whether an engine on a GPU replays decode steps from CUDA graphs: ``auto`` and ``on`` do
    where the Triton kernels write and read the KV and the projections are plain (``--kernels
    triton``); ``on`` says why not otherwise, ``off`` never (``KVSHARE_COMPILE`` as for the CPU step)."""
    mode = resolve_mode(mode)
    if device.type != "cuda" or mode == "off":
        return False
    choice = model.kernels.choice
    why = None
    if choice["paged_attention"] != "triton" or choice["write_kv"] != "triton":
        why = "CUDA graphs need the triton attention kernels (--kernels triton)"
    elif choice["linear"] != "torch":
        why = f"CUDA graphs take the torch linear backend, not {choice['linear']!r}"
    if why is not None and mode == "on":
        raise KvshareError(why)
    return why is None


class GraphedStep(BucketedStep):
    """One engine's CUDA graphs: one per (bucket, adapted, rows per sequence), sharing the
    static input buffers and one memory pool."""

    def __init__(self, model: Model, block_size: int, max_rows: int = DEFAULT_COMPILE_MAX_ROWS,
                 max_loras: int = 8, max_lora_rank: int = 64, capture: bool = True):
        super().__init__(model, max_rows, max_loras, max_lora_rank)
        self.block_size, self.capture = block_size, capture
        self.lora_kernel = graph_lora_kernel()
        device, rows = model.embed.device, self.buckets[-1]
        self.device = device
        self.tokens = torch.zeros(rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        self.slots = torch.full((rows,), -1, dtype=torch.long, device=device)
        self.loc = torch.zeros(rows + 1, dtype=torch.int32, device=device)
        self.tables = torch.zeros(rows, _FIRST_TABLE_BLOCKS, dtype=torch.int32, device=device)
        self.index = torch.zeros(rows, dtype=torch.long, device=device)
        self.scale = torch.zeros(rows, dtype=torch.float32, device=device)
        # key -> (the graph or None when not recording, its output: final-normed hidden rows)
        self.graphs: dict[tuple[int, bool, int], tuple[torch.cuda.CUDAGraph | None, torch.Tensor | None]] = {}
        self._pool = None
        self._kv: torch.Tensor | None = None  # the KV memory the graphs were recorded over

    def forget_adapted(self) -> None:
        self.graphs = {key: entry for key, entry in self.graphs.items() if not key[1]}

    @torch.no_grad()
    def forward(self, batch: Batch, kv_cache: torch.Tensor) -> torch.Tensor:
        """Float32 logits of the batch's logit rows, as :meth:`Model.forward` gives them (for a
        batch :meth:`handles`)."""
        meta = batch.attention
        rows, size = len(batch.tokens), self.bucket(len(batch.tokens))
        most = max(end - start for start, end in meta.seq_bounds)
        key = (size, bool(batch.lora_groups), min(_power_of_two(most), size))
        self._fit(kv_cache, meta.block_tables.shape[1])
        graph, out = self._graph(key, kv_cache)  # before the inputs are filled: recording clears them
        seqs = len(meta.seq_bounds)
        self.tokens[:rows].copy_(batch.tokens)
        self.positions[:rows].copy_(meta.positions)
        self.slots[:rows].copy_(meta.slot_mapping)
        self.slots[rows:size].fill_(-1)
        self.loc[:seqs + 1].copy_(meta.query_start_loc)
        self.loc[seqs + 1:size + 1].fill_(rows)  # pad sequences: no rows
        self.tables[:seqs, :meta.block_tables.shape[1]].copy_(meta.block_tables)
        if batch.lora_groups:
            index, scale = self.lora.row_inputs(batch.lora_groups, size, self.device)
            self.index[:size].copy_(index)
            self.scale[:size].copy_(scale)
        if graph is not None:
            graph.replay()
        else:
            out = self._decode(kv_cache, *key)
        self.steps += 1
        return self.model.head(out.index_select(0, batch.logit_rows))

    def _fit(self, kv_cache: torch.Tensor, width: int) -> None:
        """Record again over new KV memory, or once the block tables outgrow their buffer."""
        if self._kv is not kv_cache:
            self.graphs.clear()
            self._kv = kv_cache
        if width > self.tables.shape[1]:
            columns = _power_of_two(width)
            self.tables = torch.zeros(self.tables.shape[0], columns, dtype=torch.int32, device=self.device)
            self.graphs.clear()

    def _graph(self, key: tuple[int, bool, int], kv_cache: torch.Tensor):
        entry = self.graphs.get(key)
        if entry is not None:
            return entry
        size = key[0]
        self.slots[:size].fill_(-1)  # no rows, no sequences: the recording's runs write and read nothing
        self.loc[:size + 1].zero_()
        if not self.capture:
            entry = (None, None)
        else:
            try:
                entry = self._record(key, kv_cache)
            except Exception as err:  # a user's model or GPU we never ran on: serve eager, not fail
                self.graphs.clear()
                raise self.give_up(err, "recording a CUDA graph", "decode steps") from err
        self.graphs[key] = entry
        return entry

    def _record(self, key: tuple[int, bool, int], kv_cache: torch.Tensor):
        log.info("kvshare: recording the CUDA graph of %d rows%s", key[0], " with adapters" if key[1] else "")
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):  # Triton compiles its kernels, the allocator warms up
            for _ in range(2):
                self._decode(kv_cache, *key)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # graphs alive share one memory pool; once none is (all dropped: new KV memory, wider
        # tables), its pool is gone and recording into it trips an assertion of PyTorch's
        # allocator (seen on an H200, session 27): start a new one
        pool = self._pool if self.graphs else None
        with torch.cuda.graph(graph, pool=pool):
            out = self._decode(kv_cache, *key)
        self._pool = graph.pool()
        return graph, out

    def _decode(self, kv_cache: torch.Tensor, size: int, adapted: bool, seq_rows: int) -> torch.Tensor:
        """The decoder over the first ``size`` rows of the buffers: what a graph records."""
        from ...kernels.triton.attention import launch_paged_attention, launch_shape, split_partials, write_kv
        from ...kernels.triton.bgmv import bgmv_lora_add_parts
        from ...kernels.triton.linear_lora import fits, linear_lora

        m = self.model
        launch = launch_shape(m.n_q, m.n_kv, size, seq_rows, self.tables.shape[1] * self.block_size, self.device)
        partials = split_partials(size, m.n_q, m.head_dim, launch, self.device)
        positions, slots, loc, tables = self.positions[:size], self.slots[:size], self.loc[:size + 1], self.tables[:size]
        h = F.embedding(self.tokens[:size], m.embed)
        cos, sin = m.rope(h, positions)

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
            k_cache, v_cache = kv_cache[:, i, 0], kv_cache[:, i, 1]
            write_kv(k_cache, v_cache, k, v, slots)
            out = torch.empty_like(q)  # pad rows: zeros where keys are split, else never written
            launch_paged_attention(out, partials, q, k_cache, v_cache, positions, loc, tables, self.block_size,
                                   m.scale, launch)
            return out

        linear = m.kernels.linear.apply
        if not adapted:
            project = lambda i, fused, x, weight, bias=None: linear(x, weight, bias)  # noqa: E731
        else:
            index, scale = self.index[:size], self.scale[:size]
            stacks = self.lora.inputs()
            weights = dict(zip(PARTS, zip(stacks[0::2], stacks[1::2])))

            def project(i: int, fused: str, x: torch.Tensor, weight, bias=None) -> torch.Tensor:
                parts, first = [], 0
                for name, width in m.fused[fused]:
                    a, b_t = weights[name]
                    if a.shape[-2]:  # a projection some adapter adapts
                        parts.append((first, a[i], b_t[i]))
                    first += width
                if parts and self.lora_kernel == "fused" and fits(x, weight, parts):
                    y = linear_lora(x, weight, bias, parts, index, scale)  # one launch in all
                    if y is not None:  # None: the GPU's compiler rejected it (logged), as below
                        return y
                y = linear(x, weight, bias)
                bgmv_lora_add_parts(y, x, parts, index, scale)  # one launch for the fused projection
                return y

        h = m.decoder(h, cos, sin, m.layers, project, attend)
        return TorchPointwise.rms_norm(h, m.final_norm, m.eps)

    @torch.no_grad()
    def warm_up(self, kv_cache: torch.Tensor, sizes: tuple[int, ...] | None = None, adapted: bool = False,
                adapters: AdapterSet | None = None) -> None:
        """Record the given buckets' graphs now (default: all), for one row per sequence and,
        with ``adapted``, two (ICaRus pairs), so that no request waits for a recording."""
        if adapted:
            changed = self.lora.sync(adapters) if adapters is not None else False
            changed = self.lora.allocate() or changed
            changed = (not self.lora.parts and self.lora.adapt_parts(set(PARTS))) or changed
            if changed:
                self.forget_adapted()
        if self.unavailable is not None:  # a recording failed (logged): the engine serves eager
            return
        self._fit(kv_cache, 0)
        for size in sizes or self.buckets:
            for seq_rows in sorted({1, min(2, size)} if adapted else {1}):
                try:
                    self._graph((size, adapted, seq_rows), kv_cache)
                except StepUnavailable:
                    return
