"""Serving engine exactness: greedy outputs equal transformers, PEFT and the ICaRus reference;
warm equals cold, mixed equals alone, preemption changes nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvshare.export import export_adapter
from kvshare.serve import LLM, SamplingParams
from kvshare.testing import TINY_FAMILIES, make_peft_adapter
from kvshare.train.icarus_reference import icarus_reference_logits

NEW = 64
GREEDY = SamplingParams(max_tokens=NEW, ignore_eos=True)
INVOCATION = "<|invoke|>check<|end_invoke|>"


def prompts_for(tokenizer, n: int = 2) -> list[list[int]]:
    texts = ["What is 12 plus 30? Answer: 42. The answer is", "def add(a, b):\n    return a + b\nfor i in range(10):",
             "Paris is the capital of France. Rome is the capital of"]
    return [tokenizer.encode(t, add_special_tokens=False) for t in texts[:n]]


@pytest.fixture(scope="module")
def base(tiny_models) -> Path:
    return tiny_models("llama")


@pytest.fixture(scope="module")
def tokenizer(base):
    return AutoTokenizer.from_pretrained(base)


@pytest.fixture(scope="module")
def invocation(tokenizer) -> list[int]:
    return tokenizer.encode(INVOCATION, add_special_tokens=False)


@pytest.fixture(scope="module")
def adapters(base, invocation, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("engine-adapters")
    specs = {
        "lora-a": ("lora", ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], None, 1),
        "lora-b": ("lora", ["q_proj", "v_proj"], None, 2),
        "alora-a": ("alora", ["q_proj", "k_proj", "v_proj"], invocation, 3),
        "icarus-a": ("icarus", ["q_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], None, 4),
        "icarus-b": ("icarus", ["q_proj", "o_proj", "down_proj"], None, 5),
    }
    out = {}
    for name, (kind, targets, inv, seed) in specs.items():
        ckpt = make_peft_adapter(base, root / f"ckpt-{name}", target_modules=targets,
                                 invocation_tokens=inv, seed=seed)
        out[name] = export_adapter(ckpt, kind=kind, base=base, out=root / name,
                                   invocation=INVOCATION if inv else None)
    return out


def hf_greedy(model, prompt: list[int], n: int = NEW) -> list[int]:
    """transformers' / PEFT's greedy generate for exactly n tokens (EOS neither stops nor is
    suppressed, as with the engine's ignore_eos)."""
    config = model.generation_config
    config.eos_token_id, config.pad_token_id = None, 0
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                         generation_config=config)
    return out[0, len(prompt):].tolist()


def icarus_greedy(peft_model, prompt: list[int], n: int = NEW) -> list[int]:
    tokens = list(prompt)
    for _ in range(n):
        logits = icarus_reference_logits(peft_model, torch.tensor([tokens]))
        tokens.append(int(logits[0, -1].argmax()))
    return tokens[len(prompt):]


def run_together(engine, requests: list[tuple[list[int], str | None]]) -> list[list[int]]:
    """Submit every request to one engine at once, step to the end, return outputs in order."""
    ids = [engine.add_request(p, GREEDY, adapter=a) for p, a in requests]
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    return [done[i] for i in ids]


def peft_model(base: Path, adapter: Path):
    return PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter).eval()


@pytest.mark.parametrize("family", TINY_FAMILIES)
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_base_greedy_equals_transformers(tiny_models, family, tied):
    folder = tiny_models(family, tied=tied)
    tok = AutoTokenizer.from_pretrained(folder)
    prompts = prompts_for(tok, 3)
    llm = LLM(folder, kv_cache_tokens=2048, block_size=8)
    hf = AutoModelForCausalLM.from_pretrained(folder)
    for prompt, out in zip(prompts, llm.generate(prompts, GREEDY)):
        assert out.token_ids == hf_greedy(hf, prompt)


def test_bfloat16_engine_runs_and_mostly_agrees(tiny_models, tokenizer):
    folder = tiny_models("llama")
    prompt = prompts_for(tokenizer, 1)[0]
    out = LLM(folder, dtype="bfloat16", kv_cache_tokens=512).generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    assert out.token_ids[:4] == hf_greedy(hf, prompt, 8)[:4]


def test_generation_stops_on_every_end_of_sequence_id_of_the_model(base, tokenizer, tmp_path):
    """A chat model's end of turn is often not its tokenizer's EOS (Qwen2.5's <|im_end|>,
    Llama 3's <|eot_id|>): the ids of generation_config.json (else config.json) end a
    generation too, as in transformers' generate and vLLM; ``ignore_eos`` passes them all."""
    import json
    import shutil

    from kvshare.models import end_of_sequence_ids

    prompt = prompts_for(tokenizer, 1)[0]
    first = LLM(base, kv_cache_tokens=512).generate([prompt], SamplingParams(max_tokens=1))[0].token_ids[0]
    model = tmp_path / "model"
    shutil.copytree(base, model)
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [tokenizer.eos_token_id, first]}))
    llm = LLM(model, kv_cache_tokens=512)
    assert llm.engine.eos_token_ids == {tokenizer.eos_token_id, first}
    out = llm.generate([prompt], SamplingParams(max_tokens=6))[0]
    assert out.token_ids == [first] and out.finish_reason == "stop"
    out = llm.generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True))[0]
    assert len(out.token_ids) == 6 and out.finish_reason == "length"
    (model / "generation_config.json").unlink()  # none: config.json's
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "eos_token_id": 7}))
    assert end_of_sequence_ids(model, tokenizer) == {tokenizer.eos_token_id, 7}


@pytest.mark.parametrize("name", ["lora-a", "lora-b", "alora-a"])
def test_lora_and_alora_greedy_equal_peft(base, adapters, tokenizer, invocation, name):
    prompts = prompts_for(tokenizer, 2)
    if name.startswith("alora"):
        prompts = [p + invocation for p in prompts] + [prompts[0] + invocation + prompts[1]]
        prompts.append(prompts_for(tokenizer, 3)[2])  # no invocation: behaves as the base
    llm = LLM(base, [adapters[name]], kv_cache_tokens=2048, block_size=8)
    reference = peft_model(base, adapters[name])
    for prompt, out in zip(prompts, llm.generate(prompts, GREEDY, adapter=name)):
        assert out.token_ids == hf_greedy(reference, prompt)


@pytest.mark.parametrize("name", ["icarus-a", "icarus-b"])
def test_icarus_greedy_equals_the_training_reference(base, adapters, tokenizer, name):
    prompts = prompts_for(tokenizer, 2)
    llm = LLM(base, [adapters[name]], kv_cache_tokens=2048, block_size=8)
    reference = peft_model(base, adapters[name])
    for prompt, out in zip(prompts, llm.generate(prompts, GREEDY, adapter=name)):
        assert out.token_ids == icarus_greedy(reference, prompt)


def test_warm_cache_equals_cold_for_every_kind(base, adapters, tokenizer, invocation):
    llm = LLM(base, list(adapters.values()), kv_cache_tokens=4096, block_size=4)
    prompt = prompts_for(tokenizer, 1)[0] * 2
    for adapter in [None, "lora-a", "alora-a", "icarus-a"]:
        p = prompt + invocation if adapter == "alora-a" else prompt
        cold = llm.generate([p], GREEDY, adapter=adapter)[0]
        warm = llm.generate([p], GREEDY, adapter=adapter)[0]
        assert warm.metrics["prompt_tokens_cached"] >= len(p) // 4 * 4 - 4
        assert warm.token_ids == cold.token_ids, adapter


def test_mixed_batch_equals_each_request_alone(base, adapters, tokenizer, invocation):
    prompts = prompts_for(tokenizer, 3)
    requests = [(prompts[0], None), (prompts[1], "lora-a"), (prompts[2] + invocation, "alora-a"),
                (prompts[0], "icarus-a"), (prompts[1], "icarus-b"), (prompts[2], "lora-b")]
    alone = []
    for prompt, adapter in requests:
        llm = LLM(base, list(adapters.values()), kv_cache_tokens=2048, block_size=8)
        alone.append(llm.generate([prompt], GREEDY, adapter=adapter)[0].token_ids)
    llm = LLM(base, list(adapters.values()), kv_cache_tokens=2048, block_size=8, max_num_batched_tokens=40)
    assert run_together(llm.engine, requests) == alone


def test_preemption_does_not_change_outputs(base, adapters, tokenizer):
    prompts = [p * 2 for p in prompts_for(tokenizer, 3)]
    requests = [(prompts[0], "icarus-a"), (prompts[1], "lora-a"), (prompts[2], None)]
    roomy = LLM(base, list(adapters.values()), kv_cache_tokens=4096, block_size=4)
    expected = [roomy.generate([p], GREEDY, adapter=a)[0].token_ids for p, a in requests]
    tight = LLM(base, list(adapters.values()), kv_cache_tokens=4 * 60, block_size=4)
    assert run_together(tight.engine, requests) == expected
    stats = tight.engine.stats()
    assert stats["preemptions"] > 0
    # each prompt looked up once, and a preempted request's recomputed blocks are not cache hits
    assert stats["prefix_queried_tokens"] == sum(len(p) for p, _ in requests)
    assert stats["prefix_hit_tokens"] == 0  # three different prompts, nothing cached before


def test_preemption_keeps_alora_offsets_seeded_samples_and_prompt_logprobs(base, adapters, tokenizer, invocation):
    """Recompute after preemption for what the first preemption test leaves out: an aLoRA request
    (its KV owner changes at the invocation, inside the prompt), a seeded sampled request (its
    generator must not draw again for recomputed tokens) and prompt logprobs (scored once)."""
    prompts = [p * 2 for p in prompts_for(tokenizer, 3)]
    requests = [(prompts[0] + invocation, "alora-a", SamplingParams(max_tokens=NEW, ignore_eos=True)),
                (prompts[1], "lora-a", SamplingParams(max_tokens=NEW, ignore_eos=True, temperature=0.9, seed=5)),
                (prompts[2], None, SamplingParams(max_tokens=NEW, ignore_eos=True, prompt_logprobs=1))]

    def run(llm):
        ids = [llm.engine.add_request(p, params, adapter=a) for p, a, params in requests]
        done = {}
        while llm.engine.has_unfinished():
            done.update({o.request_id: o for o in llm.engine.step() if o.finished})
        return [done[i] for i in ids]

    roomy = run(LLM(base, list(adapters.values()), kv_cache_tokens=4096, block_size=4))
    tight_llm = LLM(base, list(adapters.values()), kv_cache_tokens=4 * 60, block_size=4)
    tight = run(tight_llm)
    assert tight_llm.engine.stats()["preemptions"] > 0
    assert [o.token_ids for o in tight] == [o.token_ids for o in roomy]
    scored = [(e or {}).get("logprob") for e in tight[2].prompt_logprobs]
    assert scored == pytest.approx([(e or {}).get("logprob") for e in roomy[2].prompt_logprobs], abs=1e-5)


def test_aborting_preempted_and_waiting_requests_frees_their_blocks_once(base, tokenizer):
    """Aborts of a request in every state: running, preempted (back in the queue, its blocks
    freed then), and waiting (never admitted): no block stays in use, none is freed twice
    (the pool's counts stay whole), and the engine serves on."""
    prompts = [p * 2 for p in prompts_for(tokenizer, 3)]
    llm = LLM(base, kv_cache_tokens=4 * 60, block_size=4)
    engine = llm.engine
    params = SamplingParams(max_tokens=NEW, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    while not engine.stats()["preemptions"]:
        engine.step()
    waiting = [s.request_id for s in engine._scheduler.waiting]
    assert waiting  # the preempted one is back in the queue
    late = engine.add_request(prompts[0], params)  # waiting behind it, never admitted yet
    for request_id in [*ids, late]:
        assert engine.abort(request_id)
    stats, usage = engine.stats(), engine.kv_usage()["kv"]
    assert stats["blocks_in_use"] == 0 and not engine.has_unfinished(), stats
    assert engine._blocks.num_free == usage["blocks_total"], usage  # free or cached-idle: none lost or doubled
    out = llm.generate([prompts[1]], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    assert len(out.token_ids) == 4


def test_an_older_sequence_never_gives_way_to_a_younger_one(base, tokenizer):
    """Three prompts of three blocks fill a pool of nine. At the fourth block the oldest makes
    room by preempting the newest; at the fifth the middle one is short, and the only other
    running sequence is the oldest, already planned: the middle one waits instead."""
    prompts = [p[:12] for p in prompts_for(tokenizer, 3)]
    assert all(len(p) == 12 for p in prompts) and len({tuple(p) for p in prompts}) == 3
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    roomy = LLM(base, kv_cache_tokens=4096, block_size=4)
    expected = [roomy.generate([p], params)[0].token_ids for p in prompts]
    tight = LLM(base, kv_cache_tokens=9 * 4, block_size=4)
    scheduler, preempted = tight.engine._scheduler, []
    real_preempt = scheduler._preempt
    scheduler._preempt = lambda seq: preempted.append(seq.request_id) or real_preempt(seq)
    ids = [tight.engine.add_request(p, params) for p in prompts]
    done = {}
    while tight.engine.has_unfinished():
        done.update({o.request_id: o.token_ids for o in tight.engine.step() if o.finished})
    assert [done[i] for i in ids] == expected
    assert preempted and ids[0] not in preempted, preempted


def _run_all(engine, items) -> tuple[list[str], dict]:
    """Submit (prompt, adapter, params) items at once and step to the end."""
    ids = [engine.add_request(p, s, adapter=a) for p, a, s in items]
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    return ids, done


def _fault_items(tokenizer, invocation):
    prompts = prompts_for(tokenizer, 3)
    seeded = SamplingParams(max_tokens=24, temperature=0.9, seed=7, ignore_eos=True)
    greedy = SamplingParams(max_tokens=24, ignore_eos=True, logprobs=2)
    return [(prompts[0], None, greedy), (prompts[1], "lora-a", greedy), (prompts[2] + invocation, "alora-a", seeded),
            (prompts[0], "icarus-a", greedy), (prompts[1] * 2, "icarus-b", seeded)]


def test_a_step_fault_fails_only_the_request_it_belongs_to(base, adapters, tokenizer, invocation, monkeypatch):
    """A fault that strikes whenever one request is in the batch - after the model ran and
    sampled, so KV was written and seeded generators drew - fails that request alone; every
    other request (greedy and seeded, base and each adapter kind) gets exactly the tokens (and the
    logprobs) of a run without the fault, and the pool is whole again afterwards."""
    items = _fault_items(tokenizer, invocation)
    settings = dict(kv_cache_tokens=2048, block_size=8, max_num_batched_tokens=40)  # chunked prefills too
    clean_ids, clean = _run_all(LLM(base, list(adapters.values()), **settings).engine, items)
    engine = LLM(base, list(adapters.values()), **settings).engine
    real_run, calls, bad = engine.runner.run, {"n": 0}, {}

    def faulty(plans, lookup):
        calls["n"] += 1
        result = real_run(plans, lookup)
        if any(p.seq.request_id == bad.get("id") and len(p.seq.output) >= 3 for p in plans):
            raise RuntimeError("simulated fault tied to one request")
        return result

    monkeypatch.setattr(engine.runner, "run", faulty)
    ids = [engine.add_request(p, s, adapter=a) for p, a, s in items]
    bad["id"] = ids[1]
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    failed = done[ids[1]]
    assert failed.finish_reason == "error" and failed.token_ids == clean[clean_ids[1]].token_ids[:3]
    for i in (0, 2, 3, 4):
        assert done[ids[i]].finish_reason == "length"
        assert done[ids[i]].token_ids == clean[clean_ids[i]].token_ids, i
        got, want = done[ids[i]].logprobs, clean[clean_ids[i]].logprobs  # batch shapes differ: rounding
        assert [e["logprob"] for e in got] == pytest.approx([e["logprob"] for e in want], abs=1e-5), i
    assert engine.counters["failed"] == 1 and engine.stats()["blocks_in_use"] == 0
    assert calls["n"] > engine.counters["steps"]  # the failing steps were retried in parts
    again_ids, again = _run_all(engine, items[1:2])  # the engine serves on
    assert again[again_ids[0]].token_ids == clean[clean_ids[1]].token_ids


def test_a_fault_in_one_requests_text_fails_only_that_request(base, adapters, tokenizer, invocation):
    items = _fault_items(tokenizer, invocation)
    clean_ids, clean = _run_all(LLM(base, list(adapters.values()), kv_cache_tokens=2048, block_size=8).engine, items)
    engine = LLM(base, list(adapters.values()), kv_cache_tokens=2048, block_size=8).engine
    ids = [engine.add_request(p, s, adapter=a) for p, a, s in items]

    def broken(ids):
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "simulated")

    engine.sequences[ids[3]].detokenizer.update = broken
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert done[ids[3]].finish_reason == "error" and len(done[ids[3]].token_ids) == 1
    for i in (0, 1, 2, 4):
        assert done[ids[i]].token_ids == clean[clean_ids[i]].token_ids, i
    assert engine.stats()["blocks_in_use"] == 0 and engine.counters["failed"] == 1


def test_an_output_that_fails_to_build_fails_its_request_alone(base, tokenizer, monkeypatch):
    """Building one request's output raises mid-run: that request ends once with finish reason
    "error" (its blocks freed, counted as failed) and the other request of the same steps runs on
    to its end, instead of the step failing and the first request's stream never hearing of it."""
    import kvshare.serve.engine.llm_engine as engine_module

    llm = LLM(base, kv_cache_tokens=512, block_size=4)
    engine = llm.engine
    prompts = prompts_for(tokenizer, 2)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    bad, good = (engine.add_request(p, params) for p in prompts)
    real, calls = engine_module.make_output, []

    def flaky(seq, text):
        calls.append(seq.request_id)
        if seq.request_id == bad and calls.count(bad) == 2:  # its second output (a decode step)
            raise ValueError("simulated")
        return real(seq, text)

    monkeypatch.setattr(engine_module, "make_output", flaky)
    outs: dict[str, list] = {}
    while engine.has_unfinished():
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    assert [o.finish_reason for o in outs[bad]] == [None, "error"]
    assert outs[good][-1].finish_reason == "length" and len(outs[good][-1].token_ids) == 4
    assert engine.stats()["failed"] == 1 and not engine.sequences
    assert engine.stats()["blocks_in_use"] == 0  # the failed request's blocks were freed too
