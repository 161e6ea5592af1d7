"""The compiled CPU step's graphs in Inductor's on-disk cache (:mod:`kvshare.serve.exec.graph_cache`):
a second engine on the same weights loads the graph instead of compiling it and gives the same
tokens; an engine on other weights of the same shapes never loads it (the entry holds weights
packed from the first model's values); released graphs free their packed weights."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch._dynamo.utils import counters
from torch._inductor.codecache import PyCodeCache

from kvshare.serve import LLM, SamplingParams
import kvshare.serve.exec.shared_constants as shared_constants
from kvshare.serve.exec.compiled import compiler_blocker
from kvshare.serve.exec.graph_cache import WeightsKey, cache_frozen_graphs, release_compiled_graphs, weights_digest

from test_engine import base, prompts_for, tokenizer  # noqa: F401

# Inductor cannot compile where torch or its cache lies in a path with spaces (torch 2.13)
pytestmark = pytest.mark.skipif(compiler_blocker() is not None, reason=str(compiler_blocker()))

SETTINGS = dict(kv_cache_tokens=256, block_size=4)


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    return [out.token_ids for out in llm.generate(prompts, params)]


def _compiled(model, prompts) -> tuple[list[list[int]], int, int]:
    """Greedy tokens of a fresh compiled engine, and the graph-cache hits and misses its
    2-row bucket (two prompts decode side by side) made."""
    hits, misses = counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]
    llm = LLM(model, compile="on", **SETTINGS)
    llm.engine.warm_up(rows=(2,))
    made = (counters["inductor"]["fxgraph_cache_hit"] - hits, counters["inductor"]["fxgraph_cache_miss"] - misses)
    tokens = _greedy(llm, prompts)
    assert llm.engine.runner.compiled.steps >= 5  # the decode steps ran the graph
    return tokens, *made


def test_a_graph_loads_for_the_same_weights_and_never_for_others(base, tiny_models, tokenizer, tmp_path,
                                                                  monkeypatch):
    assert cache_frozen_graphs()  # the pinned torch's internals are the ones patched
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setattr(shared_constants, "MIN_BYTES", 1024)  # the tiny model's packed weights go to the store
    prompts = prompts_for(tokenizer, 2)
    first, hits, misses = _compiled(base, prompts)
    assert (hits, misses) == (0, 1)
    stored = sorted((tmp_path / "inductor" / "kvshare-constants").glob("*.safetensors"))
    assert stored  # the entry names them; their bytes lie once in the store
    again, hits, misses = _compiled(base, prompts)
    assert (hits, misses) == (1, 0)
    assert again == first == _greedy(LLM(base, compile="off", **SETTINGS), prompts)
    assert sorted((tmp_path / "inductor" / "kvshare-constants").glob("*.safetensors")) == stored

    other = tiny_models("llama", seed=1)  # same shapes, other values
    got, hits, misses = _compiled(other, prompts)
    assert (hits, misses) == (0, 1)
    assert got == _greedy(LLM(other, compile="off", **SETTINGS), prompts)


def test_the_key_names_every_byte_of_the_weights():
    weights = [("a", torch.arange(6, dtype=torch.float32).reshape(2, 3)), ("b", torch.ones(4, dtype=torch.bfloat16))]
    digest = weights_digest(weights)
    changed = [("a", weights[0][1].clone()), weights[1]]
    changed[0][1][1, 2] += 1
    assert weights_digest(changed) != digest
    assert weights_digest([("a", weights[0][1].t()), weights[1]]) != digest  # shape
    assert weights_digest([("a", weights[0][1]), ("b", torch.ones(4, dtype=torch.float16))]) != digest  # dtype
    assert weights_digest([weights[0], ("c", weights[1][1])]) != digest  # name
    assert weights_digest(list(weights)) == digest
    assert WeightsKey(digest).uuid() != WeightsKey(weights_digest(changed)).uuid()


def test_released_graphs_free_their_packed_weights(base):
    """An engine's graphs outlive it (Inductor keeps each graph's module, its packed weights
    attached, in sys.modules) until :func:`release_compiled_graphs`."""
    loaded = set(map(id, PyCodeCache.modules))
    llm = LLM(base, compile="on", **SETTINGS)
    llm.engine.warm_up(rows=(1,))
    graphs = [weakref.ref(module) for module in PyCodeCache.modules if id(module) not in loaded]
    assert graphs
    del llm
    gc.collect()
    assert all(ref() is not None for ref in graphs)
    release_compiled_graphs()
    assert all(ref() is None for ref in graphs)


def test_other_frozen_graphs_keep_their_own_weights(tmp_path, monkeypatch):
    """Another torch.compile in the process (no weights key) is not let into the cache by our
    patch: a second model of the same shape computes with its own weights."""
    assert cache_frozen_graphs()
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    x = torch.randn(4, 64)
    for seed in (0, 1):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64)).eval()
        with torch.no_grad(), torch._inductor.config.patch(freezing=True):
            got = torch.compile(model, options={"max_autotune": True})(x)
            assert torch.allclose(got, model(x), atol=1e-4)
