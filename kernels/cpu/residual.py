"""Backend "cpu" of ``residual_attention`` (ForkKV): decode rows in C++, prompt chunks by SDPA.

The torch path rebuilds every key and value of the step densely before SDPA, a copy as large
as an exact cache per agent, in every layer; for decode rows over long shared contexts that
copy is most of the step. :file:`residual_attention.cpp` rebuilds each key in registers where
it reads it and keeps values at rank r (``(P R_v) B_v``). Sequences with more than
:data:`~kvshare.kernels.cpu.FEW_ROWS` rows (prompt chunks, compute-bound, where one dense
rebuild serves every row) stay on SDPA, one sequence at a time.
"""

from __future__ import annotations

import torch

from ..metadata import AttentionMetadata
from ..residual_attention import ResidualMetadata, residual_attention_sdpa
from . import Layout, extension

_last: tuple = (None, None)  # (meta, its Layout): every layer of an eager step asks for the same


def _step_layout(meta: AttentionMetadata) -> Layout:
    """A cache of its own beside paged_attention_cpu's: a ForkKV step beside exact rows asks both in
    turn, for two metadata, in every layer."""
    global _last
    last = _last  # read once: engines stepped from two threads each replace it
    layout = last[1] if last[0] is meta else Layout(meta)
    _last = (meta, layout)
    return layout


def _float32(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float32).contiguous()


def residual_attention_cpu(q: torch.Tensor, k_base_cache: torch.Tensor, v_base_cache: torch.Tensor,
                           k_res_cache: torch.Tensor, v_res_cache: torch.Tensor, b_k: torch.Tensor,
                           b_v: torch.Tensor, lora_scales: torch.Tensor, rope_cos: torch.Tensor,
                           rope_sin: torch.Tensor, meta: AttentionMetadata, residual: ResidualMetadata,
                           scale: float) -> torch.Tensor:
    """:func:`~kvshare.kernels.residual_attention.residual_attention_sdpa`'s contract, on CPU
    tensors whose pools share q's dtype (else, or before the extension is built, that path)."""
    args = (q, k_base_cache, v_base_cache, k_res_cache, v_res_cache, b_k, b_v, lora_scales, rope_cos, rope_sin,
            meta, residual, scale)
    same = all(t.dtype == q.dtype for t in (k_base_cache, v_base_cache, k_res_cache, v_res_cache))
    if q.device.type != "cpu" or not same or extension(wait=False) is None:
        return residual_attention_sdpa(*args)
    layout = _step_layout(meta)
    out = torch.empty_like(q)
    if len(layout.seqs):  # the residual tables and adapters are int32 already (build_residual_metadata)
        extension().residual_attention(q, k_base_cache, v_base_cache, k_res_cache, v_res_cache, _float32(b_k),
                                       _float32(b_v), _float32(lora_scales), _float32(rope_cos), _float32(rope_sin),
                                       layout.tables, residual.block_tables, layout.starts, layout.row_lens,
                                       residual.seq_adapter, layout.seqs, scale, out)
    if layout.large:
        residual_attention_sdpa(*args, seqs=layout.large, out=out)
    return out
