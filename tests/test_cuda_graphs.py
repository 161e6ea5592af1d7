"""The CUDA-graph step against the eager engine: the same tokens for every adapter kind, no KV
written from a pad row, buffers left from a larger step harmless. On CPU :class:`GraphedStep`
runs with ``capture=False``: exactly what a graph records (static buffers, padded rows and
sequences, a fixed attention grid, slot stacks), through the Triton kernels in Triton's
interpreter. With ``KVSHARE_TEST_DEVICE=cuda`` on a GPU the engines run there and the graphs
are recorded and replayed for real (``results/engine-gpu/scripts/graphs.sh``)."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from kvshare.errors import KvshareError
from kvshare.kernels import Kernels
from kvshare.serve import LLM, SamplingParams
from kvshare.serve.exec.cuda_graphs import GraphedStep, graphs_wanted
from kvshare.serve.exec.model import Model

from test_compiled_step import _chunk_beside_decoding, _generate, assert_only_running_sequences_wrote
from test_engine import adapters, base, invocation, prompts_for, tokenizer  # noqa: F401

pytestmark = pytest.mark.skipif(torch.cuda.is_available() and os.environ.get("KVSHARE_TEST_DEVICE") != "cuda",
                                reason="on a GPU machine these run with KVSHARE_TEST_DEVICE=cuda")

SETTINGS = dict(kv_cache_tokens=1024, block_size=4, kernels="triton", compile="off")


def _graphed(llm: LLM) -> GraphedStep:
    runner = llm.engine.runner
    runner.compiled = GraphedStep(runner.model, llm.engine.config.block_size, 16,
                                  capture=runner.device.type == "cuda")
    return runner.compiled


@pytest.fixture(scope="module")
def engines(base, adapters):
    graphed = LLM(base, list(adapters.values()), **SETTINGS)
    _graphed(graphed)
    return graphed, LLM(base, list(adapters.values()), **SETTINGS)


def test_a_mixed_step_of_every_kind_gives_the_eager_tokens(engines, tokenizer, invocation):
    """Base, LoRA, ICaRus (a pair of rows) and aLoRA decode side by side in the 8-row bucket;
    requests end at different steps, so later steps run smaller buckets over buffers that still
    hold the larger steps' rows."""
    graphed, eager = engines
    prompts = prompts_for(tokenizer, 3)
    prompts.append(prompts[0] + invocation)
    names = [None, "lora-a", "icarus-a", "alora-a"]
    step = graphed.engine.runner.compiled
    before = step.steps
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (9, 3, 6, 5)]
    outputs = []
    for llm in (graphed, eager):
        engine, done = llm.engine, {}
        ids = [engine.add_request(p, s, adapter=n) for p, s, n in zip(prompts, params, names)]
        while engine.has_unfinished():
            done.update({o.request_id: o for o in engine.step() if o.finished})
        assert all(done[i].finish_reason == "length" for i in ids)
        outputs.append([done[i].token_ids for i in ids])
    assert outputs[0] == outputs[1]
    assert step.steps - before >= 8  # the decode steps ran through the graph code
    assert {(8, True, 2), (4, True, 2), (1, False, 1)} <= set(step.graphs)  # ICaRus pairs: 2 rows a sequence


def test_adapters_that_leave_projections_unadapted_run_in_the_graph(base, adapters, tokenizer, invocation):
    """An aLoRA and a q/v LoRA adapt q/k/v only: o, gate/up and down have no part to add
    (the one-launch-per-fused-projection call failed on them, and the engine went eager)."""
    names = ["alora-a", "lora-b"]
    graphed, eager = (LLM(base, [adapters[n] for n in names], **SETTINGS) for _ in range(2))
    step = _graphed(graphed)
    prompts = [prompts_for(tokenizer, 1)[0] + invocation, prompts_for(tokenizer, 2)[1]]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    got, want = (_generate(llm, prompts, names, params) for llm in (graphed, eager))
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert step.unavailable is None and step.steps >= 5 and set(step.lora.parts) == {"q_proj", "k_proj", "v_proj"}


def test_pad_rows_never_write_the_cache(engines, tokenizer):
    """Three decode rows run in the 4-row bucket; only the three real rows' slots change."""
    graphed, _ = engines
    engine = graphed.engine
    engine.reset_prefix_cache()
    kv = engine.runner.kv_cache
    for p in [p[:7] for p in prompts_for(tokenizer, 3)]:
        engine.add_request(p, SamplingParams(max_tokens=3, ignore_eos=True))
    engine.step()  # the prompts (21 rows: eager)
    step = engine.runner.compiled
    step.warm_up(kv, (4,))  # the bucket's graph exists: the step below only fills the buffers
    step.slots.fill_(0)  # what an earlier, larger step may have left: a live slot in the pad row
    step.tokens.fill_(5)
    step.loc.fill_(len(step.tokens))  # pad sequences over the pad rows and past the 4-row bucket
    before, steps = kv.clone(), step.steps
    engine.step()  # 3 decode rows, padded to 4
    assert step.steps == steps + 1
    assert step.slots[3].item() == -1 and step.loc[4].item() == 3  # pad row: no slot; pad sequence: no rows
    assert_only_running_sequences_wrote(engine, before, 7)


def test_a_prompt_chunk_beside_decoding_sequences_runs_apart_from_them(engines, tokenizer):
    """The decode rows of a step with a 40-row prompt chunk go through the graph, the chunk
    eager; the tokens are the eager engine's."""
    graphed, eager = engines
    rows, in_step, in_run, tokens = _chunk_beside_decoding(graphed, tokenizer)
    assert rows == [4, 40] and in_step == 1 and in_run >= 6
    assert tokens == _chunk_beside_decoding(eager, tokenizer)[3]


@pytest.mark.parametrize("length", [300, 250])
def test_block_tables_past_the_buffer_widen_it(base, tokenizer, length):
    """A context of more blocks than the table buffer holds (64 columns of 4 tokens) widens it
    and records the graphs again, from the first decode step (300 tokens: 75 blocks) or once
    decoding crosses 256 tokens, which drops graphs already recorded (on a GPU their memory
    pool went with them: recording into it again failed an assertion of PyTorch's allocator,
    and the engine went eager); the tokens stay the eager engine's."""
    graphed, eager = LLM(base, **SETTINGS), LLM(base, **SETTINGS)
    step = _graphed(graphed)
    prompt = (sum(prompts_for(tokenizer, 3), []) * 20)[:length]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    got, want = (_generate(llm, [prompt], [None], params) for llm in (graphed, eager))
    assert got[0].token_ids == want[0].token_ids
    assert step.unavailable is None and step.tables.shape[1] == 128 and step.steps == 11


def test_a_graph_that_cannot_be_recorded_leaves_the_engine_eager(engines, tokenizer, monkeypatch, caplog):
    """A recording that fails (an op a graph cannot capture, on a model or GPU never tried) is
    logged once; that step and every later one run eager, with the eager tokens, and no
    request fails."""
    graphed, eager = engines
    step = GraphedStep(graphed.engine.runner.model, graphed.engine.config.block_size, 16, capture=True)
    monkeypatch.setattr(graphed.engine.runner, "compiled", step)
    attempts = []

    def unrecordable(self, key, kv_cache):
        attempts.append(key)
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(GraphedStep, "_record", unrecordable)
    prompts, names = prompts_for(tokenizer, 2), [None, "icarus-a"]
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    with caplog.at_level(logging.WARNING):
        got = _generate(graphed, prompts, names, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in _generate(eager, prompts, names, params)]
    assert step.unavailable == "RuntimeError: operation not permitted when stream is capturing"
    assert len(attempts) == 1 and step.steps == 0 and not step.graphs
    assert caplog.text.count("decode steps run eager") == 1
    assert "retrying" not in caplog.text  # the step went eager at once, not through the engine's failure path
    step.warm_up(graphed.engine.runner.kv_cache)  # nothing to record any more: returns quietly
    assert len(attempts) == 1


def _base_and_pair_launches(step: GraphedStep, runner, size: int):
    """The kernels a graph of ``size`` rows records for a base step and for ICaRus pairs, and
    the fused projections some adapter adapts."""
    from kvshare.kernels.triton.launch_count import count_launches

    counts = []
    for adapted, rows in ((False, 1), (True, 2)):
        with torch.no_grad(), count_launches() as launched:
            step._decode(runner.kv_cache, size, adapted, rows)
        counts.append(launched)
    fused = {name for name, parts in runner.model.fused.items() if any(p in step.lora.parts for p, _ in parts)}
    return counts, fused


def test_a_graphed_pair_step_adds_one_kernel_per_adapted_fused_projection(engines):
    """What a graph records bounds its GPU time (a few microseconds a kernel): a pair step
    may add one BGMV launch per fused projection with an adapted part (q/k/v, o, gate/up,
    down) and layer to a base step, not one per part (session 25) nor the ten of a gather
    (session 24's graph: 2.39x a SmolLM2 base step's kernels)."""
    graphed, _ = engines
    runner = graphed.engine.runner
    step = GraphedStep(runner.model, graphed.engine.config.block_size, 16, capture=runner.device.type == "cuda")
    step.warm_up(runner.kv_cache, (2,), adapted=True, adapters=graphed.engine._adapters)
    counts, fused = _base_and_pair_launches(step, runner, 2)
    projections = len(fused) * runner.model.n_layers
    added = sum(counts[1].values()) - sum(counts[0].values())
    bgmv = counts[1]["triton:_fused_kernel"] + counts[1]["triton:_parts_kernel"]
    assert len(step.lora.parts) > len(fused) and counts[1]["triton:_parts_kernel"]  # parts that share a launch
    assert projections and added == projections == bgmv, (added, projections)


def test_fused_lora_projections_give_the_eager_tokens_with_a_base_steps_kernel_count(base, adapters, tokenizer,
                                                                                      monkeypatch):
    """``KVSHARE_GRAPH_LORA=fused``: each adapted projection and its rows' deltas are one Triton
    launch, so a pair step records as many kernels as a base step (the LoRA launch gone, the
    projection's own replaced), and ICaRus and LoRA agents still get the eager engine's tokens."""
    monkeypatch.setenv("KVSHARE_GRAPH_LORA", "fused")
    names = ["icarus-a", "lora-a"]
    graphed, eager = (LLM(base, [adapters[n] for n in names], **SETTINGS) for _ in range(2))
    step = _graphed(graphed)
    assert step.lora_kernel == "fused"
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    got, want = (_generate(llm, prompts_for(tokenizer, 2), names, params) for llm in (graphed, eager))
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert step.unavailable is None and (4, True, 2) in step.graphs  # a pair and a LoRA row: 3 rows
    runner = graphed.engine.runner
    counts, fused = _base_and_pair_launches(step, runner, 4)
    assert counts[1]["triton:_linear_lora_kernel"] == len(fused) * runner.model.n_layers > 0
    assert sum(counts[1].values()) == sum(counts[0].values()), (counts[1], counts[0])


def test_a_graph_lora_kernel_that_does_not_exist_is_a_clear_error(base, monkeypatch):
    from kvshare.serve.exec.cuda_graphs import graph_lora_kernel

    monkeypatch.setenv("KVSHARE_GRAPH_LORA", "sgmv")
    with pytest.raises(KvshareError, match="KVSHARE_GRAPH_LORA must be one of bgmv, fused"):
        graph_lora_kernel()


def test_when_it_is_chosen(base, monkeypatch):
    """On a GPU, with the Triton attention kernels and plain projections; never on CPU."""
    monkeypatch.delenv("KVSHARE_COMPILE", raising=False)
    cuda = torch.device("cuda")
    triton_model, torch_model = Model(base, kernels=Kernels("triton")), Model(base)
    assert graphs_wanted("auto", cuda, triton_model) and graphs_wanted("on", cuda, triton_model)
    assert not graphs_wanted("off", cuda, triton_model)
    assert not graphs_wanted("on", torch.device("cpu"), triton_model)
    assert not graphs_wanted("auto", cuda, torch_model)
    with pytest.raises(KvshareError, match="--kernels triton"):
        graphs_wanted("on", cuda, torch_model)
    monkeypatch.setenv("KVSHARE_COMPILE", "off")
    assert not graphs_wanted("auto", cuda, triton_model)
