"""ForkKV's residual attention: the reference against dense attention over reconstructed
K/V, the decomposition against the LoRA projection itself, and the Triton kernel against
the reference (Triton's interpreter on CPU without a GPU).

Base and residual rows sit in two pools with their own shuffled block ids (and block
sizes), partial last blocks, a base prefix shared by two sequences of different adapters,
GQA ratios 1/3/4, ranks 1 and 8, decode rows, prefill chunks and ICaRus-style pairs.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # a GPU runs the kernels compiled
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is first imported

import pytest
import torch.nn.functional as F

from kvshare.kernels import Kernels, build_attention_metadata
from kvshare.kernels.attention import paged_attention_ref, write_kv_ref
from kvshare.kernels.residual_attention import (build_residual_metadata, reconstruct_kv_ref,
                                                residual_attention_ref, residual_attention_sdpa,
                                                stack_residual_weights,
                                                write_residual_ref)

HEAD_DIM = 8
MAX_POSITIONS = 64

SCENARIOS = {
    # (cached tokens, row positions) per sequence; 41 keys take two 32-key tiles in Triton
    "decode": [(5, [5]), (12, [12]), (1, [1]), (40, [40])],
    "prefill-chunks": [(0, list(range(7))), (6, list(range(6, 11)))],  # from 0; continuing cached context
    "mixed": [(0, list(range(5))), (9, [9]), (3, [3, 3]), (4, [2]), (7, list(range(7, 10)))],
    "icarus-pairs": [(6, [6, 6]), (13, [13, 13]), (0, [0, 0])],  # two rows at one position
}


def rope_tables(device: str = "cpu", head_dim: int = HEAD_DIM) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin for positions 0..MAX_POSITIONS-1 from the engine's own RoPE class (transformers')."""
    from transformers import LlamaConfig

    from kvshare.families import rotary_for

    config = LlamaConfig(hidden_size=2 * head_dim, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=head_dim, max_position_embeddings=MAX_POSITIONS, rope_theta=100.0)
    positions = torch.arange(MAX_POSITIONS)[None]
    cos, sin = rotary_for("llama", config)(torch.zeros(1, dtype=torch.float32), positions)
    return cos[0].to(device), sin[0].to(device)


def forkkv_batch(gen, sequences, base_block_size=4, res_block_size=3, share_prefix=True):
    """Two pools with their own shuffled blocks: base tables, residual tables, row layout.

    With ``share_prefix`` the second sequence's base table starts with the first one's full
    blocks (a base prefix another agent computed) while its residual blocks stay private.
    """
    lengths = [max(cached, max(pos) + 1) for cached, pos in sequences]
    base_free = torch.randperm(64, generator=gen).tolist()
    res_free = torch.randperm(96, generator=gen).tolist()
    base_tables = [[base_free.pop() for _ in range(-(-n // base_block_size))] for n in lengths]
    if share_prefix and len(sequences) > 1:
        shared = min(lengths[0], lengths[1]) // base_block_size
        base_tables[1][:shared] = base_tables[0][:shared]
    res_tables = [[res_free.pop() for _ in range(-(-n // res_block_size))] for n in lengths]
    row_seq, positions, slots = [], [], []
    for s, (cached, pos) in enumerate(sequences):
        for i, p in enumerate(pos):
            row_seq.append(s)
            positions.append(p)
            writes = p >= cached and p not in pos[:i]
            slots.append(base_tables[s][p // base_block_size] * base_block_size + p % base_block_size
                         if writes else -1)
    return base_tables, res_tables, row_seq, positions, slots


def make_case(seed, sequences, n_q, n_kv, rank, device="cpu", share_prefix=True, head_dim=HEAD_DIM):
    """A batch over random pools; sequences alternate between two adapters (the second of a
    smaller rank, zero-padded to the pool's r, as stacked adapters are)."""
    gen = torch.Generator().manual_seed(seed)
    base_tables, res_tables, row_seq, positions, slots = forkkv_batch(gen, sequences, share_prefix=share_prefix)
    meta = build_attention_metadata(row_seq, positions, slots, base_tables, 4, device=device)
    adapters = [s % 2 for s in range(len(sequences))]
    residual = build_residual_metadata(meta, res_tables, 3, adapters, device=device)
    width = n_kv * head_dim
    b_k = torch.randn(2, width, rank, generator=gen)
    b_v = torch.randn(2, width, rank, generator=gen)
    b_k[1, :, max(1, rank // 2):] = 0
    b_v[1, :, max(1, rank // 2):] = 0
    cos, sin = rope_tables(head_dim=head_dim)
    tensors = {
        "q": torch.randn(len(row_seq), n_q, head_dim, generator=gen),
        "k_base_cache": torch.randn(64, 4, n_kv, head_dim, generator=gen),
        "v_base_cache": torch.randn(64, 4, n_kv, head_dim, generator=gen),
        "k_res_cache": torch.randn(96, 3, rank, generator=gen),
        "v_res_cache": torch.randn(96, 3, rank, generator=gen),
        "b_k": b_k, "b_v": b_v, "lora_scales": torch.tensor([0.7, 1.9]),
        "rope_cos": cos, "rope_sin": sin,
    }
    return {name: t.to(device) for name, t in tensors.items()}, meta, residual


def dense_oracle(case, meta, residual, scale):
    """SDPA per sequence over K/V rebuilt at full width, each row masked to its position."""
    q = case["q"]
    out = torch.empty_like(q)
    offset = 0
    for s, ((start, end), length) in enumerate(zip(meta.seq_bounds, meta.seq_context)):
        adapter = residual.host_adapter[s]
        k, v = reconstruct_kv_ref(case["k_base_cache"], case["v_base_cache"], case["k_res_cache"],
                                  case["v_res_cache"], case["b_k"][adapter], case["b_v"][adapter],
                                  float(case["lora_scales"][adapter]), case["rope_cos"], case["rope_sin"],
                                  meta.key_slots[offset:offset + length], residual.key_slots[offset:offset + length])
        offset += length
        mask = torch.arange(length)[None, :] <= meta.positions[start:end, None]
        attn = F.scaled_dot_product_attention(q[start:end].transpose(0, 1)[None], k.transpose(0, 1)[None],
                                              v.transpose(0, 1)[None], attn_mask=mask[None, None], scale=scale,
                                              enable_gqa=q.shape[1] != k.shape[1])
        out[start:end] = attn[0].transpose(0, 1)
    return out


def test_reconstructed_kv_is_the_lora_projection_with_rope():
    """Base rows RoPE(x W_k), x W_v and residual rows x A written into two pools rebuild
    exactly what a LoRA'd k/v projection with the model's RoPE gives (transformers' own
    apply_rotary_pos_emb as the oracle)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    gen = torch.Generator().manual_seed(11)
    n_kv, rank, hidden, length, scale = 2, 4, 24, 10, 1.5
    x = torch.randn(length, hidden, generator=gen)
    w_k, w_v = torch.randn(n_kv * HEAD_DIM, hidden, generator=gen), torch.randn(n_kv * HEAD_DIM, hidden, generator=gen)
    a_k, a_v = torch.randn(rank, hidden, generator=gen), torch.randn(rank, hidden, generator=gen)
    b_k, b_v = torch.randn(n_kv * HEAD_DIM, rank, generator=gen), torch.randn(n_kv * HEAD_DIM, rank, generator=gen)
    cos, sin = rope_tables()

    def rope(t):  # (length, heads, d) as the model rotates it
        return apply_rotary_pos_emb(t, t, cos[:length], sin[:length], unsqueeze_dim=1)[0]

    want_k = rope((x @ w_k.T + scale * (x @ a_k.T) @ b_k.T).reshape(length, n_kv, HEAD_DIM))
    want_v = (x @ w_v.T + scale * (x @ a_v.T) @ b_v.T).reshape(length, n_kv, HEAD_DIM)

    base_slots = torch.randperm(4 * 8, generator=gen)[:length]
    res_slots = torch.randperm(5 * 3, generator=gen)[:length]
    k_base, v_base = torch.zeros(8, 4, n_kv, HEAD_DIM), torch.zeros(8, 4, n_kv, HEAD_DIM)
    k_res, v_res = torch.zeros(5, 3, rank), torch.zeros(5, 3, rank)
    write_kv_ref(k_base, v_base, rope((x @ w_k.T).reshape(length, n_kv, HEAD_DIM)),
                 (x @ w_v.T).reshape(length, n_kv, HEAD_DIM), base_slots)
    skip = res_slots.clone()
    skip[3] = -1  # -1: not stored
    write_residual_ref(k_res, v_res, x @ a_k.T, x @ a_v.T, skip)
    assert torch.all(k_res.view(-1, rank)[res_slots[3]] == 0)
    write_residual_ref(k_res, v_res, x @ a_k.T, x @ a_v.T, res_slots)
    k, v = reconstruct_kv_ref(k_base, v_base, k_res, v_res, b_k, b_v, scale, cos, sin, base_slots, res_slots)
    torch.testing.assert_close(k, want_k, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(v, want_v, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("kernel", [residual_attention_ref, residual_attention_sdpa], ids=["block_loop", "sdpa"])
@pytest.mark.parametrize("rank", [1, 8])
@pytest.mark.parametrize("n_q,n_kv", [(2, 2), (6, 2), (4, 1)], ids=["gqa1", "gqa3", "gqa4"])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_reference_equals_dense_attention_over_reconstructed_kv(scenario, n_q, n_kv, rank, kernel):
    seed = list(SCENARIOS).index(scenario) * 10 + n_q + rank
    case, meta, residual = make_case(seed, SCENARIOS[scenario], n_q, n_kv, rank)
    got = kernel(**case, meta=meta, residual=residual, scale=0.4)
    torch.testing.assert_close(got, dense_oracle(case, meta, residual, 0.4), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("zeroed", ["scale", "b"])
def test_without_a_residual_it_is_paged_attention_over_the_base_pool(zeroed):
    case, meta, residual = make_case(5, SCENARIOS["mixed"], 6, 2, 8)
    if zeroed == "scale":
        case["lora_scales"] = torch.zeros(2)
    else:
        case["b_k"], case["b_v"] = torch.zeros_like(case["b_k"]), torch.zeros_like(case["b_v"])
    got = residual_attention_ref(**case, meta=meta, residual=residual, scale=0.4)
    want = paged_attention_ref(case["q"], case["k_base_cache"], case["v_base_cache"], meta, 0.4)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    # and the residual does change the result when it is there
    case, meta, residual = make_case(5, SCENARIOS["mixed"], 6, 2, 8)
    assert not torch.allclose(residual_attention_ref(**case, meta=meta, residual=residual, scale=0.4), want)


def test_reference_keeps_the_model_dtype():
    """bfloat16 pools (the engine's dtype on a GPU): float32 math inside, bfloat16 out."""
    case, meta, residual = make_case(8, SCENARIOS["mixed"], 4, 2, 8)
    low = {name: t.to(torch.bfloat16) if name != "lora_scales" else t for name, t in case.items()}
    got = residual_attention_ref(**low, meta=meta, residual=residual, scale=0.4)
    assert got.dtype == torch.bfloat16
    exact = residual_attention_ref(**{name: t.float() for name, t in low.items()}, meta=meta, residual=residual,
                                   scale=0.4)
    torch.testing.assert_close(got.float(), exact, atol=2e-2, rtol=1e-2)


def test_the_engines_torch_path_rounds_rebuilt_kv_once_in_bfloat16():
    """The SDPA path rebuilds K = K_base + RoPE(scale R_k B_k) and V in float32 and rounds once
    to bfloat16 for SDPA: its mean error against float32 math on the same bfloat16 inputs was
    0.0059-0.0062 when the delta, its scale and each RoPE term were rounded apart, 0.0032-0.0040
    once (seeds 0-2)."""
    for seed in range(3):
        case, meta, residual = make_case(seed, SCENARIOS["mixed"], 4, 2, 8)
        low = {name: t.to(torch.bfloat16) if name != "lora_scales" else t for name, t in case.items()}
        got = residual_attention_sdpa(**low, meta=meta, residual=residual, scale=0.4)
        assert got.dtype == torch.bfloat16
        exact = residual_attention_ref(**{name: t.float() for name, t in low.items()}, meta=meta,
                                       residual=residual, scale=0.4)
        assert (got.float() - exact).abs().mean() < 0.005  # between the two, with room for another CPU's SDPA


def test_registered_for_every_engine_and_checked_inputs():
    assert Kernels().residual_attention is residual_attention_sdpa  # the engine's torch path
    b, scales = stack_residual_weights(torch.zeros(16, 4), 2.0)
    assert b.shape == (1, 16, 4) and scales.tolist() == [2.0]
    meta = build_attention_metadata([0], [9], [-1], [[0, 1, 2]], 4)
    with pytest.raises(ValueError, match="cannot hold 10 keys"):
        build_residual_metadata(meta, [[0, 1]], 3, [0])
    with pytest.raises(ValueError, match="one residual block table"):
        build_residual_metadata(meta, [[0, 1, 2, 3]], 3, [0, 1])


CPU_SCENARIOS = SCENARIOS | {  # a 20-row prompt chunk (SDPA in the cpu backend) beside decode rows (C++)
    "chunk-and-decode": [(0, list(range(20))), (9, [9]), (30, [30]), (2, list(range(2, 8)))]}


def cpu_kernels() -> Kernels:
    from kvshare.kernels import cpu

    assert cpu.available()  # else the backend serves the torch path and compares it with itself
    return Kernels("cpu")


@pytest.mark.parametrize("head_dim", [8, 64])
@pytest.mark.parametrize("n_q,n_kv,rank", [(2, 2, 1), (6, 2, 8), (4, 1, 16)], ids=["gqa1-r1", "gqa3-r8", "gqa4-r16"])
@pytest.mark.parametrize("scenario", list(CPU_SCENARIOS))
def test_cpu_kernel_equals_the_reference(scenario, n_q, n_kv, rank, head_dim):
    """The C++ kernel (decode rows, keys rebuilt where read) and SDPA (prompt chunks) in one call."""
    seed = list(CPU_SCENARIOS).index(scenario) + 3 * n_q + rank
    case, meta, residual = make_case(seed, CPU_SCENARIOS[scenario], n_q, n_kv, rank, head_dim=head_dim)
    want = residual_attention_ref(**case, meta=meta, residual=residual, scale=0.4)
    got = cpu_kernels().residual_attention(**case, meta=meta, residual=residual, scale=0.4)
    # float32 sums in another order: outputs reach ~18 here, so the absolute slack scales with
    # them (an AMX Xeon's build differed from the reference by up to 5.9e-5 where AMD's passed 2e-5)
    torch.testing.assert_close(got, want, atol=max(2e-5, 1e-5 * want.abs().max().item()), rtol=1e-5)


def test_cpu_kernel_in_bfloat16():
    """bfloat16 pools: float math inside; as close to float32 math as the torch path is."""
    case, meta, residual = make_case(4, CPU_SCENARIOS["chunk-and-decode"], 6, 2, 8, head_dim=64)
    low = {name: t.to(torch.bfloat16) if name != "lora_scales" else t for name, t in case.items()}
    got = cpu_kernels().residual_attention(**low, meta=meta, residual=residual, scale=0.4)
    assert got.dtype == torch.bfloat16
    exact = residual_attention_ref(**{name: t.float() for name, t in low.items()}, meta=meta, residual=residual,
                                   scale=0.4)
    torch_path = residual_attention_sdpa(**low, meta=meta, residual=residual, scale=0.4)
    assert (got.float() - exact).abs().mean() <= (torch_path.float() - exact).abs().mean() + 1e-3


def test_the_torch_path_computes_only_the_sequences_asked():
    case, meta, residual = make_case(2, SCENARIOS["mixed"], 6, 2, 8)
    want = residual_attention_sdpa(**case, meta=meta, residual=residual, scale=0.4)
    out = torch.full_like(want, 7.0)
    residual_attention_sdpa(**case, meta=meta, residual=residual, scale=0.4, seqs=[0, 3], out=out)
    for s, (start, end) in enumerate(meta.seq_bounds):
        torch.testing.assert_close(out[start:end], want[start:end] if s in (0, 3) else torch.full_like(
            want[start:end], 7.0), atol=1e-6, rtol=1e-6)


def triton_kernels():
    """The Triton backend under the interpreter (or compiled on a GPU); skip where it cannot run."""
    pytest.importorskip("triton")
    from kvshare.kernels.registry import register_triton

    if not register_triton():  # kvshare.kernels may have been imported before the variable was set
        pytest.skip("the triton backend cannot run here")
    import kvshare.kernels.triton as tk

    return Kernels("triton"), "cpu" if tk.INTERPRETED else "cuda"


@pytest.mark.triton
@pytest.mark.parametrize("n_q,n_kv,rank", [(2, 2, 1), (6, 2, 8), (4, 1, 8)], ids=["gqa1-r1", "gqa3-r8", "gqa4-r8"])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_triton_equals_the_reference(scenario, n_q, n_kv, rank):
    fast, device = triton_kernels()
    seed = list(SCENARIOS).index(scenario) + 3 * n_q + rank
    case, meta, residual = make_case(seed, SCENARIOS[scenario], n_q, n_kv, rank, device=device)
    want = residual_attention_ref(**case, meta=meta, residual=residual, scale=0.4)
    got = fast.residual_attention(**case, meta=meta, residual=residual, scale=0.4)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


@pytest.mark.triton
def test_triton_prefill_longer_than_a_tile():
    """A prefill whose rows split into several programs and whose keys span several tiles."""
    fast, device = triton_kernels()
    case, meta, residual = make_case(9, [(0, list(range(37))), (2, [2, 2])], 4, 2, 8, device=device)
    want = residual_attention_ref(**case, meta=meta, residual=residual, scale=0.3)
    got = fast.residual_attention(**case, meta=meta, residual=residual, scale=0.3)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    case["q"] = case["q"].transpose(1, 2).contiguous().transpose(1, 2)  # head dims strided: same result
    torch.testing.assert_close(fast.residual_attention(**case, meta=meta, residual=residual, scale=0.3), want,
                               atol=2e-5, rtol=1e-5)


@pytest.mark.triton
def test_triton_in_the_model_dtype():
    """bfloat16 through the kernel (compiled only: Triton 3.9's interpreter computes
    bfloat16 tl.dot wrongly), against the reference on the same bfloat16 inputs."""
    fast, device = triton_kernels()
    if device == "cpu":
        pytest.skip("Triton's interpreter computes bfloat16 tl.dot wrongly")
    case, meta, residual = make_case(12, SCENARIOS["mixed"], 6, 2, 8, device=device)
    low = {name: t.to(torch.bfloat16) if name != "lora_scales" else t for name, t in case.items()}
    want = residual_attention_ref(**low, meta=meta, residual=residual, scale=0.4)
    got = fast.residual_attention(**low, meta=meta, residual=residual, scale=0.4)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, atol=3e-2, rtol=2e-2)
