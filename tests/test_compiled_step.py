"""The compiled CPU step (``compile="on"``, the default on CPU in float32, and in bfloat16 on
CPUs with bfloat16 instructions): the same tokens and scores as the eager engine for every
adapter kind in one mixed step, int8 weights, pad rows that never touch the cache, the
fall-backs, and when it is chosen."""

from __future__ import annotations

import gc

import pytest
import torch

from kvshare.errors import KvshareError
import kvshare.serve.exec.compiled as compiled_module
import kvshare.serve.exec.shared_constants as shared_constants
from kvshare.kernels import Kernels, cpu
from kvshare.kernels.quant import Int8Weight
from kvshare.kernels.registry import backends
from kvshare.serve import LLM, SamplingParams
from kvshare.serve.exec.compiled import compile_wanted, compiler_blocker

from test_engine import adapters, base, invocation, prompts_for, tokenizer  # noqa: F401

# Inductor cannot compile where torch or its cache lies in a path with spaces (torch 2.13)
pytestmark = pytest.mark.skipif(compiler_blocker() is not None, reason=str(compiler_blocker()))

SETTINGS = dict(kv_cache_tokens=512, block_size=4)


@pytest.fixture(scope="module", autouse=True)
def share_small_constants():
    """The tiny model's packed weights are shared as SmolLM2's are (the floor is for real models):
    every graph of this module runs on the constants kept once, against the eager engine.
    Yields the graph modules loaded before (other tests' graphs)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(shared_constants, "MIN_BYTES", 1024)
        yield {id(m) for m in shared_constants.graph_modules()}


@pytest.fixture(scope="module")
def engines(base, adapters):
    compiled = LLM(base, list(adapters.values()), compile="on", **SETTINGS)
    eager = LLM(base, list(adapters.values()), compile="off", **SETTINGS)
    return compiled, eager


def _generate(llm, prompts, names, params):
    engine = llm.engine
    ids = [engine.add_request(p, params, adapter=n) for p, n in zip(prompts, names)]
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                assert out.finish_reason != "error", "a step failed"
                done[out.request_id] = out
    return [done[i] for i in ids]


def test_a_mixed_step_of_every_kind_gives_the_eager_tokens(engines, tokenizer, invocation):
    """Base, LoRA, ICaRus (paired rows) and aLoRA requests decode side by side: the steps
    with 5-8 rows run compiled (bucket 8, pad rows included), the prompts eager."""
    compiled, eager = engines
    prompts = prompts_for(tokenizer, 3)
    prompts.append(prompts[0] + invocation)
    names = [None, "lora-a", "icarus-a", "alora-a"]
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    before = compiled.engine.runner.compiled.steps
    got = _generate(compiled, prompts, names, params)
    want = _generate(eager, prompts, names, params)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert compiled.engine.runner.compiled.steps - before >= 8  # the decode steps ran compiled
    assert (8, True) in compiled.engine.runner.compiled.traced  # with the adapters' deltas in the graph
    assert eager.engine.runner.compiled is None and compiled.engine.runner.compiled.recompiles == 0


def test_scores_match_the_eager_engine(engines, tokenizer):
    """Logprobs of the sampled tokens agree with eager within float32 rounding of a
    differently blocked GEMM (three decode rows: the 4-row bucket, one pad row)."""
    compiled, eager = engines
    prompts = prompts_for(tokenizer, 3)
    params = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=0)
    got, want = (_generate(llm, prompts, [None] * 3, params) for llm in (compiled, eager))
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        assert [x["logprob"] for x in g.logprobs] == pytest.approx([x["logprob"] for x in w.logprobs], abs=1e-4)


def test_pad_rows_never_write_the_cache(engines, tokenizer):
    """Three decode rows run in the 4-row bucket; only the three real rows' slots change."""
    compiled, _ = engines
    engine = compiled.engine
    engine.reset_prefix_cache()
    kv = engine.runner.kv_cache
    prompts = [p[:7] for p in prompts_for(tokenizer, 3)]
    for p in prompts:
        engine.add_request(p, SamplingParams(max_tokens=3, ignore_eos=True))
    engine.step()  # the prompts (21 rows: eager)
    before = kv.clone()
    steps = engine.runner.compiled.steps
    engine.step()  # 3 decode rows: compiled, padded to 4
    assert engine.runner.compiled.steps == steps + 1
    assert_only_running_sequences_wrote(engine, before, 7)


def assert_only_running_sequences_wrote(engine, before: torch.Tensor, position: int) -> None:
    """Since ``before`` (a copy of the KV memory) only the slots of the three running sequences'
    ``position`` changed; then the engine runs to its end."""
    bs = engine.config.block_size
    changed = (engine.runner.kv_cache != before).permute(0, 3, 1, 2, 4, 5).flatten(2).any(-1)  # (blocks, offsets)
    written = {seq.block_table[position // bs] * bs + position % bs for seq in engine._scheduler.running}
    assert {b * bs + o for b, o in changed.nonzero().tolist()} == written and len(written) == 3
    while engine.has_unfinished():
        engine.step()


def test_graphs_keep_one_copy_of_the_packed_weights_they_share(engines, share_small_constants):
    """The buckets compiled so far (with adapters and without) packed the same weights alike:
    no two of their constants are equal distinct tensors, and some were shared."""
    compiled, _ = engines
    assert compiled.engine.runner.compiled.shared_bytes > 0
    ours = [m for m in shared_constants.graph_modules() if id(m) not in share_small_constants]
    constants = [v for m in ours for v in vars(m).values()
                 if isinstance(v, torch.Tensor) and v.layout == torch.strided and v.dim() == 3]
    assert constants  # the GEMM template's blocked copies
    distinct = list({id(t): t for t in constants}.values())
    groups = {}
    for t in distinct:
        groups.setdefault((t.dtype, tuple(t.shape), t.stride()), []).append(t)
    for same_shape in groups.values():
        for i, a in enumerate(same_shape):
            assert not any(torch.equal(a, b) for b in same_shape[i + 1:])


def test_after_a_compile_its_cyclic_garbage_is_freed_at_once():
    """A compile's frozen graph ends in reference cycles, holding the weights as freezing
    prepacked them for oneDNN/MKL (SmolLM2 float32: about 0.7 GB a graph, which the GEMM
    template's graph never reads): the step frees them as each compile ends, not at Python's next
    full collection."""
    import weakref

    class Holder:
        pass

    holder = Holder()
    holder.me, holder.weights = holder, torch.ones(1 << 16)
    gone = weakref.ref(holder.weights)
    del holder
    gc.disable()  # (only the step's own collection runs)
    try:
        assert gone() is not None
        shared_constants.return_freed_memory()
        assert gone() is None
    finally:
        gc.enable()


def test_a_compile_frees_its_garbage_before_its_graph_first_runs(base, tokenizer, monkeypatch):
    """The collection runs as Dynamo's compile ends, before the new graph first runs and pages in
    its constants (the start's peak); after the graph ran, only the heap is trimmed."""
    calls = []
    graphs = shared_constants.graph_modules
    monkeypatch.setattr(compiled_module, "return_freed_memory",
                        lambda collect=True: calls.append((collect, len(graphs()))))
    llm = LLM(base, compile="on", **SETTINGS)  # a new engine: its graph is lowered again
    loaded = len(graphs())
    _generate(llm, prompts_for(tokenizer, 1), [None], SamplingParams(max_tokens=2, ignore_eos=True))
    assert [collect for collect, _ in calls] == [True, False]
    assert calls[0][1] > loaded  # (the graph's module is in: the compile had ended)
    assert not torch._dynamo.callback_handler.end_callbacks  # the callback was only for this compile


def _chunk_beside_decoding(llm, tokenizer, chunk: int = 40) -> tuple[list[int], int, int, list[list[int]]]:
    """Three sequences (base, LoRA, ICaRus pair) decode, then a ``chunk``-row prompt joins
    them: the row counts of the forwards that step ran as, the compiled forwards of that step
    and of it with the rest of the run (0 eager), and every request's greedy tokens."""
    engine = llm.engine
    engine.reset_prefix_cache()
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    prompts = prompts_for(tokenizer, 3)
    ids = [engine.add_request(p, params, adapter=n) for p, n in zip(prompts, [None, "lora-a", "icarus-a"])]
    engine.step()  # the three prompts
    engine.step()  # a decode step
    ids.append(engine.add_request((sum(prompts_for(tokenizer, 3), []) * 2)[:chunk], params, adapter="lora-b"))
    runner = engine.runner
    split, seen = runner.split, []
    runner.split = lambda plans, adapters: seen.append(split(plans, adapters)) or seen[-1]
    steps = runner.compiled.steps if runner.compiled is not None else 0
    engine.step()
    del runner.split
    count = lambda: runner.compiled.steps - steps if runner.compiled is not None else 0  # noqa: E731
    in_step = count()
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [sum(p.num_rows for p in group) for group in seen[0]], in_step, count(), [done[i].token_ids for i in ids]


def test_a_prompt_chunk_beside_decoding_sequences_runs_apart_from_them(engines, tokenizer):
    """A step of a 40-row prompt chunk and three decoding sequences (base, LoRA, ICaRus pair)
    is two forwards: the decode rows through the graph, the chunk eager; the same tokens as
    the eager engine, which runs the step as one forward."""
    compiled, eager = engines
    rows, in_step, in_run, tokens = _chunk_beside_decoding(compiled, tokenizer)
    assert rows == [4, 40] and in_step == 1  # base 1 + LoRA 1 + ICaRus pair 2 through the graph; the prompt
    assert in_run >= 6  # the split step's decode rows, then every decode step
    eager_rows, _, _, eager_tokens = _chunk_beside_decoding(eager, tokenizer)
    assert eager_rows == [44] and tokens == eager_tokens


def test_larger_buckets_take_a_prompt_chunk_with_the_decode_rows(base, adapters, engines, tokenizer):
    """With ``compile_max_rows=64`` the step is one compiled forward. 4 decode rows and a
    56-row chunk fill 60 of bucket 64; a 40-row chunk (44 rows) is cut back to bucket 32 (12
    rows wait a step rather than 20 pad rows run). The same tokens as the eager engine. The
    head scores only the rows sampled from (at most the step's four sequences), not the bucket."""
    _, eager = engines
    wide = LLM(base, list(adapters.values()), compile="on", compile_max_rows=64, **SETTINGS)
    step = wide.engine.runner.compiled
    assert step.buckets == (1, 2, 4, 8, 16, 32, 64)
    head_rows, score = [], step._head
    step._head = lambda hidden: (head_rows.append(len(hidden)), score(hidden))[1]
    for chunk, want_rows in ((56, [60]), (40, [32])):
        rows, in_step, _, tokens = _chunk_beside_decoding(wide, tokenizer, chunk)
        assert rows == want_rows and in_step == 1  # the whole step through the graph
        assert tokens == _chunk_beside_decoding(eager, tokenizer, chunk)[3]
    assert head_rows and max(head_rows) <= 4
    assert _chunk_beside_decoding(eager, tokenizer)[0] == [44]  # eager steps: no buckets, no cut
    with pytest.raises(KvshareError, match="compile_max_rows must be one of"):
        LLM(base, compile="on", compile_max_rows=48, **SETTINGS)


def test_decode_buckets_attend_in_the_cpp_op(engines, tokenizer, monkeypatch):
    """In float32 (the kernel leaves prompt chunks to SDPA) buckets of up to FEW_ROWS rows call
    ``kvshare::step_attention_cpu`` with the step's plan, larger ones the Python op; with the
    torch attention chosen, every bucket takes the Python op. The same tokens as eager."""
    from types import SimpleNamespace

    compiled, eager = engines
    assert compiled.engine.runner.compiled._prepare()[0] == cpu.FEW_ROWS
    plans, begin = [], cpu.StepPlan.begin
    monkeypatch.setattr(cpu.StepPlan, "begin", lambda plan, kv, scale: (plans.append(plan.rows), begin(plan, kv, scale)))
    prompts = prompts_for(tokenizer, 2)
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    got = _generate(compiled, prompts, [None, "icarus-a"], params)
    assert [g.token_ids for g in got] == [w.token_ids for w in _generate(eager, prompts, [None, "icarus-a"], params)]
    assert plans.count(3) == 4  # base 1 + ICaRus pair 2, every decode step but the prompts' (eager)
    model = SimpleNamespace(kernels=Kernels({"paged_attention": "torch"}), dtype=torch.float32, head_dim=64)
    assert compiled_module.native_rows(model) == 0
    model = SimpleNamespace(kernels=Kernels("cpu"), dtype=torch.bfloat16, head_dim=64)
    assert compiled_module.native_rows(model) == (cpu.FEW_ROWS if not cpu.chunk_kernel_takes(torch.bfloat16, 64)
                                                  else compiled_module.sys.maxsize)


def test_steps_it_cannot_take_run_eager(engines, tokenizer):
    compiled, eager = engines
    runner = compiled.engine.runner
    long_prompt = sum(prompts_for(tokenizer, 4), [])[:40]  # 40 rows: above the largest bucket
    steps = runner.compiled.steps
    params = SamplingParams(max_tokens=1)
    got = compiled.generate([long_prompt], params)[0].token_ids
    assert runner.compiled.steps == steps and got == eager.generate([long_prompt], params)[0].token_ids
    runner.model.hidden_capture = []  # hidden-state probes read each layer: eager
    compiled.generate([long_prompt[:3]], SamplingParams(max_tokens=2))  # 3 rows, 1 row: would be compiled
    assert runner.compiled.steps == steps and len(runner.model.hidden_capture) > 0
    runner.model.hidden_capture = None


def _assert_steps_score_as_eager(llm, tokenizer, monkeypatch, share: float = 0.06) -> None:
    """Run every compiled step of a mixed base / LoRA / ICaRus batch eagerly too, on the same
    batch, and hold the logits together within ``share`` of the largest logit (by default
    bfloat16 rounding of differently ordered sums, 6%; a wrong or misplaced weight is off by
    the logits' whole size)."""
    runner = llm.engine.runner
    step, pairs = runner.compiled.forward, []

    def both(batch, kv_cache):
        eager = runner.model.forward(batch, kv_cache, llm.engine._adapters.lookup)  # first: the compiled step's writes win
        compiled = step(batch, kv_cache)
        pairs.append((compiled, eager))
        return compiled

    monkeypatch.setattr(runner.compiled, "forward", both)
    _generate(llm, prompts_for(tokenizer, 3), [None, "lora-a", "icarus-a"], SamplingParams(max_tokens=6, ignore_eos=True))
    assert len(pairs) >= 5  # the decode steps
    for got, want in pairs:
        torch.testing.assert_close(got, want, rtol=0, atol=share * float(want.abs().max()))


def test_float32_projections_from_one_onednn_copy_score_as_the_eager_step(base, adapters, tokenizer,
                                                                         monkeypatch):
    """KVSHARE_CPU_GEMM=onednn: the float32 graphs multiply the projections by one oneDNN-packed
    copy of each weight, made once and shared by both graphs (and so by every bucket); every
    compiled step of a mixed base / LoRA / ICaRus batch scores as the eager step within float32
    rounding (0.1% of the largest logit)."""
    monkeypatch.setenv("KVSHARE_CPU_GEMM", "onednn")
    llm = LLM(base, [adapters["lora-a"], adapters["icarus-a"]], compile="on", **SETTINGS)
    _, graphs, _ = llm.engine.runner.compiled._prepare()
    decoders = [graph._orig_mod for graph in graphs.values()]
    assert all(d.onednn and d.l0_qkv_onednn.layout == torch._mkldnn for d in decoders)
    assert decoders[0].packed is decoders[1].packed and len(decoders[0].packed) == 4 * len(llm.engine.model.layers)
    _assert_steps_score_as_eager(llm, tokenizer, monkeypatch, share=1e-3)


def test_int8_weights_in_bfloat16_score_as_the_eager_step(base, adapters, tokenizer, monkeypatch):
    """--kernels int8 --dtype bfloat16: the graph reads the int8 weights through Inductor's
    weight-only int8 GEMM. Every compiled step of a mixed base / LoRA / ICaRus batch is also
    run eagerly (ATen's int8 kernel) on the same batch: the logits agree within bfloat16
    rounding of differently ordered sums (3.0% of the largest logit seen; 3.1% once the prompts
    took the expanded-weight GEMM, which writes slightly different KV; a wrong weight is off by
    the logits' whole size)."""
    llm = LLM(base, [adapters["lora-a"], adapters["icarus-a"]], compile="on", dtype="bfloat16",
              kernels="int8", **SETTINGS)
    assert isinstance(llm.engine.runner.model.layers[0]["qkv"], Int8Weight)
    _assert_steps_score_as_eager(llm, tokenizer, monkeypatch)


def test_when_it_is_chosen(monkeypatch, caplog):
    cpu, torch_kernels, int8 = torch.device("cpu"), Kernels("torch"), Kernels("int8")
    monkeypatch.setenv("KVSHARE_COMPILE", "auto")
    assert compile_wanted("auto", cpu, torch.float32, torch_kernels)
    monkeypatch.setattr(compiled_module, "cpu_has_fast_bf16", lambda: False)
    assert not compile_wanted("auto", cpu, torch.bfloat16, torch_kernels)
    assert not compile_wanted("auto", cpu, torch.bfloat16, int8)
    monkeypatch.setattr(compiled_module, "cpu_has_fast_bf16", lambda: True)  # bfloat16 instructions
    assert compile_wanted("auto", cpu, torch.bfloat16, torch_kernels)
    assert compile_wanted("auto", cpu, torch.bfloat16, int8)
    with caplog.at_level("WARNING"):
        assert not compile_wanted("auto", cpu, torch.float32, int8)  # float32 activations dequantise per call
    assert "int8 weights go through it with bfloat16 activations only" in caplog.text  # said, not silent
    assert not compile_wanted("off", cpu, torch.float32, torch_kernels)
    monkeypatch.setenv("KVSHARE_COMPILE", "off")
    assert not compile_wanted("auto", cpu, torch.float32, torch_kernels)
    assert compile_wanted("on", cpu, torch.float32, torch_kernels)
    assert compile_wanted("on", cpu, torch.bfloat16, int8)
    with pytest.raises(KvshareError, match="bfloat16 activations"):
        compile_wanted("on", cpu, torch.float32, int8)
    if "onednn" in backends("linear"):
        with pytest.raises(KvshareError, match="linear backend"):
            compile_wanted("on", cpu, torch.float32, Kernels({"linear": "onednn"}))
    monkeypatch.setenv("KVSHARE_COMPILE", "0")
    with pytest.raises(KvshareError, match="KVSHARE_COMPILE must be"):
        compile_wanted("auto", cpu, torch.float32, torch_kernels)
    with pytest.raises(KvshareError, match="compile must be"):
        compile_wanted("sometimes", cpu, torch.float32, torch_kernels)


def test_auto_runs_eager_where_an_int8_weight_has_no_packed_kernel(tmp_path, monkeypatch):
    """An input size not a multiple of 16 (here the MLP's 120): ``on`` is refused, ``auto``
    builds the engine and runs its steps eager, instead of failing to start."""
    from kvshare.testing import make_tiny_model

    model = make_tiny_model(tmp_path / "odd", intermediate_size=120)
    monkeypatch.setenv("KVSHARE_COMPILE", "auto")
    monkeypatch.setattr(compiled_module, "cpu_has_fast_bf16", lambda: True)
    settings = dict(dtype="bfloat16", kernels="int8", kv_cache_tokens=64, block_size=4)
    llm = LLM(model, compile="auto", **settings)
    assert llm.engine.runner.compiled is None
    assert len(llm.generate([[1, 5, 9]], SamplingParams(max_tokens=3, ignore_eos=True))[0].token_ids) == 3
    with pytest.raises(KvshareError, match="multiple of 16"):
        LLM(model, compile="on", **settings)


def test_rows_of_no_adapter_get_zeros_whatever_slot_zero_holds():
    """Base and pad rows read slot 0 in the graph's LoRA delta at scale 0: a NaN there (one
    tenant's diverged adapter) must not reach them, nor the base KV they write."""
    from kvshare.serve.exec.lora_slots import lora_delta

    a, b_t = torch.zeros(2, 8, 16), torch.zeros(2, 8, 32)
    a[0, 0, 0] = float("nan")
    a[1], b_t[1] = 0.1, 1.0
    x = torch.randn(3, 16)
    delta = lora_delta(x, a, b_t, torch.tensor([0, 0, 1]), torch.tensor([0.0, 0.0, 2.0]))
    assert torch.equal(delta[:2], torch.zeros(2, 32))
    assert torch.allclose(delta[2], 2 * (x[2] @ a[1].T) @ b_t[1])


def test_warm_up_compiles_ahead_and_steps_reuse_its_graph(engines, tokenizer):
    """After ``warm_up`` a real step of that size runs the warm-up's graph: no guard fails
    (a warm-up whose inputs differed from a step's, e.g. aliased, would compile again)."""
    compiled, eager = engines
    runner = compiled.engine.runner
    compiled.engine.warm_up((2,))
    assert (2, False) in runner.compiled.traced and runner.compiled.recompiles == 0
    eager.engine.warm_up((2,))  # an eager engine: nothing to do
    prompts = prompts_for(tokenizer, 2)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    steps = runner.compiled.steps
    got, want = (_generate(llm, prompts, [None, None], params) for llm in (compiled, eager))
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert runner.compiled.steps - steps >= 3 and runner.compiled.recompiles == 0


def test_two_engines_on_different_weights_each_run_their_own_graph(tiny_models, tokenizer):
    """A graph traced before is called with Dynamo's differentiating guards only. Two engines
    of one process whose models differ only in their weights (frozen into each graph) share
    one code object and one cache: stepping them in turn, each keeps its own weights' tokens."""
    llms = [LLM(tiny_models("llama", seed=seed), [], compile="on", **SETTINGS) for seed in (0, 1)]
    eager = [LLM(tiny_models("llama", seed=seed), [], compile="off", **SETTINGS) for seed in (0, 1)]
    prompt = prompts_for(tokenizer, 1)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    for _ in range(2):  # the second round: every graph traced, called on its differentiating guards
        for llm, reference in zip(llms, eager):
            got, want = (_generate(x, prompt, [None], params)[0].token_ids for x in (llm, reference))
            assert got == want
    want = [_generate(x, prompt, [None], params)[0].token_ids for x in eager]
    assert want[0] != want[1]  # the two models do differ
    assert all(llm.engine.runner.compiled.steps >= 10 for llm in llms)


def test_slot_stack_deltas_equal_the_per_adapter_reference(base, adapters, tmp_path):
    """The graph's LoRA math (every row reads its own slot of the stacks) against the
    reference's per-adapter matmuls, for every fused projection of every layer: adapters of
    two ranks (zero-padded in the stacks), a ForkKV-layout adapter (k/v LoRA kept out of K/V),
    rows without adapter; a step of more adapters than ``max_loras`` is refused (it runs eager)."""
    from kvshare.kernels.lora import gathered_lora_ref, lora_groups
    from kvshare.random_adapters import random_adapter
    from kvshare.serve.exec.adapters import AdapterSet
    from kvshare.serve.exec.lora_slots import LoraSlots, lora_delta
    from kvshare.serve.exec.model import Model

    model = Model(base)
    adapter_set = AdapterSet(base, torch.float32)
    adapter_set.residual_rank = 64
    rank_12 = random_adapter("lora", base, tmp_path, "lora-r12", rank=12, seed=9)  # the fixtures' are rank 4
    for path in (adapters["lora-a"], rank_12, adapters["lora-b"], adapters["alora-a"]):
        adapter_set.load(path, kv_layout="forkkv" if path == adapters["lora-b"] else None)
    slots = LoraSlots(model, max_loras=3, max_rank=64)
    slots.sync(adapter_set)
    assert not slots.serves([0, 1, 2, 3]) and slots.serves([0, 1, 2]) and slots.rank == 16
    row_slots = [-1, 0, 2, 1, 0, -1, 2]
    groups = lora_groups(row_slots)
    index, scale = slots.row_inputs(groups, len(row_slots) + 1, torch.device("cpu"))  # one pad row
    gen = torch.Generator().manual_seed(0)
    stacks = slots.stacks
    for layer in range(model.n_layers):
        for fused, parts in model.fused.items():
            n_in = slots.shapes[parts[0][0]][0]
            x = torch.randn(len(row_slots) + 1, n_in, generator=gen)
            y = torch.randn(len(row_slots) + 1, sum(out for _, out in parts), generator=gen)
            want = gathered_lora_ref(x[:-1], y[:-1], groups, adapter_set.lookup(layer, parts))
            got = y + torch.cat([lora_delta(x, stacks[name][0][layer], stacks[name][1][layer], index, scale)
                                 for name, _ in parts], -1)
            torch.testing.assert_close(got[:-1], want, atol=1e-5, rtol=1e-5)
            assert torch.equal(got[-1], y[-1]) and torch.equal(got[0], y[0])  # no adapter: exactly y


def test_adapters_load_into_the_slots_without_a_recompile(base, adapters, tokenizer):
    """With one slot, as vLLM's max_loras: each adapter is written into it when a step needs it
    (both run compiled), of two adapters' requests sent at once the second waits for the first
    to end (a step of both would run eager), and an adapter loaded after an unload reuses the
    graph; every output equals the eager engine's."""
    compiled = LLM(base, [adapters["icarus-a"], adapters["lora-a"]], compile="on", max_loras=1, **SETTINGS)
    eager = LLM(base, [adapters["icarus-a"], adapters["lora-a"]], compile="off", **SETTINGS)
    runner = compiled.engine.runner
    prompt = prompts_for(tokenizer, 1)
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    for name in ("icarus-a", "lora-a"):
        steps = runner.compiled.steps
        got, want = (_generate(llm, prompt, [name], params)[0].token_ids for llm in (compiled, eager))
        assert got == want and runner.compiled.steps > steps  # swapped into the one slot
    prompts = prompts_for(tokenizer, 2)
    names = ["icarus-a", "lora-a"]
    run = runner.run
    adapters_per_step = []

    def counting(plans, adapter_set):
        adapters_per_step.append(({p.seq.adapter_slot for p in plans}, sum(p.num_rows for p in plans)))
        return run(plans, adapter_set)

    runner.run = counting
    steps, swaps = runner.compiled.steps, runner.compiled.lora.swaps
    got = [o.token_ids for o in _generate(compiled, prompts, names, params)]
    runner.run = run
    assert got == [o.token_ids for o in _generate(eager, prompts, names, params)]
    assert all(len(held) == 1 for held, _ in adapters_per_step)  # never both adapters in one step
    fitting = [rows for _, rows in adapters_per_step if rows <= runner.compiled.buckets[-1]]
    assert runner.compiled.steps - steps == len(fitting) >= 2 * (params.max_tokens - 1)  # all but prefills compiled
    assert runner.compiled.lora.swaps > swaps
    for llm in (compiled, eager):
        llm.engine.unload_adapter("icarus-a")
        llm.engine.load_adapter(adapters["icarus-b"])  # into slot 0
    steps = runner.compiled.steps
    got, want = (_generate(llm, prompt, ["icarus-b"], params)[0].token_ids for llm in (compiled, eager))
    assert got == want and runner.compiled.steps > steps and runner.compiled.recompiles == 0


def test_a_projection_adapted_later_compiles_the_graph_again(base, adapters, tokenizer):
    """ICaRus adapters leave k/v to the base: the graph adapts 5 projections (k/v get rank-0
    stacks). A LoRA adapter loaded later adapts all 7: the graph with adapters compiles again
    (not counted as a failed guard), and every output still equals the eager engine's."""
    from kvshare.serve.exec.lora_slots import PARTS

    compiled = LLM(base, [adapters["icarus-a"]], compile="on", **SETTINGS)
    eager = LLM(base, [adapters["icarus-a"]], compile="off", **SETTINGS)
    step = compiled.engine.runner.compiled
    prompt = prompts_for(tokenizer, 1)
    params = SamplingParams(max_tokens=5, ignore_eos=True)

    def same_as_eager(name: str) -> None:
        steps = step.steps
        got, want = (_generate(llm, prompt, [name], params)[0].token_ids for llm in (compiled, eager))
        assert got == want and step.steps > steps

    same_as_eager("icarus-a")
    assert step.lora.parts == ("q_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    assert [t.shape[-2] for t in step.lora.inputs()[2:6]] == [0, 0, 0, 0]  # k and v: A and B
    for llm in (compiled, eager):
        llm.engine.load_adapter(adapters["lora-a"])
    same_as_eager("lora-a")
    same_as_eager("icarus-a")
    assert step.lora.parts == PARTS and step.recompiles == 0


@pytest.mark.skipif(cpu.extension() is None
                    or not cpu.extension().linear_vnni_available(), reason="this CPU has no AVX512-BF16")
def test_bfloat16_projections_in_dot_products_score_as_the_eager_step(base, adapters, tokenizer, monkeypatch):
    """KVSHARE_CPU_GEMM=vnni (the default where the CPU has AVX512-BF16 and no AMX): the graph's
    projections of decode buckets run in :mod:`kvshare.kernels.cpu.linear`. Every compiled step
    of a mixed base / LoRA / ICaRus batch is also run eagerly (``F.linear``) on the same batch:
    the logits agree within bfloat16 rounding of differently ordered sums, as the int8 test's do
    (measured on AMD EPYC: 4.4% of the largest logit, 2.1% with Inductor's GEMM template in its
    place; a wrong or misplaced weight is off by the logits' whole size)."""
    monkeypatch.setenv("KVSHARE_CPU_GEMM", "vnni")
    llm = LLM(base, [adapters["lora-a"], adapters["icarus-a"]], compile="on", dtype="bfloat16", **SETTINGS)
    step = llm.engine.runner.compiled
    _, graphs, head_packed = step._prepare()
    decoders = [graph._orig_mod for graph in graphs.values()]
    assert all(d.vnni and hasattr(d, "l0_qkv_vnni") for d in decoders) and head_packed is not None
    assert decoders[0].l0_qkv_vnni.data_ptr() == decoders[1].l0_qkv_vnni.data_ptr()  # packed once for both graphs
    _assert_steps_score_as_eager(llm, tokenizer, monkeypatch)


def test_a_server_asked_to_warm_up_compiles_before_it_answers(base, adapters):
    """``kvshare serve --warm-up``: the app is built only once every bucket's graph exists,
    with the loaded adapters' graph too, so no request waits for a compile."""
    from kvshare.serve import LLMEngine
    from kvshare.serve.http.server import create_app

    engine = LLMEngine(base, [adapters["icarus-a"]], kv_cache_tokens=256, block_size=4, compile="on",
                       compile_max_rows=1, warm_up=True)
    app = create_app(engine)
    try:
        assert set(engine.runner.compiled.traced) == {(1, False), (1, True)}
    finally:
        app.state.engine_thread.shutdown()


def test_a_compile_that_fails_serves_eager_instead_of_failing_requests(base, adapters, tokenizer, caplog,
                                                                      monkeypatch):
    """No C++ toolchain, an op Inductor cannot build: the first call of a graph raises. The
    step, and every later one, runs eager (logged once); no request ends in an error."""
    llm = LLM(base, list(adapters.values()), compile="on", **SETTINGS)
    step = llm.engine.runner.compiled
    calls = []

    def broken(*args):
        calls.append(len(args))
        raise RuntimeError("C compiler not found")

    monkeypatch.setattr(compiled_module, "call_in_fresh_chunk", broken)
    eager = LLM(base, list(adapters.values()), compile="off", **SETTINGS)
    prompts, names = prompts_for(tokenizer, 2), [None, "icarus-a"]
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    with caplog.at_level("WARNING"):
        got = _generate(llm, prompts, names, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in _generate(eager, prompts, names, params)]
    assert len(calls) == 1 and "C compiler not found" in step.unavailable and step.steps == 0
    assert sum("compiling the CPU step failed" in r.message for r in caplog.records) == 1
    llm.engine.warm_up_all()  # nothing to compile once it gave up
    assert len(calls) == 1


def test_auto_lowers_graphs_in_the_background_while_steps_run_eager(base, adapters, tokenizer, monkeypatch):
    """``compile="auto"``: the first steps of a bucket run eager (no step waits for a compile)
    and queue its graph on the process's compile worker; once lowered, the same steps run it,
    with the eager engine's tokens throughout, and no graph is compiled twice."""
    from kvshare.serve.exec.background_compile import compile_worker

    monkeypatch.setenv("KVSHARE_COMPILE", "auto")
    llm = LLM(base, list(adapters.values()), compile="auto", **SETTINGS)
    eager = LLM(base, list(adapters.values()), compile="off", **SETTINGS)
    step = llm.engine.runner.compiled
    assert step.background and not step.traced
    prompts, names = prompts_for(tokenizer, 2), [None, "icarus-a"]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    want = [o.token_ids for o in _generate(eager, prompts, names, params)]
    first = _generate(llm, prompts, names, params)
    assert [o.token_ids for o in first] == want
    assert compile_worker().wait_idle(timeout=900), "the background compiles did not finish"
    assert step.traced == {(4, True)}  # the decode steps' bucket (base row + ICaRus pair), with its deltas
    before = step.steps
    again = _generate(llm, prompts, names, params)
    assert [o.token_ids for o in again] == want
    assert step.steps - before >= 5 and step.recompiles == 0 and not compile_worker().failed
    monkeypatch.setenv("KVSHARE_COMPILE_BACKGROUND", "0")  # as `kvshare bench` sets it: compiles in the foreground
    assert not LLM(base, compile="auto", **SETTINGS).engine.runner.compiled.background


def test_a_short_job_exits_without_waiting_for_its_background_compile(base, tmp_path):
    """A process that generates a few tokens with ``compile="auto"`` and ends: its graph is
    still being lowered on the daemon worker, and the process exits cleanly all the same."""
    import subprocess
    import sys

    script = tmp_path / "short_job.py"
    script.write_text(
        "import sys\n"
        "from kvshare.serve import LLM, SamplingParams\n"
        "from kvshare.serve.exec.background_compile import compile_worker\n"
        f"llm = LLM({str(base)!r}, compile='auto', kv_cache_tokens=512, block_size=4)\n"
        "out = llm.generate(['one two three'], SamplingParams(max_tokens=4, ignore_eos=True))\n"
        "print('tokens', len(out[0].token_ids), 'compiled', llm.engine.runner.compiled.steps, "
        "'pending', compile_worker().pending() > 0, flush=True)\n")
    env = {**__import__("os").environ, "KVSHARE_COMPILE": "auto"}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "tokens 4 compiled 0 pending True" in done.stdout, done.stdout + done.stderr[-2000:]
    assert "Traceback" not in done.stderr


def test_a_compile_on_another_thread_runs_with_the_raised_recompile_limits(base, monkeypatch):
    """Dynamo's limits are per thread: a graph compiled on the server's engine thread or the
    background worker must see ours (the default 8 failed a server's ninth graph after the
    first eight had been paid for), whatever the thread that built the engine set."""
    import threading

    import torch._dynamo

    llm = LLM(base, compile="on", **SETTINGS)
    seen = []

    def record(*args):
        seen.append((torch._dynamo.config.recompile_limit, torch._dynamo.config.accumulated_recompile_limit))
        raise RuntimeError("recorded")

    monkeypatch.setattr(compiled_module, "call_in_fresh_chunk", record)
    worker = threading.Thread(target=llm.engine.warm_up, args=((1,),))
    worker.start()
    worker.join()
    assert seen == [tuple(compiled_module.RECOMPILE_LIMITS.values())]
