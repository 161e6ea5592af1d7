"""kvshare's vLLM plugin inside vLLM's CPU build: ICaRus and aLoRA served, the base's blocks shared.

Runs vLLM 0.32 in its peer venv (``KVSHARE_VLLM_VENV``; markers ``integration`` and
``peers``, skipped without it) on SmolLM2-135M-Instruct in float32, with kvshare installed
there as an unpacked wheel, so vLLM loads the plugin through its entry point. Against
kvshare's engine, whose tokens the test first checks against PEFT and the ICaRus reference, and
vLLM's own per-request cached-token counts:

- two ICaRus agents' and an aLoRA's greedy tokens equal kvshare's, alone and in one batch
  beside the base and a LoRA;
- ICaRus agents and the base read every block the others wrote;
- the base's blocks before the invocation serve the aLoRA request, and its blocks serve the
  base, no further (the blocks that reach the invocation are the adapter's own);
- a plain LoRA shares nothing, and its tokens are still kvshare's (vLLM's CPU LoRA kernels
  gave base tokens beside a LoRA the adapter's delta; the plugin fixes that too);
- the same through ``vllm serve``, adapters by name, hits on ``/metrics``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
import zipfile
from pathlib import Path

import pytest
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvshare.eval.perf.peers import VLLMServer, vllm_serve_command
from kvshare.export import export_adapter
from kvshare.loopback import free_port
from kvshare.serve import LLM, SamplingParams
from kvshare.testing import ICARUS_TARGETS, make_peft_adapter

from test_engine import hf_greedy, icarus_greedy

pytestmark = [pytest.mark.integration, pytest.mark.peers]
ROOT = Path(__file__).resolve().parent.parent
PROBE = Path(__file__).with_name("peers") / "vllm_plugin_probe.py"
INVOCATION = "<|im_start|>assistant\n"
BLOCK, NEW_TOKENS = 32, 12


@pytest.fixture(scope="module")
def venv() -> Path:
    venv = os.environ.get("KVSHARE_VLLM_VENV")
    if not venv:
        pytest.skip("KVSHARE_VLLM_VENV names no vLLM peer venv (docs/guides/vllm.md)")
    return Path(venv)


def kvshare_site(tmp: Path) -> Path:
    """This checkout as a built, unpacked wheel: what ``pip install kvshare`` puts beside vLLM,
    entry point included."""
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-cache-dir",
                    "-w", str(tmp / "dist"), str(ROOT)], check=True, capture_output=True, timeout=300)
    with zipfile.ZipFile(next((tmp / "dist").glob("kvshare-*.whl"))) as archive:
        archive.extractall(tmp / "site")
    return tmp / "site"



def chat(tokenizer, question: str) -> list[int]:
    """A chat prompt of more than three blocks whose invocation (its last tokens) starts in
    a block that the prompt fills: that block is the adapter's, the ones before are the base's."""
    system = "You are a careful assistant. Answer in one short sentence, and say when you are unsure."
    while True:
        ids = tokenizer.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": question}],
                                            tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"]
        if len(ids) > 3 * BLOCK and len(ids) % BLOCK in (1, 2):  # a fully cached prompt would show
            return ids
        question += " Please."


@pytest.fixture(scope="module")
def material(venv, smollm2_dir, tmp_path_factory) -> dict:
    """The adapters (exported by kvshare), the prompts, kvshare's greedy tokens for each, and
    this checkout as a site folder for vLLM's venv."""
    root = tmp_path_factory.mktemp("vllm")
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    invocation = tokenizer.encode(INVOCATION, add_special_tokens=False)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    adapters = {
        "judge": export_adapter(make_peft_adapter(smollm2_dir, root / "alora-ckpt", target_modules=targets, rank=8,
                                                  seed=4, invocation_tokens=invocation, b_std=0.05),
                                kind="alora", base=smollm2_dir, out=root / "judge", invocation=INVOCATION),
        "math": export_adapter(make_peft_adapter(smollm2_dir, root / "lora-ckpt", target_modules=targets, rank=8,
                                                 seed=3, b_std=0.05), kind="lora", base=smollm2_dir, out=root / "math"),
        **{name: export_adapter(make_peft_adapter(smollm2_dir, root / f"{name}-ckpt", rank=8, seed=seed,
                                                  target_modules=ICARUS_TARGETS, b_std=0.05),
                                kind="icarus", base=smollm2_dir, out=root / name)
           for name, seed in (("planner", 5), ("critic", 6))},
    }
    prompts = [chat(tokenizer, question) for question in ("Name three uses of a paperclip.", "Why is the sky blue?")]
    engine = LLM(smollm2_dir, list(adapters.values()), kv_cache_tokens=2048, block_size=16)
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    want = {(i, name): engine.generate([prompt], params, adapter=name)[0].token_ids
            for i, prompt in enumerate(prompts) for name in (None, "judge", "math", "planner", "critic")}
    start = len(prompts[0]) - len(invocation)
    assert prompts[0][start:] == invocation
    for name, folder in adapters.items():  # kvshare's tokens are the references' (PEFT; the ICaRus reference)
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(smollm2_dir), folder).eval()
        greedy = icarus_greedy if name in ("planner", "critic") else hf_greedy
        assert greedy(model, prompts[0], NEW_TOKENS) == want[0, name], name
    return {"root": root, "adapters": adapters, "prompts": prompts, "want": want, "start": start,
            "site": kvshare_site(root)}


@pytest.fixture(scope="module")
def run(venv, smollm2_dir, material):
    root, (first, second) = material["root"], material["prompts"]
    scenarios = {
        "base_then_alora_then_lora": [[{"prompt": first, "adapter": None}], [{"prompt": first, "adapter": "judge"}],
                                      [{"prompt": first, "adapter": "math"}]],
        "alora_then_base": [[{"prompt": first, "adapter": "judge"}], [{"prompt": first, "adapter": None}]],
        "base_then_icarus_agents": [[{"prompt": first, "adapter": None}], [{"prompt": first, "adapter": "planner"}],
                                    [{"prompt": first, "adapter": "critic"}]],
        "icarus_then_base": [[{"prompt": first, "adapter": "planner"}], [{"prompt": first, "adapter": None}]],
        "mixed_batch": [[{"prompt": second, "adapter": None}, {"prompt": second, "adapter": "math"},
                         {"prompt": second, "adapter": "judge"}, {"prompt": second, "adapter": "planner"},
                         {"prompt": second, "adapter": "critic"}]],
    }
    (root / "scenarios.json").write_text(json.dumps(scenarios))
    env = dict(os.environ, PYTHONPATH=str(material["site"]), OMP_NUM_THREADS="2", VLLM_CPU_OMP_THREADS_BIND="0-1",
               VLLM_CPU_KVCACHE_SPACE="1", VLLM_NO_USAGE_STATS="1", HF_HUB_OFFLINE="1")
    command = [str(venv / "bin" / "python"), str(PROBE), "--model", str(smollm2_dir), "--scenarios",
               str(root / "scenarios.json"), "--new-tokens", str(NEW_TOKENS), "--out", str(root / "out.json"),
               *[f"--adapter={name}={path}" for name, path in material["adapters"].items()]]
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=root, timeout=1500)
    assert result.returncode == 0, result.stderr[-4000:]
    return {**json.loads((root / "out.json").read_text()), "prompt": first}, material["want"], material["start"]


def test_the_plugin_loads_through_vllms_entry_point(run):
    results, _, start = run
    print(f"invocation at {start}; vLLM's results: {json.dumps(results)}")
    assert results["plugin_registered"] is True


def test_alora_reuses_the_bases_blocks_before_its_invocation_and_no_further(run):
    results, want, start = run
    base, alora, lora = (step[0] for step in results["base_then_alora_then_lora"])
    shared = start // BLOCK * BLOCK
    assert shared >= 2 * BLOCK and shared + BLOCK <= len(results["prompt"])  # the invocation's block is full
    assert base["cached"] == 0 and alora["cached"] == shared and lora["cached"] == 0
    assert base["tokens"] == want[0, None] and alora["tokens"] == want[0, "judge"] and lora["tokens"] == want[0, "math"]
    assert alora["tokens"] != base["tokens"]  # the adapter ran from its invocation on
    first_alora, then_base = (step[0] for step in results["alora_then_base"])
    assert first_alora["cached"] == 0 and then_base["cached"] == shared  # the base reads aLoRA's base blocks only
    assert first_alora["tokens"] == want[0, "judge"] and then_base["tokens"] == want[0, None]


def test_icarus_agents_share_every_block_with_the_base_and_each_other(run):
    results, want, _ = run
    whole = len(results["prompt"]) // BLOCK * BLOCK  # every full block of the prompt
    base, planner, critic = (step[0] for step in results["base_then_icarus_agents"])
    assert base["cached"] == 0 and planner["cached"] == whole and critic["cached"] == whole
    assert base["tokens"] == want[0, None]
    assert planner["tokens"] == want[0, "planner"] and critic["tokens"] == want[0, "critic"]
    assert len({tuple(base["tokens"]), tuple(planner["tokens"]), tuple(critic["tokens"])}) == 3
    first_planner, then_base = (step[0] for step in results["icarus_then_base"])
    assert first_planner["cached"] == 0 and then_base["cached"] == whole  # the agent wrote the base's K/V
    assert first_planner["tokens"] == want[0, "planner"] and then_base["tokens"] == want[0, None]


def test_every_kind_in_one_batch_gives_kvshares_tokens(run):
    results, want, _ = run
    names = [None, "math", "judge", "planner", "critic"]
    assert [r["tokens"] for r in results["mixed_batch"][0]] == [want[1, name] for name in names]


def test_vllm_serve_serves_each_adapter_by_name_and_counts_the_shared_blocks(venv, smollm2_dir, material):
    """``vllm serve --lora-modules``, requests naming the adapter as ``model``: kvshare's tokens,
    and vLLM's own counters (per request and on /metrics) show the blocks shared."""
    port, first, want = free_port(), material["prompts"][0], material["want"]
    command = vllm_serve_command(venv, smollm2_dir, material["adapters"], port, "float32", 512, max_lora_rank=8)
    command += ["--block-size", str(BLOCK), "--enforce-eager", "--enable-prompt-tokens-details"]
    server = VLLMServer(command, port, threads=2, kv_cache_gib=1, log=material["root"] / "serve.log")
    server.env["PYTHONPATH"] = str(material["site"])
    order = [("base", None, 0), ("planner", "planner", "whole"), ("critic", "critic", "whole"),
             ("judge", "judge", "shared"), ("math", "math", 0)]
    whole, shared = len(first) // BLOCK * BLOCK, material["start"] // BLOCK * BLOCK
    with server:
        cached = []
        for model, name, expected in order:
            body = json.dumps({"model": model, "prompt": first, "max_tokens": NEW_TOKENS, "temperature": 0,
                               "ignore_eos": True, "return_token_ids": True}).encode()
            request = urllib.request.Request(f"{server.base_url}/completions", data=body,
                                             headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=300) as reply:
                answer = json.loads(reply.read())
            assert answer["choices"][0]["token_ids"] == want[0, name], model
            cached.append(answer["usage"]["prompt_tokens_details"]["cached_tokens"])
        _, hits = server.prefix_cache_counts()
    assert cached == [0, whole, whole, shared, 0]
    assert hits == sum(cached)
