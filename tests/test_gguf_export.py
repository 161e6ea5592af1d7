"""kvshare export --format gguf: llama.cpp adapter files for LoRA and aLoRA, ICaRus refused.

What llama.cpp computes from these files is checked in tests/test_llamacpp_adapters.py (in
llama.cpp's peer venv); here: the file's keys, names, shapes and values, and every refusal.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
from safetensors.torch import load_file
from transformers import AutoTokenizer

from kvshare.testing import make_peft_adapter

from conftest import assert_one_line_error

INVOCATION = "<|invoke|>check<|end_invoke|>"
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def base(tiny_models) -> Path:
    return tiny_models("llama")


@pytest.fixture(scope="module")
def checkpoints(base, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("peft")
    ids = AutoTokenizer.from_pretrained(base).encode(INVOCATION, add_special_tokens=False)
    return {"lora": make_peft_adapter(base, root / "lora", target_modules=ALL, rank=4, alpha=8.0),
            "alora": make_peft_adapter(base, root / "alora", target_modules=["q_proj", "k_proj", "v_proj"],
                                       invocation_tokens=ids, rank=4, alpha=16.0),
            "icarus": make_peft_adapter(base, root / "icarus")}


def llama_cpp_rows(rows: int, heads: int) -> np.ndarray:
    """Written out independently of the exporter: llama.cpp's row for each Hugging Face row of
    a q/k projection. HF keeps a head's RoPE halves apart (i, i + d/2); llama.cpp interleaves
    them (2i, 2i + 1)."""
    d = rows // heads
    order = np.empty(rows, dtype=np.int64)
    for h in range(heads):
        for half in range(2):
            for i in range(d // 2):
                order[h * d + 2 * i + half] = h * d + half * d // 2 + i
    return order


def read(path: Path) -> tuple[dict, dict[str, np.ndarray]]:
    reader = gguf.GGUFReader(path)
    fields = {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}
    fields["_types"] = {name: [t.name for t in field.types] for name, field in reader.fields.items()}
    return fields, {t.name: np.array(t.data).reshape([int(n) for n in reversed(t.shape)]) for t in reader.tensors}


@pytest.mark.parametrize("kind", ["lora", "alora"])
def test_gguf_holds_llama_cpp_names_alpha_and_permuted_qk(cli, base, checkpoints, kind, tmp_path):
    out = tmp_path / f"{kind}.gguf"
    extra = ["--invocation", INVOCATION] if kind == "alora" else []
    result = cli("export", checkpoints[kind], "--kind", kind, "--base", base, "--out", out, "--format", "gguf", *extra)
    assert result.code == 0, result.err
    assert [p.name for p in tmp_path.iterdir()] == [out.name]  # no staging left behind
    fields, tensors = read(out)
    peft = json.loads((checkpoints[kind] / "adapter_config.json").read_text())
    assert fields["general.type"] == "adapter" and fields["adapter.type"] == "lora"
    assert fields["general.architecture"] == "llama"
    assert fields["adapter.lora.alpha"] == peft["lora_alpha"]
    if kind == "alora":
        assert fields["adapter.alora.invocation_tokens"] == peft["alora_invocation_tokens"]
        assert fields["_types"]["adapter.alora.invocation_tokens"] == ["ARRAY", "UINT32"]  # llama.cpp's rule
    else:
        assert "adapter.alora.invocation_tokens" not in fields
    config = json.loads((base / "config.json").read_text())
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    weights = load_file(checkpoints[kind] / "adapter_model.safetensors")
    leaves = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
              "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}
    assert len(tensors) == len(weights)
    for key, value in weights.items():
        layer, leaf, part = int(key.split(".layers.")[1].split(".")[0]), key.split(".")[-3], key.split(".")[-2]
        got = tensors[f"blk.{layer}.{leaves[leaf]}.weight.lora_{part[-1].lower()}"]
        want = value.float().numpy()
        if part == "lora_B" and leaf in ("q_proj", "k_proj"):
            want = want[llama_cpp_rows(want.shape[0], heads if leaf == "q_proj" else kv_heads)]
        np.testing.assert_array_equal(got, want)


def test_gguf_from_an_exported_folder_and_rslora_alpha(cli, base, checkpoints, tmp_path):
    ckpt = Path(shutil.copytree(checkpoints["lora"], tmp_path / "rs"))
    config = json.loads((ckpt / "adapter_config.json").read_text())
    (ckpt / "adapter_config.json").write_text(json.dumps({**config, "use_rslora": True}))
    folder = tmp_path / "exported"
    assert cli("export", ckpt, "--kind", "lora", "--base", base, "--out", folder).code == 0
    out = tmp_path / "rs.gguf"
    result = cli("export", folder, "--base", base, "--out", out, "--format", "gguf")
    assert result.code == 0, result.err
    fields, _ = read(out)
    # llama.cpp scales by alpha / r; rsLoRA by alpha / sqrt(r)
    assert fields["adapter.lora.alpha"] / config["r"] == pytest.approx(config["lora_alpha"] / config["r"] ** 0.5)
    assert fields["general.name"] == "exported"


def test_gguf_refusals_are_one_line_and_leave_nothing(cli, base, checkpoints, tmp_path):
    out = tmp_path / "x.gguf"
    refused = cli("export", checkpoints["icarus"], "--kind", "icarus", "--base", base, "--out", out, "--format", "gguf")
    assert_one_line_error(refused, "ICaRus", "llama.cpp")
    folder = tmp_path / "icarus"
    assert cli("export", checkpoints["icarus"], "--kind", "icarus", "--base", base, "--out", folder).code == 0
    assert_one_line_error(cli("export", folder, "--base", base, "--out", out, "--format", "gguf"), "ICaRus")
    assert_one_line_error(cli("export", checkpoints["lora"], "--base", base, "--out", out, "--format", "gguf"),
                          "--kind")
    assert_one_line_error(cli("export", checkpoints["lora"], "--base", base, "--out", tmp_path / "f"),
                          "--kind is required")  # the folder format still needs it
    assert not out.exists() and not (tmp_path / "f").exists()
    notes = tmp_path / "notes.gguf"
    notes.write_text("mine")
    args = ["export", checkpoints["lora"], "--kind", "lora", "--base", base, "--format", "gguf", "--out"]
    assert_one_line_error(cli(*args, notes), "--force")
    assert_one_line_error(cli(*args, notes, "--force"), "not a GGUF")
    assert notes.read_text() == "mine"
    assert_one_line_error(cli(*args, tmp_path), "is a folder")
    assert cli(*args, out).code == 0 and cli(*args, out, "--force").code == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["icarus", "notes.gguf", "x.gguf"]
