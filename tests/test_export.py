"""kvshare export / inspect: kind rules, base checks, atomic writes, every bad input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvshare import manifest
from kvshare.errors import KvshareError
from kvshare.testing import make_peft_adapter

from conftest import assert_one_line_error

INVOCATION = "<|invoke|>check<|end_invoke|>"


@pytest.fixture(scope="module")
def base(tiny_models) -> Path:
    return tiny_models("llama")


@pytest.fixture(scope="module")
def invocation_ids(base) -> list[int]:
    return AutoTokenizer.from_pretrained(base).encode(INVOCATION, add_special_tokens=False)


@pytest.fixture(scope="module")
def checkpoints(base, invocation_ids, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("peft")
    return {
        "icarus": make_peft_adapter(base, root / "icarus"),
        "lora": make_peft_adapter(base, root / "lora",
                                  target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
        "alora": make_peft_adapter(base, root / "alora", target_modules=["q_proj", "k_proj", "v_proj"],
                                   invocation_tokens=invocation_ids),
    }


def copy_ckpt(checkpoints, kind, tmp_path) -> Path:
    return Path(shutil.copytree(checkpoints[kind], tmp_path / f"ckpt-{kind}"))


def export(cli, ckpt, kind, base, out, *extra):
    return cli("export", ckpt, "--kind", kind, "--base", base, "--out", out, *extra)


@pytest.mark.parametrize("kind", ["icarus", "lora", "alora"])
def test_export_writes_adapter_and_manifest_that_peft_still_loads(cli, checkpoints, base, kind,
                                                                   tmp_path, invocation_ids):
    out = tmp_path / f"math-{kind}"
    extra = ["--invocation", INVOCATION] if kind == "alora" else []
    result = export(cli, checkpoints[kind], kind, base, out, *extra)
    assert result.code == 0, result.err
    assert sorted(p.name for p in out.iterdir()) == [
        "README.md", "adapter_config.json", "adapter_model.safetensors", "kvshare.json"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    data = manifest.read(out)
    assert data["kind"] == kind and data["name"] == f"math-{kind}"
    assert data["base_model"]["fingerprint"] == json.loads(
        cli("models", "fingerprint", base).out)["base"]
    assert data["provenance"]["source_checkpoint"] == str(checkpoints[kind].resolve())
    if kind == "alora":
        assert data["alora"] == {"invocation_string": INVOCATION, "invocation_token_ids": invocation_ids}
    # PEFT loads the exported folder unchanged, and it is the same adapter as the source.
    ids = torch.tensor([[5, 6, *invocation_ids, 7, 8]])
    outputs = []
    for folder in (checkpoints[kind], out):
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), folder)
        with torch.no_grad():
            outputs.append(model(ids).logits)
    assert torch.equal(outputs[0], outputs[1])
    plain = AutoModelForCausalLM.from_pretrained(base)(ids).logits
    assert not torch.allclose(outputs[0], plain)  # the adapter really does something
    inspected = cli("inspect", out, "--base", base)
    assert inspected.code == 0, inspected.err
    assert "valid" in inspected.out and f'"kind": "{kind}"' in inspected.out


@pytest.mark.parametrize("kind", ["icarus", "lora", "alora"])
def test_export_writes_a_model_card_that_says_how_to_load_it(cli, checkpoints, base, kind, tmp_path):
    from huggingface_hub import ModelCard

    from kvshare.export import verify_adapter_dir
    from kvshare.kinds import AdapterKind
    from kvshare.serve.exec.adapters import adapter_digest

    out = tmp_path / f"card-{kind}"
    extra = ["--invocation", INVOCATION] if kind == "alora" else []
    assert export(cli, checkpoints[kind], kind, base, out, *extra).code == 0
    data = manifest.read(out)
    card = ModelCard.load(out / "README.md")  # the Hub's own parser reads the front-matter
    assert card.data.base_model == base.name and card.data.library_name == "peft"
    assert {"kvshare", f"kvshare-{kind}", "lora"} <= set(card.data.tags)
    text = " ".join(card.text.split())
    assert f"**{kind}** adapter" in text and f"rank {data['lora']['rank']}" in text
    assert data["base_model"]["fingerprint"] in text
    warnings = {"icarus": ["Warning: do not load this adapter as a plain LoRA", "PEFT", "vLLM", "llama.cpp",
                           "its *own* keys and values", "behaves differently from how it was trained"],
                "alora": ["Warning: load this adapter as an activated LoRA", "PEFT >= 0.18",
                          "alora_invocation_tokens", "applies the adapter to every token", INVOCATION],
                "lora": ["conventional LoRA"]}[kind]
    assert all(w in text for w in warnings), text
    if kind == "lora":
        assert "Warning" not in text
    # the card is documentation: the content digest and verification ignore it
    invocation = data.get("alora", {}).get("invocation_token_ids")
    digest = adapter_digest(out, AdapterKind(kind), invocation)
    (out / "README.md").write_text("edited by a user\n")
    assert adapter_digest(out, AdapterKind(kind), invocation) == digest
    assert verify_adapter_dir(out, base)["name"] == data["name"]


def test_provenance_file_is_recorded(cli, checkpoints, base, tmp_path):
    prov = tmp_path / "prov.json"
    prov.write_text(json.dumps({"recipe": "recipes/math-icarus.yaml", "steps": 40, "seed": 1,
                                "final_loss": 0.5}))
    out = tmp_path / "a"
    assert export(cli, checkpoints["icarus"], "icarus", base, out, "--provenance", prov).code == 0
    assert manifest.read(out)["provenance"]["steps"] == 40


def test_icarus_refuses_k_and_v_targets(cli, checkpoints, base, tmp_path):
    result = export(cli, checkpoints["lora"], "icarus", base, tmp_path / "out")
    assert_one_line_error(result, "k_proj, v_proj", "share")
    assert not (tmp_path / "out").exists()


def test_alora_checkpoint_cannot_be_exported_as_another_kind(cli, checkpoints, base, tmp_path):
    assert_one_line_error(export(cli, checkpoints["alora"], "lora", base, tmp_path / "o"),
                          "--kind alora")


def test_alora_needs_invocation_tokens(cli, checkpoints, base, tmp_path):
    result = export(cli, checkpoints["lora"], "alora", base, tmp_path / "o", "--invocation", INVOCATION)
    assert_one_line_error(result, "alora_invocation_tokens")


def test_alora_needs_the_invocation_string(cli, checkpoints, base, tmp_path):
    assert_one_line_error(export(cli, checkpoints["alora"], "alora", base, tmp_path / "o"),
                          "--invocation")


def test_alora_invocation_must_match_the_tokens(cli, checkpoints, base, tmp_path):
    result = export(cli, checkpoints["alora"], "alora", base, tmp_path / "o",
                    "--invocation", "<|invoke|>other")
    assert_one_line_error(result, "encodes to", "alora_invocation_tokens")


def test_alora_without_causal_lm_task_type_is_refused(cli, checkpoints, base, tmp_path):
    ckpt = copy_ckpt(checkpoints, "alora", tmp_path)
    config = json.loads((ckpt / "adapter_config.json").read_text())
    config["task_type"] = None
    (ckpt / "adapter_config.json").write_text(json.dumps(config))
    result = export(cli, ckpt, "alora", base, tmp_path / "o", "--invocation", INVOCATION)
    assert_one_line_error(result, "CAUSAL_LM", "silently")


def test_unknown_kind(cli, checkpoints, base, tmp_path):
    assert_one_line_error(export(cli, checkpoints["lora"], "prefix", base, tmp_path / "o"),
                          "unknown adapter kind 'prefix'")


def test_adapter_for_another_base_is_refused(cli, checkpoints, tmp_path):
    from kvshare.testing import make_tiny_model

    wider = make_tiny_model(tmp_path / "wider", "llama", hidden_size=96, head_dim=24)
    assert_one_line_error(export(cli, checkpoints["icarus"], "icarus", wider, tmp_path / "o"),
                          "another base")


def test_target_module_missing_from_base_is_refused(cli, checkpoints, base, tmp_path):
    ckpt = copy_ckpt(checkpoints, "icarus", tmp_path)
    config = json.loads((ckpt / "adapter_config.json").read_text())
    config["target_modules"] = ["q_proj", "c_attn"]
    (ckpt / "adapter_config.json").write_text(json.dumps(config))
    assert_one_line_error(export(cli, ckpt, "icarus", base, tmp_path / "o"), "c_attn")


def test_missing_checkpoint_folder(cli, base, tmp_path):
    assert_one_line_error(export(cli, tmp_path / "nope", "lora", base, tmp_path / "o"), "no such")


def test_missing_base(cli, checkpoints, tmp_path):
    assert_one_line_error(export(cli, checkpoints["lora"], "lora", tmp_path / "nobase", tmp_path / "o"),
                          "unknown model")


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_corrupt_safetensors(cli, checkpoints, base, tmp_path, damage):
    ckpt = copy_ckpt(checkpoints, "lora", tmp_path)
    weights = ckpt / "adapter_model.safetensors"
    blob = weights.read_bytes()
    weights.write_bytes(blob[: len(blob) // 2] if damage == "truncate" else b"\x00garbage" * 50)
    assert_one_line_error(export(cli, ckpt, "lora", base, tmp_path / "o"), "not a valid safetensors")
    assert not (tmp_path / "o").exists()


def test_pickle_only_checkpoint_is_refused_unopened(cli, checkpoints, base, tmp_path):
    ckpt = copy_ckpt(checkpoints, "lora", tmp_path)
    (ckpt / "adapter_model.safetensors").unlink()
    # Not even a valid pickle: the test fails loudly if anything tried to unpickle it.
    (ckpt / "adapter_model.bin").write_bytes(b"\x80\x04NOT-A-PICKLE")
    assert_one_line_error(export(cli, ckpt, "lora", base, tmp_path / "o"), "pickle", "adapter_model.bin")


def test_malformed_adapter_config(cli, checkpoints, base, tmp_path):
    ckpt = copy_ckpt(checkpoints, "lora", tmp_path)
    (ckpt / "adapter_config.json").write_text('{"r": 4,')
    assert_one_line_error(export(cli, ckpt, "lora", base, tmp_path / "o"), "malformed JSON")


def test_refuses_to_overwrite_without_force_and_replaces_with_it(cli, checkpoints, base, tmp_path):
    out = tmp_path / "adapter"
    assert export(cli, checkpoints["icarus"], "icarus", base, out).code == 0
    before = (out / "kvshare.json").read_text()
    assert_one_line_error(export(cli, checkpoints["icarus"], "icarus", base, out), "--force")
    assert (out / "kvshare.json").read_text() == before
    assert export(cli, checkpoints["lora"], "lora", base, out, "--force").code == 0
    assert manifest.read(out)["kind"] == "lora"
    assert [p.name for p in tmp_path.iterdir()] == ["adapter"]


@pytest.mark.parametrize("where", ["itself", "inside", "around"])
def test_out_may_not_be_inside_or_around_the_checkpoint(cli, checkpoints, base, tmp_path, where):
    """--force replaces --out whole, so a folder holding the checkpoint is refused untouched."""
    run = tmp_path / "run"
    ckpt = Path(shutil.copytree(checkpoints["icarus"], run / "final"))
    out = {"itself": ckpt, "inside": ckpt / "adapter", "around": run}[where]
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    result = export(cli, ckpt, "icarus", base, out, "--force")
    assert_one_line_error(result, "CHECKPOINT_DIR")
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


@pytest.mark.parametrize("where", ["the base", "a folder of files"])
def test_force_replaces_only_an_exported_adapter(cli, checkpoints, base, tmp_path, where):
    """--force deletes what it replaces: a base model's folder (or any folder of other files)
    is refused untouched."""
    target = Path(shutil.copytree(base, tmp_path / "base")) if where == "the base" else tmp_path / "work"
    if where != "the base":
        target.mkdir()
        (target / "notes.txt").write_text("mine")
    before = sorted(p.name for p in target.iterdir())
    result = export(cli, checkpoints["icarus"], "icarus", target if where == "the base" else base, target, "--force")
    assert_one_line_error(result, "no kvshare.json")
    assert sorted(p.name for p in target.iterdir()) == before


def test_out_through_a_link_loop_or_the_working_folder(cli, checkpoints, base, tmp_path, monkeypatch):
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    assert_one_line_error(export(cli, checkpoints["icarus"], "icarus", base, tmp_path / "loop"), "loop")
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)  # an empty working folder, replaced by the adapter
    assert export(cli, checkpoints["icarus"], "icarus", base, ".", "--force").code == 0
    assert manifest.read(tmp_path / "here")["name"] == "here"


@pytest.mark.parametrize("key,value", [("r", "eight"), ("lora_alpha", [16]), ("target_modules", [1]),
                                       ("use_rslora", "yes")])
def test_config_values_of_the_wrong_type_are_one_line_errors(cli, checkpoints, base, tmp_path, key, value):
    ckpt = copy_ckpt(checkpoints, "lora", tmp_path)
    config = json.loads((ckpt / "adapter_config.json").read_text())
    config[key] = value
    (ckpt / "adapter_config.json").write_text(json.dumps(config))
    assert_one_line_error(export(cli, ckpt, "lora", base, tmp_path / "o"), f"{key} must be")


def test_a_config_rewritten_during_the_export_is_refused(cli, checkpoints, base, tmp_path, monkeypatch):
    """The manifest is built from the config that was checked; one rewritten before the copy
    (a trainer still writing) would ship other settings under it."""
    from kvshare import export as export_module

    ckpt = copy_ckpt(checkpoints, "lora", tmp_path)
    check = export_module.check_kind_rules

    def rewritten(*args, **kwargs):
        config = json.loads((ckpt / "adapter_config.json").read_text())
        (ckpt / "adapter_config.json").write_text(json.dumps({**config, "lora_alpha": 99}))
        return check(*args, **kwargs)

    monkeypatch.setattr(export_module, "check_kind_rules", rewritten)
    assert_one_line_error(export(cli, ckpt, "lora", base, tmp_path / "o"), "changed during the export")
    assert not (tmp_path / "o").exists()


def test_failed_export_leaves_nothing_behind(cli, checkpoints, base, tmp_path, monkeypatch):
    """A failure while writing (here: the manifest write) removes the staging folder."""
    from kvshare import export as export_module

    def boom(data, folder):
        raise OSError("disk full")

    monkeypatch.setattr(export_module.manifest, "write", boom)
    out_parent = tmp_path / "adapters"
    out_parent.mkdir()
    result = export(cli, checkpoints["icarus"], "icarus", base, out_parent / "a")
    assert_one_line_error(result, "disk full")
    assert list(out_parent.iterdir()) == []


def test_inspect_refuses_a_different_base(cli, checkpoints, base, tiny_models, tmp_path):
    out = tmp_path / "a"
    assert export(cli, checkpoints["icarus"], "icarus", base, out).code == 0
    result = cli("inspect", out, "--base", tiny_models("llama", seed=1))
    assert_one_line_error(result, "was made for base")


def test_inspect_without_base_and_with_a_broken_manifest(cli, checkpoints, base, tmp_path):
    out = tmp_path / "a"
    assert export(cli, checkpoints["lora"], "lora", base, out).code == 0
    ok = cli("inspect", out)
    assert ok.code == 0 and "fingerprint not checked" in ok.out
    data = json.loads((out / "kvshare.json").read_text())
    data["kind"] = "icarus"  # claims to share KV it does not
    (out / "kvshare.json").write_text(json.dumps(data))
    assert_one_line_error(cli("inspect", out), "kv_sharing")
    (out / "kvshare.json").write_text("[1, 2")
    assert_one_line_error(cli("inspect", out), "malformed JSON")


def test_adapter_files_changed_after_export_are_refused(cli, checkpoints, base, tmp_path):
    """The manifest records each file's sha256: weights retrained in place or a config edited
    after export are refused by inspect and by the engine (they would serve another adapter
    under the manifest's name, kind and KV rule); a manifest from before the field passes."""
    from safetensors.torch import load_file, save_file

    from kvshare.serve import LLM

    out = tmp_path / "a"
    assert export(cli, checkpoints["lora"], "lora", base, out).code == 0
    recorded = manifest.read(out)["files"]
    assert recorded == manifest.file_digests(out) and set(recorded) == set(manifest.EXPORTED_FILES)
    exported = (out / "adapter_model.safetensors").read_bytes()
    weights = load_file(out / "adapter_model.safetensors")
    save_file({k: v + 1 if n == 0 else v for n, (k, v) in enumerate(weights.items())},
              out / "adapter_model.safetensors")  # same names and shapes: every other check passes
    assert_one_line_error(cli("inspect", out, "--base", base),
                          "adapter_model.safetensors changed since it was exported")
    with pytest.raises(KvshareError, match="changed since it was exported"):
        LLM(base, [out])
    (out / "adapter_model.safetensors").write_bytes(exported)
    assert cli("inspect", out, "--base", base).code == 0  # the exported bytes again
    config = out / "adapter_config.json"
    values = json.loads(config.read_text())
    config.write_text(json.dumps(values, indent=4).replace("\n", "\r\n"))  # re-indented, CRLF: not a change
    assert cli("inspect", out).code == 0
    config.write_text(json.dumps({**values, "lora_dropout": 0.25}))
    assert_one_line_error(cli("inspect", out), "adapter_config.json changed since it was exported")
    data = json.loads((out / "kvshare.json").read_text())
    del data["files"]  # exported before kvshare recorded digests
    (out / "kvshare.json").write_text(json.dumps(data))
    assert cli("inspect", out, "--base", base).code == 0


def test_the_engine_checks_and_digests_the_weights_it_loaded(cli, checkpoints, base, tmp_path, monkeypatch):
    """The engine reads an adapter's weights once: the manifest's check, the tensors and the
    digest its KV blocks are keyed by come from the same bytes. Weights swapped between the
    folder's verification and the load are refused, not served under the verified digest."""
    from safetensors.torch import load_file, save_file

    from kvshare.kinds import AdapterKind
    from kvshare.serve import LLM
    from kvshare.serve.exec import adapters as serving
    from kvshare.serve.exec.adapters import adapter_digest

    out = tmp_path / "a"
    assert export(cli, checkpoints["lora"], "lora", base, out).code == 0
    llm = LLM(base, [out])
    loaded = llm.engine._adapters.slots[0]
    assert loaded.digest == adapter_digest(out, AdapterKind.LORA, None)  # the same digest as read from disk
    weights = load_file(out / "adapter_model.safetensors")
    verify = serving.verify_adapter_dir

    def verified_then_swapped(folder, **settings):
        data = verify(folder, **settings)
        save_file({k: v + 1 for k, v in weights.items()}, out / "adapter_model.safetensors")
        return data

    monkeypatch.setattr(serving, "verify_adapter_dir", verified_then_swapped)
    with pytest.raises(KvshareError, match="adapter_model.safetensors changed since it was exported"):
        llm.engine.load_adapter(out, name="again")


@pytest.mark.parametrize("pattern", ["alpha_pattern", "rank_pattern"])
def test_per_module_rank_or_alpha_is_refused(cli, checkpoints, base, tmp_path, pattern):
    """Serving fuses q/k/v (and gate/up) under one scale: a per-module alpha was lost, and a
    per-module rank failed every batch with an adapter row once loaded."""
    ckpt = copy_ckpt(checkpoints, "lora", tmp_path)
    config = json.loads((ckpt / "adapter_config.json").read_text())
    config[pattern] = {"v_proj": 2}
    (ckpt / "adapter_config.json").write_text(json.dumps(config))
    assert_one_line_error(export(cli, ckpt, "lora", base, tmp_path / "o"), pattern)


def test_system_prompt_is_recorded_for_serving(cli, checkpoints, base, tmp_path):
    out = tmp_path / "a"
    assert export(cli, checkpoints["lora"], "lora", base, out, "--system-prompt", "You are terse.").code == 0
    assert manifest.read(out)["chat"] == {"system_prompt": "You are terse."}
    assert export(cli, checkpoints["lora"], "lora", base, tmp_path / "b").code == 0
    assert "chat" not in manifest.read(tmp_path / "b")


def test_a_config_without_lora_alpha_is_served_with_pefts_default(cli, checkpoints, base, tmp_path):
    """LoraConfig's lora_alpha defaults to 8, and PEFT loads a config without it so: not r."""
    from kvshare.serve import LLM, SamplingParams

    ckpt = copy_ckpt(checkpoints, "lora", tmp_path)
    config = json.loads((ckpt / "adapter_config.json").read_text())
    assert config["r"] != 8
    del config["lora_alpha"]
    (ckpt / "adapter_config.json").write_text(json.dumps(config))
    out = tmp_path / "o"
    assert export(cli, ckpt, "lora", base, out).code == 0
    assert manifest.read(out)["lora"]["alpha"] == 8
    prompt = [1, 5, 9, 13, 2, 7]
    hf = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), out).eval()
    expected = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, len(prompt):].tolist()
    llm = LLM(base, [out])
    got = llm.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True), adapter="o")[0].token_ids
    assert got == expected


@pytest.mark.parametrize("key,value,message", [
    ("init_lora_weights", "pissa_niter_4", "changes the base weights"), ("init_lora_weights", "loftq", "changes the base"),
    ("init_lora_weights", "lora_ga", "changes the base"), ("layer_replication", [[0, 1], [0, 1]], "layer_replication"),
    ("use_bdlora", {"nblocks": 2}, "use_bdlora"), ("kasa_config", {"beta": 0.1}, "kasa_config")])
def test_configs_that_serve_another_computation_are_refused(cli, checkpoints, base, tmp_path, key, value, message):
    """PEFT re-runs a PiSSA/OLoRA/CorDA/LoftQ init on load, rewriting the base; layer_replication
    builds other layers: kvshare would serve the plain base with the adapter, other outputs."""
    ckpt = copy_ckpt(checkpoints, "lora", tmp_path)
    config = json.loads((ckpt / "adapter_config.json").read_text())
    config[key] = value
    (ckpt / "adapter_config.json").write_text(json.dumps(config))
    assert_one_line_error(export(cli, ckpt, "lora", base, tmp_path / "o"), message)

