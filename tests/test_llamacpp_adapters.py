"""kvshare's LoRA and aLoRA adapters inside llama.cpp (``kvshare export --format gguf``).

Runs llama.cpp through llama-cpp-python in its peer venv (``KVSHARE_LLAMACPP_VENV``; marker
``peers``, skipped without it), on SmolLM2-135M-Instruct: the zoo's GGUF, dequantized to
float32 so llama.cpp and PyTorch compute on the same weights. Against PEFT's float32 logits and
kvshare's engine:

- the base: llama.cpp's own error, the yardstick for the rest;
- a LoRA on every projection: the adapter's effect reproduced to within a few times that;
- an aLoRA, its prompt's pre-invocation tokens decoded by the base and the rest with the
  adapter (what a cache shared with the base holds): nothing changes before the invocation,
  PEFT's aLoRA logits after it, kvshare's greedy tokens;
- the same LoRA written without llama.cpp's q/k row order: measurably wrong (the check bites).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvshare.eval.perf.peers import ensure_llamacpp_venv, llamacpp_gguf
from kvshare.export import export_adapter
from kvshare.gguf_export import GGUF_ARCHITECTURES, write_gguf_adapter
from kvshare.serve import LLM, SamplingParams
from kvshare.testing import make_peft_adapter

pytestmark = [pytest.mark.integration, pytest.mark.peers]
PROBE = Path(__file__).with_name("peers") / "llamacpp_adapter_probe.py"
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
INVOCATION = "<|im_start|>assistant\n"
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def venv() -> Path:
    if not os.environ.get("KVSHARE_LLAMACPP_VENV"):
        pytest.skip("KVSHARE_LLAMACPP_VENV names no llama.cpp peer venv (docs/guides/llama-cpp.md)")
    return ensure_llamacpp_venv(Path(os.environ["KVSHARE_LLAMACPP_VENV"]))


def float32_copy(source: Path, out: Path) -> Path:
    """The GGUF at ``source`` with every tensor dequantized to float32, its metadata kept."""
    reader = gguf.GGUFReader(source)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(out, arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        value = 0 if field.name == gguf.Keys.General.FILE_TYPE else field.contents()  # 0: all float32
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, field.types[0], sub_type=sub_type)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out



@pytest.fixture(scope="module")
def setup(venv, smollm2_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("llamacpp")
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    invocation = tokenizer.encode(INVOCATION, add_special_tokens=False)
    lora = export_adapter(make_peft_adapter(smollm2_dir, root / "lora-ckpt", target_modules=ALL, rank=8, seed=3,
                                            b_std=0.05), kind="lora", base=smollm2_dir, out=root / "lora")
    alora = export_adapter(make_peft_adapter(smollm2_dir, root / "alora-ckpt", target_modules=ALL, rank=8, seed=4,
                                             invocation_tokens=invocation, b_std=0.05),
                           kind="alora", base=smollm2_dir, out=root / "alora", invocation=INVOCATION)
    files = {name: write_gguf_adapter(folder, smollm2_dir, root / f"{name}.gguf", kind=name, name=name)
             for name, folder in (("lora", lora), ("alora", alora))}
    GGUF_ARCHITECTURES["llama"], saved = ("LLAMA", False), GGUF_ARCHITECTURES["llama"]
    try:  # the control: q/k rows left in Hugging Face's order
        files["unpermuted"] = write_gguf_adapter(lora, smollm2_dir, root / "unpermuted.gguf", kind="lora", name="x")
    finally:
        GGUF_ARCHITECTURES["llama"] = saved
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Name three uses of a paperclip."}],
                                           tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"]
    start = len(prompt) - len(invocation)
    assert prompt[start:] == invocation  # the chat template ends with the invocation
    cases = [{"name": "base", "adapter": None, "activate_at": 0},
             {"name": "lora", "adapter": str(files["lora"]), "activate_at": 0},
             {"name": "unpermuted", "adapter": str(files["unpermuted"]), "activate_at": 0},
             {"name": "alora", "adapter": str(files["alora"]), "activate_at": start}]
    for case in cases:
        case.update(tokens=prompt, new_tokens=NEW_TOKENS)
    (root / "cases.json").write_text(json.dumps(cases))
    base_gguf = float32_copy(llamacpp_gguf(smollm2_dir), root / "base-f32.gguf")
    result = subprocess.run([str(venv / "bin" / "python"), "-P", str(PROBE), "--gguf", str(base_gguf), "--cases",
                             str(root / "cases.json"), "--out", str(root / "out.npz")],
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    return {"prompt": prompt, "start": start, "llama": dict(np.load(root / "out.npz")), "lora": lora,
            "alora": alora}


def peft_logits(smollm2_dir, adapter, prompt) -> np.ndarray:
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir).eval()
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).eval()
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0].numpy()


def engine_greedy(smollm2_dir, adapter, prompt) -> list[int]:
    llm = LLM(smollm2_dir, kv_cache_tokens=1024, block_size=16)
    name = llm.engine.load_adapter(adapter) if adapter is not None else None
    return llm.generate([prompt], SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True), adapter=name)[0].token_ids


def test_lora_in_llama_cpp_reproduces_the_adapter_within_the_base_error(setup, smollm2_dir):
    prompt, llama = setup["prompt"], setup["llama"]
    base, lora = peft_logits(smollm2_dir, None, prompt), peft_logits(smollm2_dir, setup["lora"], prompt)
    base_error = np.abs(llama["base.logits"] - base).max()
    error = np.abs(llama["lora.logits"] - lora).max()
    effect = np.abs(lora - base).max()
    wrong = np.abs(llama["unpermuted.logits"] - lora).max()
    print(f"llama.cpp vs PyTorch, max |logit| difference: base {base_error:.2e}, LoRA {error:.2e}; "
          f"the LoRA's effect {effect:.2f}; unpermuted q/k {wrong:.2e}")
    assert base_error < 1e-2 and error < max(5 * base_error, 1e-3)
    assert effect > 100 * error and wrong > 10 * error
    assert list(llama["lora.generated"]) == engine_greedy(smollm2_dir, setup["lora"], prompt)


def test_alora_in_llama_cpp_changes_nothing_before_its_invocation(setup, smollm2_dir):
    prompt, start, llama = setup["prompt"], setup["start"], setup["llama"]
    assert np.array_equal(llama["alora.logits"][:start], llama["base.logits"][:start])
    reference = peft_logits(smollm2_dir, setup["alora"], prompt)
    base = peft_logits(smollm2_dir, None, prompt)
    assert np.allclose(reference[:start], base[:start], atol=1e-5)  # PEFT: base before the invocation
    error = np.abs(llama["alora.logits"][start:] - reference[start:]).max()
    effect = np.abs(reference[start:] - base[start:]).max()
    print(f"aLoRA after its invocation: llama.cpp vs PEFT {error:.2e}; the adapter's effect {effect:.2f}")
    assert error < 1e-2 and effect > 100 * error
    assert list(llama["alora.generated"]) == engine_greedy(smollm2_dir, setup["alora"], prompt)
