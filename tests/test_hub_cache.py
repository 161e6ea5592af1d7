"""A hub id resolves to its snapshot in the local Hugging Face cache, offline, wherever a
model is accepted (a fake cache in tmp_path, laid out as huggingface_hub lays it out)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from kvshare import manifest
from kvshare.testing import make_peft_adapter

from conftest import assert_one_line_error

REPO = "HuggingFaceTB/SmolLM2-135M-Instruct"
REVISION = "0123456789abcdef0123456789abcdef01234567"


def fake_hub_cache(cache: Path, repo_id: str, model_dir: Path, ref: bool = True) -> Path:
    """``models--org--name/{blobs,snapshots/<rev>,refs/main}`` holding ``model_dir``'s files;
    returns the snapshot folder."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / REVISION
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for file in model_dir.iterdir():
        blob = repo / "blobs" / hashlib.sha256(file.read_bytes()).hexdigest()
        blob.write_bytes(file.read_bytes())
        (snapshot / file.name).symlink_to(Path("../../blobs") / blob.name)
    if ref:
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(REVISION)
    return snapshot


@pytest.fixture
def hf_home(tmp_path, monkeypatch) -> Path:
    home = tmp_path / "hf-home"
    for variable in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # belt and braces: nothing here may reach the network
    return home


def test_models_path_resolves_a_hub_id_from_the_cache(cli, tiny_models, hf_home):
    snapshot = fake_hub_cache(hf_home / "hub", REPO, tiny_models("llama"))
    result = cli("models", "path", REPO)
    assert result.code == 0, result.err
    assert Path(result.out.strip()) == snapshot
    # the same model as the folder it was made from
    fingerprint = json.loads(cli("models", "fingerprint", REPO).out)
    assert fingerprint == json.loads(cli("models", "fingerprint", tiny_models("llama")).out)


def test_hf_hub_cache_overrides_hf_home(cli, tiny_models, hf_home, tmp_path, monkeypatch):
    fake_hub_cache(hf_home / "hub", REPO, tiny_models("llama"))
    elsewhere = fake_hub_cache(tmp_path / "other-cache", REPO, tiny_models("llama", seed=1))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "other-cache"))
    assert Path(cli("models", "path", REPO).out.strip()) == elsewhere


def test_a_revision_without_a_main_ref_is_found_by_scanning(cli, tiny_models, hf_home):
    snapshot = fake_hub_cache(hf_home / "hub", REPO, tiny_models("llama"), ref=False)
    assert Path(cli("models", "path", REPO).out.strip()) == snapshot


def test_a_hub_id_not_in_the_cache_is_a_clear_error(cli, hf_home):
    assert_one_line_error(cli("models", "path", "someone/not-downloaded"), "not in the local Hugging Face cache",
                          str(hf_home / "hub"))
    assert_one_line_error(cli("models", "path", "no-such-zoo-name"), "unknown model")


def test_export_and_the_engine_accept_a_cached_hub_id(cli, tiny_models, hf_home, tmp_path):
    from huggingface_hub import ModelCard

    from kvshare.serve import LLM, SamplingParams

    snapshot = fake_hub_cache(hf_home / "hub", REPO, tiny_models("llama"))
    ckpt = make_peft_adapter(tiny_models("llama"), tmp_path / "ckpt")
    out = tmp_path / "adapter"
    result = cli("export", ckpt, "--kind", "icarus", "--base", REPO, "--out", out)
    assert result.code == 0, result.err
    assert manifest.read(out)["base_model"]["name"] == REPO  # not the snapshot's revision hash
    assert ModelCard.load(out / "README.md").data.base_model == REPO
    llm = LLM(REPO, [out], kv_cache_tokens=256)
    assert llm.engine.model_dir == snapshot
    assert len(llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), adapter="adapter")[0].token_ids) == 2
