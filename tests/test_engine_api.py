"""Engine API: sampling options, stops, logprobs, abort, adapters at run time, metrics, errors."""

from __future__ import annotations

import sys

import pytest
import torch

from kvshare.errors import KvshareError
from kvshare.serve import LLM, SamplingParams

from test_engine import adapters, base, invocation, prompts_for, tokenizer  # noqa: F401


@pytest.fixture(scope="module")
def llm(base, adapters):
    return LLM(base, [adapters["lora-a"], adapters["icarus-a"]], kv_cache_tokens=2048, block_size=8)


@pytest.fixture(scope="module")
def prompt(tokenizer):
    return prompts_for(tokenizer, 1)[0]


def test_seeded_sampling_is_reproducible_and_seeds_differ(llm, prompt):
    def run(seed):
        params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=seed, ignore_eos=True)
        return llm.generate([prompt], params)[0].token_ids

    assert run(1) == run(1)
    assert run(1) != run(2)


def test_top_k_one_is_greedy(llm, prompt):
    greedy = llm.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True))[0].token_ids
    top1 = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0.7, top_k=1, seed=3,
                                                 ignore_eos=True))[0].token_ids
    assert top1 == greedy


def test_stop_token_ids_and_stop_strings(llm, prompt, tokenizer):
    full = llm.generate([prompt], SamplingParams(max_tokens=20, ignore_eos=True))[0]
    stop_id = full.token_ids[5]
    first = full.token_ids.index(stop_id)
    out = llm.generate([prompt], SamplingParams(max_tokens=20, ignore_eos=True, stop_token_ids=[stop_id]))[0]
    assert out.token_ids == full.token_ids[: first + 1] and out.finish_reason == "stop"
    text = full.text
    needle = text[len(text) // 2: len(text) // 2 + 3]
    assert needle.strip()
    out = llm.generate([prompt], SamplingParams(max_tokens=20, ignore_eos=True, stop=[needle]))[0]
    assert out.finish_reason == "stop" and needle not in out.text and text.startswith(out.text)


def test_length_finish_and_logprobs(llm, prompt):
    out = llm.generate([prompt], SamplingParams(max_tokens=5, ignore_eos=True, logprobs=3))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5
    assert len(out.logprobs) == 5
    for token, entry in zip(out.token_ids, out.logprobs):
        assert entry["token"] == token and len(entry["top"]) == 3
        assert entry["logprob"] == pytest.approx(max(entry["top"].values()))  # greedy picks the top


def test_metrics_per_request_and_engine_counters(llm, prompt):
    out = llm.generate([prompt * 3], SamplingParams(max_tokens=6, ignore_eos=True), adapter="icarus-a")[0]
    m = out.metrics
    assert m["time_to_first_token"] > 0 and m["e2e_time"] >= m["time_to_first_token"]
    assert m["inter_token_latency"] > 0 and m["queue_time"] >= 0
    assert m["prompt_tokens_cached"] + m["prompt_tokens_computed"] == len(prompt) * 3
    stats = llm.engine.stats()
    for key in ("blocks_in_use", "blocks_in_use_shared", "blocks_in_use_private", "prefix_hit_rate",
                "evictions", "preemptions", "generated_tokens"):
        assert key in stats


def test_abort_frees_blocks(llm, prompt):
    engine = llm.engine
    request = engine.add_request(prompt * 4, SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    assert engine.stats()["blocks_in_use"] > 0
    assert engine.abort(request) and not engine.abort(request)
    assert engine.stats()["blocks_in_use"] == 0 and not engine.has_unfinished()


def test_load_and_unload_adapters_while_running(llm, adapters, prompt, invocation):
    engine = llm.engine
    first = engine.add_request(prompt, SamplingParams(max_tokens=30, ignore_eos=True), adapter="lora-a")
    engine.step()
    name = engine.load_adapter(adapters["alora-a"])
    second = engine.add_request(prompt + invocation, SamplingParams(max_tokens=4, ignore_eos=True), adapter=name)
    with pytest.raises(KvshareError, match="in use"):
        engine.unload_adapter("lora-a")
    done = set()
    while engine.has_unfinished():
        done |= {o.request_id for o in engine.step() if o.finished}
    assert {first, second} <= done
    engine.unload_adapter(name)
    with pytest.raises(KvshareError, match="unknown adapter"):
        engine.add_request(prompt, adapter=name)


@pytest.mark.parametrize("kwargs,message", [
    ({"max_tokens": 0}, "max_tokens"), ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"), ({"top_k": -2}, "top_k"),
])
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(KvshareError, match=message):
        SamplingParams(**kwargs)


def test_bad_requests(llm, prompt):
    engine = llm.engine
    with pytest.raises(KvshareError, match="empty"):
        engine.add_request([])
    with pytest.raises(KvshareError, match="max_model_len"):
        engine.add_request(prompt, SamplingParams(max_tokens=10**6))
    with pytest.raises(KvshareError, match="unknown adapter"):
        engine.add_request(prompt, adapter="nobody")
    engine.add_request(prompt, SamplingParams(max_tokens=1), request_id="dup")
    with pytest.raises(KvshareError, match="already in use"):
        engine.add_request(prompt, request_id="dup")
    engine.abort("dup")


def test_engine_benchmark_runs_and_icarus_agents_hold_one_agents_kv(tiny_models, tmp_path):
    """The benchmark's figures are printed, not asserted; its KV-bytes invariant is exact."""
    from kvshare.eval.perf.engine import run_engine_bench

    results = run_engine_bench(model=str(tiny_models("llama")), new_tokens=8, out_dir=tmp_path, quick=True)
    kv = results["kv_bytes"]
    for n in (2, 4, 8):
        assert kv[f"icarus_{n}_bytes"] == kv["one_agent_bytes"]  # one shared cache
        assert kv[f"lora_{n}_bytes"] == n * kv["one_agent_bytes"]  # a cache per agent
    assert (tmp_path / "engine_bench.md").read_text().startswith("| figure |")
    assert results["decode_b1"]["kvshare"] > 0 and results["icarus_step_ratio"]["ratio"] > 0
    step = results["icarus_step_ratio"]  # base and paired steps alternated, the median ratio reported
    assert len(step["ratios"]) == 5 and step["ratio"] == sorted(step["ratios"])[2]


def test_engine_benchmark_measures_several_backends_in_one_run(tiny_models, tmp_path):
    """--kernels torch int8: an engine each, transformers timed beside each; the first keeps the
    single-backend keys, the second gets its own column and HF figure (printed, not asserted)."""
    from kvshare.eval.perf.engine import run_engine_bench

    results = run_engine_bench(model=str(tiny_models("llama")), new_tokens=4, out_dir=tmp_path, quick=True,
                               kernels=["torch", "int8"], threads=1)
    assert results["backends"] == ["torch", "int8"]
    for key in ("decode_b1", "decode_b16", "prefill_128", "prefill_256"):
        assert set(results[key]) == {"kvshare", "hf", "kvshare[int8]", "hf[int8]"}
        assert results[key]["kvshare[int8]"] > 0
    assert results["icarus_step_ratio"]["kvshare[int8]"]["ratio"] > 0
    header = (tmp_path / "engine_bench.md").read_text().splitlines()[0]
    assert "torch kernels" in header and "| kvshare[int8] | int8/HF |" in header
    assert results["steps_ran"] == {"torch": "eager", "int8": "eager"}  # the suite runs with KVSHARE_COMPILE=off
    assert "Steps ran: torch kernels: eager; int8 kernels: eager." in (tmp_path / "engine_bench.md").read_text()
    with pytest.raises(KvshareError, match="distinct"):
        run_engine_bench(model=str(tiny_models("llama")), kernels=["torch", "torch"])


def test_the_benchmark_says_when_a_fast_step_gave_up():
    """A backend whose graphs gave up on the machine ran eager: its figures say so."""
    from types import SimpleNamespace

    from kvshare.eval.perf.engine import _how_steps_ran

    def llm(compiled):
        return SimpleNamespace(engine=SimpleNamespace(compiled_step=compiled))

    assert _how_steps_ran(llm(None)) == "eager"
    assert _how_steps_ran(llm(SimpleNamespace(unavailable=None, steps=7))) == "compiled step (7 steps)"
    gave_up = SimpleNamespace(unavailable="RuntimeError: no", steps=0)
    assert _how_steps_ran(llm(gave_up)) == "eager (compiled step gave up: RuntimeError: no)"


def test_the_benchmark_says_which_lora_kernel_the_graphs_took(monkeypatch):
    """CUDA graphs name their LoRA kernel (KVSHARE_GRAPH_LORA) and a fallback, if one happened."""
    from types import SimpleNamespace

    from kvshare.eval.perf.engine import _how_steps_ran
    from kvshare.kernels.triton import linear_lora
    from kvshare.serve.exec.cuda_graphs import GraphedStep

    graphed = GraphedStep.__new__(GraphedStep)
    graphed.unavailable, graphed.steps, graphed.lora_kernel = None, 5, "fused"
    llm = SimpleNamespace(engine=SimpleNamespace(compiled_step=graphed))
    monkeypatch.setattr(linear_lora, "_failed", None)
    assert _how_steps_ran(llm) == "CUDA graphs (5 steps; LoRA: fused)"
    monkeypatch.setattr(linear_lora, "_failed", "RuntimeError: no")
    assert _how_steps_ran(llm) == "CUDA graphs (5 steps; LoRA: fused; projection + LoRA kernel fell back: RuntimeError: no)"


def test_capacity_in_tokens_or_bytes(base):
    by_tokens = LLM(base, kv_cache_tokens=640, block_size=16).engine
    per_token = by_tokens.kv_bytes_per_token
    by_bytes = LLM(base, kv_cache_bytes=640 * per_token, block_size=16).engine
    assert by_tokens.kv_usage()["kv"]["blocks_total"] == by_bytes.kv_usage()["kv"]["blocks_total"] == 40
    assert by_bytes.runner.kv_cache.numel() * by_bytes.runner.kv_cache.element_size() == 640 * per_token
    small = LLM(base, kv_cache_tokens=256, block_size=16).engine
    with pytest.raises(KvshareError, match="KV blocks"):  # could never fit, even alone
        small.add_request(list(range(5, 400)), SamplingParams(max_tokens=100))


def test_bad_sampling_values_and_token_ids_are_clear_errors(base):
    engine = LLM(base, kv_cache_tokens=256, block_size=16).engine
    for kwargs in ({"seed": 2 ** 64}, {"temperature": float("nan")}, {"temperature": float("inf")},
                   {"top_p": float("nan")}):
        with pytest.raises(KvshareError):
            SamplingParams(**kwargs)
    for kwargs in ({"stop": [""]}, {"stop": ["ok", ""]}):  # "" would stop at once
        with pytest.raises(KvshareError, match="non-empty"):
            SamplingParams(**kwargs)
    for prompt in ([5, 10 ** 6], [5, -1], [5, 2 ** 63]):
        with pytest.raises(KvshareError, match="outside the vocabulary"):
            engine.add_request(prompt, SamplingParams(max_tokens=2))
    vocab = engine.vocab_size
    for name in ("logprobs", "prompt_logprobs"):  # checked before any step (topk would fail there)
        with pytest.raises(KvshareError, match="vocabulary"):
            engine.add_request([5, 6], SamplingParams(max_tokens=2, **{name: vocab + 1}))
    assert not engine.has_unfinished()
    with pytest.raises(KvshareError, match="holds no token"):
        LLM(base, kv_cache_bytes=engine.kv_bytes_per_token - 1, block_size=16)
    tiny = SamplingParams(max_tokens=4, temperature=1e-300, ignore_eos=True)  # greedy, not NaN
    greedy = SamplingParams(max_tokens=4, ignore_eos=True)
    llm = LLM(base, kv_cache_tokens=256, block_size=16)
    assert llm.generate([[5, 6, 7]], tiny)[0].token_ids == llm.generate([[5, 6, 7]], greedy)[0].token_ids


def test_a_context_past_the_models_positions_and_an_unknown_device_are_clear_errors(base, monkeypatch):
    engine = LLM(base, kv_cache_tokens=64, block_size=4).engine
    positions = engine.model.config.max_position_embeddings
    monkeypatch.delenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    with pytest.raises(KvshareError, match="max_position_embeddings"):
        LLM(base, kv_cache_tokens=64, block_size=4, max_model_len=positions + 1)
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")  # vLLM's escape hatch
    assert LLM(base, kv_cache_tokens=64, block_size=4, max_model_len=positions + 1).engine.max_model_len == positions + 1
    with pytest.raises(KvshareError, match="device must be cpu or cuda"):
        LLM(base, kv_cache_tokens=64, block_size=4, device="gpu")
    assert engine.max_request_tokens() == min(engine.max_model_len, 64)  # the pool bounds a request too


@pytest.mark.parametrize("change", ["o_proj bias", "mlp bias", "sliding window", "dynamic rope"])
def test_a_model_the_forward_would_compute_differently_is_refused(tiny_llama, change):
    """transformers would add these biases, mask past the window, or rope by the batch's
    longest position; the engine does not, so it refuses rather than serve other outputs."""
    import json

    from safetensors.torch import load_file, save_file

    config = json.loads((tiny_llama / "config.json").read_text())
    if change.endswith("bias"):
        weights = load_file(str(tiny_llama / "model.safetensors"))
        name = "self_attn.o_proj" if change == "o_proj bias" else "mlp.down_proj"
        rows = weights[f"model.layers.0.{name}.weight"].shape[0]
        weights[f"model.layers.0.{name}.bias"] = torch.zeros(rows)
        save_file(weights, str(tiny_llama / "model.safetensors"), metadata={"format": "pt"})
    elif change == "sliding window":
        config["sliding_window"] = 64
    else:
        config["rope_scaling"] = {"rope_type": "dynamic", "factor": 2.0}
    (tiny_llama / "config.json").write_text(json.dumps(config))
    with pytest.raises(KvshareError, match="bias|sliding window|picks its frequencies"):
        LLM(tiny_llama, kv_cache_tokens=64, block_size=4)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_the_engine_keeps_no_mapping_of_its_weights_file(tmp_path):
    """The engine copies the weights it keeps, even where the file holds its dtype: a tensor
    loaded as it is maps the file, and the whole mapping stayed resident beside the fused
    q/k/v and gate/up copies (SmolLM2 float32: 513 MB of file pages)."""
    from kvshare.serve.exec.model import Model
    from kvshare.testing import make_tiny_model

    folder = make_tiny_model(tmp_path / "float32-model", "llama")  # float32, as the engine's default
    model = Model(folder)
    mapped = [line.split()[-1] for line in open("/proc/self/maps") if str(folder) in line]
    assert model.layers and mapped == []
