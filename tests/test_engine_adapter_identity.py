"""Content-addressed adapter KV: the prefix cache keys an adapter's blocks by a digest of its
weights and config, never by its name (the bug class of vLLM issue 42125, llama.cpp 26207)."""

from __future__ import annotations

from kvshare.serve import LLM, SamplingParams

from test_engine import adapters, base, invocation, prompts_for, tokenizer  # noqa: F401

BS = 4
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


def run(llm, prompt, name):
    out = llm.generate([prompt], GREEDY, adapter=name)[0]
    return out.metrics["prompt_tokens_cached"], out.token_ids


def test_another_adapter_under_the_same_name_never_reads_the_old_ones_blocks(base, adapters, tokenizer):
    prompt = prompts_for(tokenizer, 1)[0] * 2
    llm = LLM(base, kv_cache_tokens=4096, block_size=BS)
    engine = llm.engine
    engine.load_adapter(adapters["lora-a"], name="agent")
    first_digest = engine.adapter("agent").digest
    run(llm, prompt, "agent")
    assert run(llm, prompt, "agent")[0] == len(prompt) // BS * BS  # its own blocks: reused
    engine.unload_adapter("agent")
    engine.load_adapter(adapters["lora-b"], name="agent")  # other weights, same name
    assert engine.adapter("agent").digest != first_digest
    hit, tokens = run(llm, prompt, "agent")
    assert hit == 0  # the old adapter's KV is not this one's
    fresh = LLM(base, [adapters["lora-b"]], kv_cache_tokens=4096, block_size=BS)
    name = fresh.engine.adapters()[0].name
    assert tokens == run(fresh, prompt, name)[1]  # and the output is what lora-b alone gives


def test_the_same_adapter_loaded_again_reuses_its_blocks(base, adapters, tokenizer):
    prompt = prompts_for(tokenizer, 1)[0] * 2
    llm = LLM(base, kv_cache_tokens=4096, block_size=BS)
    engine = llm.engine
    engine.load_adapter(adapters["lora-a"], name="first")
    _, want = run(llm, prompt, "first")
    engine.unload_adapter("first")
    engine.load_adapter(adapters["lora-a"], name="renamed")  # same weights, another name
    hit, tokens = run(llm, prompt, "renamed")
    assert hit == len(prompt) // BS * BS and tokens == want


def test_digest_names_content_not_folder(base, adapters, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(adapters["icarus-a"], copy)
    llm = LLM(base, [adapters["icarus-a"]], kv_cache_tokens=256, block_size=BS)
    original = llm.engine.adapters()[0].digest
    llm.engine.load_adapter(copy, name="copy")
    assert llm.engine.adapter("copy").digest == original  # a copy is the same adapter
    other = LLM(base, [adapters["icarus-b"]], kv_cache_tokens=256, block_size=BS).engine.adapters()[0].digest
    assert other != original
