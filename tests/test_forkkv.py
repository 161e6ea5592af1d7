"""ForkKV serving: exact where nothing is shared, isolated namespaces, decoupled eviction.

A ForkKV lora agent keeps the base part of its K/V in the main pool under an owner of its
own and its rank-r residual in a pool keyed by its adapter digest. With one agent the split
is exact algebra (RoPE is linear), so outputs equal the exact LoRA engine and PEFT; shared
base parts from other agents are approximate past layer 0, which eval/perf/forkkv measures.
"""

from __future__ import annotations

import pytest
import torch

from kvshare.errors import KvshareError
from kvshare.serve import LLM, SamplingParams

from test_engine import adapters, base, hf_greedy, invocation, peft_model, prompts_for, tokenizer  # noqa: F401

BS = 4
GREEDY = SamplingParams(max_tokens=16, ignore_eos=True)


def forkkv_llm(base, adapters, **settings):
    settings = {"kv_cache_tokens": 2048, "block_size": BS, "kv_layout": "forkkv"} | settings
    return LLM(base, list(adapters.values()), **settings)


def run(llm, prompt, adapter=None, params=GREEDY):
    out = llm.generate([prompt], params, adapter=adapter)[0]
    return out.token_ids, out.metrics["prompt_tokens_cached"]


@pytest.mark.parametrize("name", ["lora-a", "lora-b"])
def test_a_single_agent_equals_the_exact_engine_and_peft(base, adapters, tokenizer, name):
    prompts = prompts_for(tokenizer, 3)
    forkkv = forkkv_llm(base, adapters).generate(prompts, GREEDY, adapter=name)
    exact = LLM(base, [adapters[name]], kv_cache_tokens=2048, block_size=BS).generate(prompts, GREEDY, adapter=name)
    reference = peft_model(base, adapters[name])
    for prompt, got, want in zip(prompts, forkkv, exact):
        assert got.token_ids == want.token_ids == hf_greedy(reference, prompt, GREEDY.max_tokens)


def test_forkkv_rows_beside_exact_rows_change_nothing(base, adapters, tokenizer):
    """One step holding base, ICaRus, aLoRA, exact LoRA and ForkKV rows gives each what it gets alone."""
    llm = LLM(base, [], kv_cache_tokens=4096, block_size=BS)
    for name, path in adapters.items():
        llm.engine.load_adapter(path, name)
    llm.engine.load_adapter(adapters["lora-a"], "lora-a-forkkv", kv_layout="forkkv")
    names = [None, "icarus-a", "lora-a", "lora-a-forkkv", "lora-b", "alora-a"]
    prompts = [p + [i + 3] for i, p in enumerate(prompts_for(tokenizer, 3) * 2)]
    prompts[3] = prompts[2]  # exact LoRA and ForkKV, same adapter, same prompt
    together = llm.generate(prompts, GREEDY, adapter=names)
    for prompt, name, out in zip(prompts, names, together):
        alone = LLM(base, [], kv_cache_tokens=4096, block_size=BS)
        if name is not None:
            alone.engine.load_adapter(adapters[name.removesuffix("-forkkv")], name,
                                      kv_layout="forkkv" if name.endswith("forkkv") else None)
        assert out.token_ids == run(alone, prompt, name)[0], name
    assert together[2].token_ids == together[3].token_ids  # ForkKV alone equals exact LoRA


@pytest.mark.parametrize("name", [None, "icarus-a", "alora-a", "lora-a-exact"])
def test_exact_kinds_never_read_forkkv_blocks(base, adapters, tokenizer, invocation, name):
    llm = forkkv_llm(base, adapters)
    llm.engine.load_adapter(adapters["lora-a"], "lora-a-exact", kv_layout="exact")
    prompt = prompts_for(tokenizer, 1)[0] * 2 + invocation
    run(llm, prompt, "lora-a")
    assert run(llm, prompt, name)[1] == 0


def test_residuals_are_private_to_their_adapter(base, adapters, tokenizer):
    llm = forkkv_llm(base, adapters)
    prompt = prompts_for(tokenizer, 1)[0] * 2
    full = len(prompt) // BS * BS
    run(llm, prompt, "lora-a")
    before = llm.engine.stats()
    assert run(llm, prompt, "lora-b")[1] == 0  # base part found, residual not: recomputed
    after = llm.engine.stats()
    assert after["forkkv_residual_hit_tokens"] == before["forkkv_residual_hit_tokens"]
    assert after["forkkv_base_read_tokens"] - before["forkkv_base_read_tokens"] == full  # but held once
    assert run(llm, prompt, "lora-a")[1] == full  # its own residual and the shared base part
    assert llm.engine.stats()["forkkv_residual_hit_tokens"] - after["forkkv_residual_hit_tokens"] == full


def test_forkkv_reads_exact_base_blocks_but_never_writes_them(base, adapters, tokenizer):
    llm = forkkv_llm(base, adapters)
    prompt = prompts_for(tokenizer, 1)[0] * 2
    base_out, _ = run(llm, prompt)
    blocks = sorted({b for b, key in enumerate(llm.engine._blocks.blocks) if key.key is not None})
    snapshot = llm.engine.runner.kv_cache[blocks].clone()
    run(llm, prompt, "lora-a")
    assert llm.engine.stats()["prefix_hit_tokens_forkkv_base"] == 0  # residual missing: nothing resumed
    assert torch.equal(llm.engine.runner.kv_cache[blocks], snapshot)  # base blocks untouched
    assert llm.engine.kv_usage()["kv"]["blocks_in_use"] == 0
    tokens, cached = run(llm, prompt, "lora-a")  # now its residual is cached: base part + residual reused
    assert cached == len(prompt) // BS * BS
    assert run(llm, prompt) == (base_out, len(prompt) // BS * BS)  # the base still reads its own KV


def test_exact_base_blocks_in_the_host_tier_load_back_for_forkkv(base, adapters, tokenizer):
    """A ForkKV agent whose residual is cached reads the base's exact blocks as its base part:
    where those went to the host tier, they load back instead of being recomputed, and the
    tokens are those of an engine that never evicted them."""
    prompt = prompts_for(tokenizer, 1)[0] * 2
    roomy = forkkv_llm(base, adapters)
    run(roomy, prompt)
    run(roomy, prompt, "lora-a")
    expected = run(roomy, prompt, "lora-a")
    llm = forkkv_llm(base, adapters, kv_cache_tokens=32 * BS, host_cache_tokens=1024)
    run(llm, prompt)  # the exact base blocks
    run(llm, prompt, "lora-a")  # its residual (the base part read from the exact blocks)
    for other in prompts_for(tokenizer, 4)[1:]:  # push the exact blocks out to the host tier
        run(llm, other * 3)
    assert llm.engine.stats()["host_offloaded_blocks"] > 0
    loaded = llm.engine.stats()["host_loaded_blocks"]
    assert run(llm, prompt, "lora-a") == expected
    assert llm.engine.stats()["host_loaded_blocks"] > loaded


def test_blocks_after_a_reused_exact_base_block_link_to_it(base, adapters, tokenizer):
    """Eviction takes leaves first, keeping a block while blocks that continue it are cached: a
    ForkKV request that resumed on exact base blocks links its own next blocks to the key those
    are stored under (it linked them to its own namespace's key, which no block has, so the
    base block looked like a leaf)."""
    llm = forkkv_llm(base, adapters)
    prompt = prompts_for(tokenizer, 1)[0] * 2
    run(llm, prompt)
    run(llm, prompt, "lora-a", SamplingParams(max_tokens=3 * BS, ignore_eos=True))
    manager = llm.engine._blocks
    keys = {info.key for info in manager.blocks if info.key is not None}
    parents = [info.parent for info in manager.blocks if info.parent is not None]
    assert len(parents) > len(prompt) // BS  # the base's chain and the ForkKV request's own blocks
    assert all(parent in keys for parent in parents)


def test_layer_zero_base_part_is_the_base_models_kv(base, adapters, tokenizer):
    """At layer 0 every agent's hidden state is the embedding, so the shared part is exact
    there; past it, the adapter's hidden states make it differ."""
    prompt = prompts_for(tokenizer, 1)[0]
    pools = []
    for adapter in (None, "lora-a"):
        llm = forkkv_llm(base, adapters)
        run(llm, prompt, adapter, SamplingParams(max_tokens=1))  # only the prompt's full blocks stay
        blocks = [b for b, info in enumerate(llm.engine._blocks.blocks) if info.key is not None]
        pools.append(llm.engine.runner.kv_cache[sorted(blocks)])
    torch.testing.assert_close(pools[1][:, 0], pools[0][:, 0], atol=1e-6, rtol=1e-5)
    assert not torch.allclose(pools[1][:, 1], pools[0][:, 1], atol=1e-4)


@pytest.mark.parametrize("evict", ["residual", "base"])
def test_decoupled_eviction_recomputes_only_the_missing_part(base, adapters, tokenizer, evict):
    """Each pool evicts on its own; a request whose other part survived resumes from the
    shorter cached prefix and gets the same tokens."""
    prompt = prompts_for(tokenizer, 2)[1] * 2
    full = len(prompt) // BS * BS
    small = {"forkkv_residual_tokens": 96} if evict == "residual" else {"kv_cache_tokens": 96}
    llm = forkkv_llm(base, adapters, **small)
    first, _ = run(llm, prompt, "lora-a")
    stats = llm.engine.stats()
    filler = prompts_for(tokenizer, 3)[2] * 3
    run(llm, filler, "lora-b" if evict == "residual" else None)  # fills the pool under test
    again, cached = run(llm, prompt, "lora-a")
    assert again == first
    after = llm.engine.stats()
    residual_hits = after["forkkv_residual_hit_tokens"] - stats["forkkv_residual_hit_tokens"]
    if evict == "residual":  # base part all there, residual only a prefix: resume from it
        assert after["forkkv_residual_evictions"] > stats["forkkv_residual_evictions"]
        assert after["evictions"] == stats["evictions"]
        assert cached == residual_hits < full
    else:  # residual all there, base part only a prefix: resume from that
        assert after["evictions"] > stats["evictions"] and after["forkkv_residual_evictions"] == 0
        assert residual_hits == full and cached < full


def test_kv_usage_reports_the_residual_pool(base, adapters, tokenizer):
    llm = forkkv_llm(base, adapters)
    run(llm, prompts_for(tokenizer, 1)[0], "lora-a")
    usage = llm.engine.kv_usage()
    res = usage["forkkv_residual"]
    assert res["blocks_holding_kv"] > 0
    per_token_base = usage["kv"]["bytes_holding_kv"] / (usage["kv"]["blocks_holding_kv"] * BS)
    per_token_res = res["bytes_holding_kv"] / (res["blocks_holding_kv"] * BS)
    assert per_token_res < per_token_base  # rank r per layer, not kv_heads x head_dim


def test_forkkv_is_refused_where_it_cannot_hold(base, adapters, tiny_models):
    llm = LLM(base, [], kv_cache_tokens=256, block_size=BS)
    with pytest.raises(KvshareError, match="is for lora adapters"):
        llm.engine.load_adapter(adapters["icarus-a"], kv_layout="forkkv")
    assert "forkkv_residual" not in llm.engine.kv_usage()  # refused before a residual pool was made for it
    with pytest.raises(KvshareError, match="unknown kv_layout"):
        llm.engine.load_adapter(adapters["lora-a"], kv_layout="fork")
    with pytest.raises(KvshareError, match="holds rank 1 at most"):
        LLM(base, [adapters["lora-a"]], kv_cache_tokens=256, kv_layout="forkkv", forkkv_max_rank=1)
    with pytest.raises(KvshareError, match="kv_layout must be"):
        LLM(base, [], kv_layout="forked")


def test_every_layout_name_resolves_to_its_one_row():
    """The public names (kinds.KV_LAYOUTS: EngineConfig, load_adapter, --kv-layout) each have
    one KVLayout row, and a lora spec served under a name is served with that row."""
    from kvshare.kinds import KV_LAYOUTS, serving_spec
    from kvshare.serve.kv_layout import LAYOUTS, layout_named, layout_of

    assert tuple(LAYOUTS) == KV_LAYOUTS
    for name in KV_LAYOUTS:
        assert layout_named(name).name == name and layout_of(serving_spec("lora", name)) is layout_named(name)
    assert [n for n in KV_LAYOUTS if layout_named(n).uses_residual_pool] == ["forkkv"]
    with pytest.raises(KvshareError, match="unknown kv_layout"):
        layout_named("fork")


def test_full_reuse_shares_whole_kv_among_its_agents_only(base, adapters, tokenizer):
    """The quality baseline: lora-b reads lora-a's whole K/V (so it hits everything), and no
    exact kind or ForkKV agent ever reads it."""
    llm = LLM(base, [], kv_cache_tokens=4096, block_size=BS)
    for name in ("lora-a", "lora-b"):
        llm.engine.load_adapter(adapters[name], name, kv_layout="full_reuse")
    llm.engine.load_adapter(adapters["lora-a"], "lora-a-forkkv", kv_layout="forkkv")
    llm.engine.load_adapter(adapters["icarus-a"], "icarus-a")
    prompt = prompts_for(tokenizer, 1)[0] * 2
    run(llm, prompt, "lora-a")
    assert run(llm, prompt, "lora-b")[1] == len(prompt) // BS * BS
    for name in ("lora-a-forkkv", "icarus-a"):  # (neither writes blocks the next could read)
        assert run(llm, prompt, name)[1] == 0, name
    assert llm.engine.stats()["prefix_hit_tokens_lora_full_reuse"] == len(prompt) // BS * BS


def test_hidden_states_show_where_shared_kv_diverges(base, adapters, tokenizer):
    """Agent lora-b answering over lora-a's context: with ForkKV the per-layer hidden states
    stay closer to exact than with full reuse; its own context alone, ForkKV is exact."""
    context = prompts_for(tokenizer, 2)[1] * 2
    question = context + prompts_for(tokenizer, 1)[0]
    states = {}
    for layout in ("exact", "forkkv", "full_reuse"):
        llm = LLM(base, [], kv_cache_tokens=4096, block_size=BS)
        for name in ("lora-a", "lora-b"):
            llm.engine.load_adapter(adapters[name], name, kv_layout=layout)
        run(llm, context, "lora-a")  # the first agent computes the shared context
        states[layout] = llm.engine.hidden_states(question, "lora-b")
    alone = LLM(base, [adapters["lora-b"]], kv_cache_tokens=4096, block_size=BS, kv_layout="forkkv")
    torch.testing.assert_close(alone.engine.hidden_states(question, "lora-b"), states["exact"],
                               atol=1e-4, rtol=1e-4)
    cosine = {k: torch.nn.functional.cosine_similarity(v, states["exact"], dim=-1) for k, v in states.items()}
    assert cosine["forkkv"].min() > cosine["full_reuse"].min()
    assert cosine["forkkv"].mean() < 1 - 1e-7  # the shared part is not lora-b's own: not exact
    assert states["exact"].shape == (alone.engine.model.n_layers, alone.engine.model.config.hidden_size)


def test_forkkv_agents_through_the_server_and_the_workflow_runtime(base, adapters, tokenizer):
    """Two lora agents take ReAct turns over HTTP: with ForkKV they resume exactly where exact
    LoRA agents do (each from its own residual) while the history's base part is held once."""
    import asyncio

    from kvshare.serve import LLMEngine
    from kvshare.serve.workflow import Agent, RoundRobin, ServerBackend, Workflow
    from test_server import KEY, running_server

    history = [t for p in prompts_for(tokenizer, 3) for t in p] * 3
    agents = [Agent("planner", "lora-a", "You plan."), Agent("checker", "lora-b", "You check.")]
    runs = {}
    for layout in ("exact", "forkkv"):
        engine = LLMEngine(base, [adapters["lora-a"], adapters["lora-b"]], kv_cache_tokens=4096, block_size=BS,
                           kv_layout=layout)
        with running_server(engine) as server:
            import openai

            cards = {m.id: m.model_extra for m in openai.OpenAI(base_url=server["url"] + "/v1", api_key=KEY)
                     .models.list().data}
            assert cards["lora-a"]["kv_sharing"] == ("forkkv" if layout == "forkkv" else "none")
            flow = Workflow(0, ServerBackend(server["url"] + "/v1", KEY, "tiny-base", tokenizer, ignore_eos=True),
                            history, max_tokens=5)
            asyncio.run(flow.react(RoundRobin(agents), turns=4))
        runs[layout] = (flow.records, engine.kv_usage(), engine.stats())
    (exact, exact_usage, _), (fork, fork_usage, fork_stats) = runs["exact"], runs["forkkv"]
    # the first two calls see the same tokens in both modes (the first agent's first answer is
    # exact); later ones hold the second agent's approximate answer (its text, tokenised
    # again), so only the third call, which resumes from the first agent's own first call, is
    # compared: it resumes exactly where exact LoRA does
    assert [r.prompt_tokens for r in fork[:2]] == [r.prompt_tokens for r in exact[:2]]
    assert [r.cached_tokens for r in fork[:3]] == [r.cached_tokens for r in exact[:3]]
    assert fork[2].cached_tokens > 0 and fork[3].cached_tokens > 0
    assert fork_stats["prefix_hit_tokens_forkkv_base"] > 0
    assert fork_usage["kv"]["blocks_holding_kv"] < exact_usage["kv"]["blocks_holding_kv"]


def test_forkkv_benchmark_measures_memory_concurrency_and_workflows(tiny_models, tmp_path):
    """Figures are printed, not asserted; what must hold regardless of speed is: the measured
    KV bytes follow 1/N + r/n, ForkKV fits more agents in the same bytes, every mode ran."""
    from kvshare.eval.perf.forkkv import run_forkkv_bench

    results = run_forkkv_bench(model=str(tiny_models("llama")), agent_counts=(2, 4), context_tokens=64, rank=4,
                               block_size=8, concurrent=6, budget_contexts=2, decode_tokens=4, workflow_agents=2,
                               workflow_qps=(50.0,), workflows=2, turns=2, out_dir=tmp_path)
    for row in results["memory"]:
        assert abs(row["off_formula"]) < 0.05 and row["measured_ratio"] < 1
    peak = {r["mode"]: r["peak_running"] for r in results["concurrency"]}
    assert peak["forkkv"] > peak["lora"] and peak["forkkv"] == 6
    assert {p["mode"] for p in results["workflow"]["points"]} == {"icarus", "lora", "forkkv"}
    for name in ("forkkv_bench.json", "forkkv_bench.md", "forkkv_memory.png"):
        assert (tmp_path / name).stat().st_size > 0


def test_a_short_residual_pool_preempts_forkkv_agents_only(base, adapters, tokenizer):
    """Only ForkKV sequences hold residual blocks: when that pool is short, preempting a newer
    base request frees nothing it needs (it used to be the first preempted)."""
    prompts = [p[:12] for p in prompts_for(tokenizer, 3)]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    requests = [(prompts[0], "lora-a"), (prompts[1], "lora-b"), (prompts[2], None)]  # the base request is newest
    roomy = forkkv_llm(base, adapters)
    expected = [roomy.generate([p], params, adapter=a)[0].token_ids for p, a in requests]
    tight = forkkv_llm(base, adapters, forkkv_residual_tokens=7 * BS)
    scheduler, preempted = tight.engine._scheduler, []
    real_preempt = scheduler._preempt
    scheduler._preempt = lambda seq: preempted.append(seq.layout.uses_residual_pool) or real_preempt(seq)
    ids = [tight.engine.add_request(p, params, adapter=a) for p, a in requests]
    done = {}
    while tight.engine.has_unfinished():
        done.update({o.request_id: o.token_ids for o in tight.engine.step() if o.finished})
    assert [done[i] for i in ids] == expected
    assert preempted and all(preempted), preempted
