"""The model runner: owns the device, the weights, the KV memory and the kernel choice.

The engine hands it a step's plans; it builds the batch (tensor metadata, once per step),
runs the model, samples every logit row in one call and returns host-side results. Nothing
else touches device tensors, so the engine and scheduler are plain Python over integers.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ...errors import KvshareError
from ...kernels import Kernels
from .adapters import AdapterSet
from .batch import Batch, StepPlan, build_batch
from ..cache.arena import BlockShape
from ..cache.layer_stream import LayerStream
from .compiled import CompiledStep, compile_wanted, resolve_mode, unpacked_int8
from .cuda_graphs import GraphedStep, graphs_wanted
from ..config import DEFAULT_COMPILE_MAX_ROWS
from .model import Model
from .sampler import logprobs_batch, sample_batch
from .step_buckets import BucketedStep, StepUnavailable

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def resolve_device(device: str | torch.device) -> torch.device:
    try:
        device = torch.device(device)
    except RuntimeError:  # e.g. "gpu"
        raise KvshareError(f"device must be cpu or cuda, not {str(device)!r}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise KvshareError("device 'cuda' was asked for, but torch sees no CUDA GPU")
    if device.type not in ("cpu", "cuda"):
        raise KvshareError(f"device must be cpu or cuda, not {device.type!r}")
    if device.type == "cuda" and device.index is None:
        # tensors report "cuda:0", never "cuda": name the index, so device checks compare equal
        device = torch.device("cuda", torch.cuda.current_device())
    return device


class ModelRunner:
    def __init__(self, model_dir: Path, dtype: torch.dtype, device: torch.device,
                 kv_cache_tokens: int | None, kv_cache_bytes: int | None, block_size: int,
                 kernels: Kernels, compile_mode: str = "off", max_step_rows: int = DEFAULT_COMPILE_MAX_ROWS,
                 max_loras: int = 8, max_lora_rank: int = 64):
        self.device = device
        self.model = Model(model_dir, dtype, device, kernels)
        self.compiled: BucketedStep | None = None  # the graphs that run steps of up to max_step_rows rows
        if compile_wanted(compile_mode, device, dtype, kernels) and not (
                resolve_mode(compile_mode) == "auto" and unpacked_int8(self.model)):
            # auto: graphs are lowered on a worker as the workload first needs them, steps run eager
            # meanwhile (not under `kvshare bench`, which compiles before its clocks)
            background = resolve_mode(compile_mode) == "auto" and os.environ.get("KVSHARE_COMPILE_BACKGROUND") != "0"
            self.compiled = CompiledStep(self.model, max_step_rows, max_loras, max_lora_rank, background=background)
        elif graphs_wanted(compile_mode, device, self.model):
            self.compiled = GraphedStep(self.model, block_size, max_step_rows, max_loras, max_lora_rank)
        self.kernels = kernels
        self.eos_token_ids: frozenset[int] = frozenset()  # the engine's, for min_tokens (set by it)
        self.block_size = block_size
        m = self.model
        self.kv_bytes_per_token = 2 * m.n_layers * m.n_kv * m.head_dim * torch.finfo(dtype).bits // 8
        self.num_blocks = self.pool_blocks(kv_cache_tokens, kv_cache_bytes)
        # block-major, as SwiftCache's arena: a block (every layer's K and V) is one span of bytes
        self.kv_cache = torch.zeros(self.num_blocks, *self.block_dims(), dtype=dtype, device=device)
        self.residual_cache: torch.Tensor | None = None  # ForkKV's (2, layers, blocks, block_size, r)
        self.stream: LayerStream | None = None  # SwiftCache's layer stream over lent memory

    def pool_blocks(self, kv_cache_tokens: int | None, kv_cache_bytes: int | None) -> int:
        """Blocks of a KV pool of ``kv_cache_bytes`` (else ``kv_cache_tokens``, else 16384 tokens)."""
        if kv_cache_bytes is not None:
            kv_cache_tokens = kv_cache_bytes // self.kv_bytes_per_token
            if not kv_cache_tokens:
                raise KvshareError(f"kv_cache_bytes {kv_cache_bytes} holds no token's KV "
                                   f"({self.kv_bytes_per_token} bytes a token for this model)")
        return max(1, (kv_cache_tokens or 16384) // self.block_size)

    def block_shape(self) -> BlockShape:
        m = self.model
        return BlockShape(m.n_layers, m.n_kv, m.head_dim, self.block_size, m.dtype)

    def block_dims(self) -> tuple[int, ...]:
        """One block of the KV memory: (layers, 2, block_size, kv_heads, head_dim)."""
        return self.block_shape().dims()

    def use_kv_memory(self, kv: torch.Tensor) -> None:
        """Run over ``kv`` (a co-location arena's view, (blocks, *block_dims)) instead of a
        private pool; the private one is dropped."""
        if tuple(kv.shape[1:]) != self.block_dims() or kv.dtype != self.model.dtype or kv.device != self.device:
            raise ValueError(f"KV memory of shape {tuple(kv.shape)} {kv.dtype} on {kv.device} does not fit "
                             f"blocks of {self.block_dims()} {self.model.dtype} on {self.device}")
        self.kv_cache = kv
        self.num_blocks = kv.shape[0]

    def stream_kv(self, buffer_rows: int, bandwidth_gbps: float) -> None:
        """Keep one layer of ``buffer_rows`` blocks locally and stream the layers of
        ``kv_cache`` (lent memory) through it."""
        if self.residual_cache is not None:
            raise KvshareError("the layer-stream cache does not serve ForkKV adapters")
        self.stream = LayerStream(self.kv_cache, buffer_rows, bandwidth_gbps)

    def add_residual_pool(self, tokens: int, rank: int) -> int:
        """Allocate ForkKV's residual pool (once): ``tokens`` slots of rank ``rank`` per layer
        for x A_k and x A_v. Returns its number of blocks."""
        m = self.model
        if self.stream is not None:
            raise KvshareError("ForkKV adapters cannot be served by a layer-streaming engine")
        if any(L["k_norm"] is not None for L in m.layers):
            raise KvshareError("ForkKV needs keys linear in x (K = x W_k + x A_k B_k); this model "
                               "normalises keys per head (k_norm), which breaks the split")
        blocks = max(1, tokens // self.block_size)
        self.residual_cache = torch.zeros(2, m.n_layers, blocks, self.block_size, rank,
                                          dtype=self.model.dtype, device=self.device)
        return blocks

    @property
    def vocab_size(self) -> int:
        return self.model.embed.shape[0]

    @property
    def residual_block_bytes(self) -> int:
        """Bytes of one block of ForkKV's residual pool (0 without the pool)."""
        pool = self.residual_cache
        return 0 if pool is None else pool[:, :, 0].numel() * pool.element_size()

    def split(self, plans: list[StepPlan], adapters: AdapterSet) -> list[list[StepPlan]]:
        """The groups of plans one step runs as separate forwards (:meth:`CompiledStep.split`)."""
        if self.compiled is None:
            return [plans]
        return self.compiled.split(plans, self.stream or self.kv_cache, self.model.hidden_capture, adapters)

    def run(self, plans: list[StepPlan], adapters: AdapterSet) -> tuple[Batch, list[int], dict[int, dict]]:
        """Run one step: (the batch, the sampled token of each sampling row in target order,
        logprob records by logit row for the rows that want them). On a GPU, with this
        engine's GPU current: Triton launches on the current device and its stream, whatever
        device the tensors are on (``--device cuda:1``, co-located engines on two GPUs)."""
        if self.device.type != "cuda":
            return self._run(plans, adapters)
        with torch.cuda.device(self.device):
            return self._run(plans, adapters)

    def _run(self, plans: list[StepPlan], adapters: AdapterSet) -> tuple[Batch, list[int], dict[int, dict]]:
        batch = build_batch(plans, self.block_size, self.device,
                            adapters.residual_index() if self.residual_cache is not None else None)
        kv = self.stream or self.kv_cache
        logits = None
        if self.compiled is not None and self.compiled.handles(batch, kv, self.model.hidden_capture, adapters):
            try:
                logits = self.compiled.forward(batch, kv)
            except StepUnavailable:  # the graphs gave up (logged): this step and the later ones run eager
                pass
        if logits is None:
            logits = self.model.forward(batch, kv, adapters.lookup, self.residual_cache, adapters.residual_stack)
        sample_rows = [r for r, (_, pos) in enumerate(batch.targets) if pos is None]
        seqs = [plans[batch.targets[r][0]].seq for r in sample_rows]
        index = torch.tensor(sample_rows, dtype=torch.long, device=logits.device)
        histories = [s.tokens if s.params.repetition_penalty != 1.0 else None for s in seqs]  # prompt + output
        tokens = sample_batch(logits.index_select(0, index), [s.params for s in seqs], [s.generator for s in seqs],
                              histories, [len(s.output) for s in seqs], self.eos_token_ids,
                              [s.allowed_mask for s in seqs])
        # (logit row, token whose logprob is reported, how many alternatives): sampled rows that
        # asked for logprobs, and every prompt-scoring row
        wanted = [(row, token, seq.params.logprobs) for row, seq, token in zip(sample_rows, seqs, tokens)
                  if seq.params.logprobs is not None]
        for row, (i, pos) in enumerate(batch.targets):
            if pos is not None:
                seq = plans[i].seq
                wanted.append((row, seq.prompt[pos + 1], seq.params.prompt_logprobs))
        records: dict[int, dict] = {}
        if wanted:
            rows, chosen, ks = (list(column) for column in zip(*wanted))
            picked = logits.index_select(0, torch.tensor(rows, dtype=torch.long, device=logits.device))
            records = dict(zip(rows, logprobs_batch(picked, chosen, ks)))
        return batch, tokens, records
