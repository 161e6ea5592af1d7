"""Runtime adapter loading is scoped: paths under --lora-root, start-up adapters kept, refusals
that tell nothing about the disk, non-finite weights refused in every KV layout, and loads
that read their files off the engine thread against a base fingerprinted once."""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time

import httpx
import pytest
import torch
from fastapi.testclient import TestClient
from safetensors.torch import load_file, save_file

from kvshare import manifest
from kvshare.adapters import ADAPTER_WEIGHTS
from kvshare.errors import KvshareError
from kvshare.serve import LLM, LLMEngine, SamplingParams
from kvshare.serve.http.lora_scope import ALLOW_REPLACE_FLAG, REFUSED_PATH
from kvshare.serve.http.server import create_app

from test_engine import adapters, base, invocation, prompts_for, tokenizer  # noqa: F401
from test_server import AUTH, _post, running_server

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


def _engine(base, startup=(), **settings) -> LLMEngine:
    return LLMEngine(base, list(startup), **({"kv_cache_tokens": 1024, "block_size": 8, "max_model_len": 256}
                                             | settings))


def _load(client: TestClient, name: str, path) -> httpx.Response:
    return client.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})


def _poisoned_copy(source, folder, value: float):
    """A copy of an exported adapter with one weight set to ``value`` (NaN, Inf), its
    manifest's file digests updated, so that only the values are wrong."""
    shutil.copytree(source, folder)
    tensors = load_file(folder / ADAPTER_WEIGHTS)
    key = sorted(k for k in tensors if "k_proj.lora_B" in k)[0]
    tensors[key][0, 0] = value
    save_file(tensors, folder / ADAPTER_WEIGHTS, metadata={"format": "pt"})
    data = manifest.read(folder)
    data["files"] = manifest.file_digests(folder)
    manifest.write(data, folder)
    return folder


def test_lora_root_refuses_symlinks_and_dotdot_paths_that_leave_it(base, adapters, tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    shutil.copytree(adapters["lora-b"], root / "inside")
    shutil.copytree(adapters["lora-b"], outside)
    (root / "escape").symlink_to(outside, target_is_directory=True)
    (root / "via-link").symlink_to(root / "inside", target_is_directory=True)  # a link that stays inside
    app = create_app(_engine(base), enable_lora_loading=True, lora_root=root)
    with TestClient(app) as client:
        for path in (root / "escape", f"{root}/../outside", outside):
            r = _load(client, "out", path)
            assert r.status_code == 400 and r.json()["error"]["message"] == REFUSED_PATH, (path, r.text)
        assert _load(client, "in", root / "inside").status_code == 200
        assert _load(client, "linked", root / "via-link").status_code == 200
        assert {c["id"] for c in client.get("/v1/models").json()["data"]} >= {"in", "linked"}
        assert client.get("/v1/models/out").status_code == 404


def test_load_refusals_do_not_reveal_whether_a_path_exists(base, adapters, tmp_path, monkeypatch, caplog):
    root = tmp_path / "root"
    root.mkdir()
    (root / "a-file").write_text("not a folder")
    (root / "not-an-adapter").mkdir()
    (root / "not-an-adapter" / "notes.txt").write_text("hello")
    locked = shutil.copytree(adapters["lora-b"], root / "locked")
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if str(p).startswith(str(locked))
                        else real_access(p, mode, **kw))  # tests run as root: access is always granted
    shutil.copytree(adapters["lora-b"], tmp_path / "outside")
    cases = {"missing": root / "no-such", "not a folder": root / "a-file", "not an adapter": root / "not-an-adapter",
             "outside the root": tmp_path / "outside", "permission denied": locked}
    app = create_app(_engine(base), enable_lora_loading=True, lora_root=root)
    with TestClient(app) as client, caplog.at_level(logging.WARNING, logger="kvshare.serve.http.lora_scope"):
        replies = {why: _load(client, "x", path) for why, path in cases.items()}
    assert {r.status_code for r in replies.values()} == {400}
    assert {json.dumps(r.json()) for r in replies.values()} == {json.dumps(replies["missing"].json())}
    assert replies["missing"].json()["error"]["message"] == REFUSED_PATH
    logged = caplog.text  # the real reasons, for the operator
    reasons = ("does not exist", "is not a folder", "no kvshare.json", "outside the LoRA root", "permission denied")
    for reason in reasons:
        assert reason in logged, reason


def test_startup_adapters_cannot_be_unloaded_or_replaced_without_the_flag(base, adapters):
    app = create_app(_engine(base, [adapters["lora-a"]]), enable_lora_loading=True)
    with TestClient(app) as client:
        for r in (client.post("/v1/unload_lora_adapter", json={"lora_name": "lora-a"}),
                  _load(client, "lora-a", adapters["lora-b"])):
            assert r.status_code == 403 and ALLOW_REPLACE_FLAG in r.json()["error"]["message"], r.text
        assert _load(client, "hot", adapters["lora-b"]).status_code == 200  # runtime ones come and go
        assert client.post("/v1/unload_lora_adapter", json={"lora_name": "hot"}).status_code == 200
        assert client.post("/v1/completions", json={"model": "lora-a", "prompt": "a", "max_tokens": 1}
                           ).status_code == 200
    allowing = create_app(_engine(base, [adapters["lora-a"]]), enable_lora_loading=True,
                          allow_runtime_replace_startup_adapters=True)
    with TestClient(allowing) as client:
        assert client.post("/v1/unload_lora_adapter", json={"lora_name": "lora-a"}).status_code == 200
        assert _load(client, "lora-a", adapters["lora-b"]).status_code == 200  # replaced
        assert client.post("/v1/unload_lora_adapter", json={"lora_name": "lora-a"}).status_code == 200


def test_serve_flags_reach_the_app_and_need_runtime_loading(cli, base, tmp_path, monkeypatch):
    from conftest import assert_one_line_error

    seen = {}
    monkeypatch.setattr("kvshare.serve.http.server.serve", lambda *a, **kw: seen.update(kw))
    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    assert cli("serve", base, "--enable-lora-loading", "--lora-root", tmp_path,
               ALLOW_REPLACE_FLAG).code == 0
    assert seen["lora_root"] == str(tmp_path) and seen["allow_runtime_replace_startup_adapters"] is True
    assert_one_line_error(cli("serve", base, "--lora-root", tmp_path), "--lora-root", "--enable-lora-loading")
    assert_one_line_error(cli("serve", base, ALLOW_REPLACE_FLAG), ALLOW_REPLACE_FLAG, "--enable-lora-loading")
    assert_one_line_error(cli("serve", base, "--enable-lora-loading", "--lora-root", tmp_path / "no"), "no such folder")


@pytest.mark.parametrize("layout,value", [("exact", float("nan")), ("forkkv", float("nan")),
                                          ("full_reuse", float("nan")), ("forkkv", float("inf"))])
def test_non_finite_adapters_are_refused_in_every_layout_and_change_nothing(base, adapters, tokenizer, tmp_path,
                                                                             layout, value):
    """A NaN adapter in a shared layout would write NaN into the KV other adapters read (a
    healthy ForkKV adapter then emitted token 0 forever): refused at start-up and at runtime."""
    bad = _poisoned_copy(adapters["lora-a"], tmp_path / "bad", value)
    settings = {"kv_cache_tokens": 2048, "block_size": 4, "kv_layout": layout}
    with pytest.raises(KvshareError, match="not finite"):
        LLM(base, [bad], **settings)
    llm = LLM(base, [adapters["lora-b"]], **settings)
    prompt = prompts_for(tokenizer, 1)[0]
    before = llm.generate([prompt], GREEDY, adapter="lora-b")[0].token_ids
    with pytest.raises(KvshareError, match="not finite"):
        llm.engine.load_adapter(bad, "bad")
    assert [a.name for a in llm.engine.adapters()] == ["lora-b"]
    assert llm.generate([prompt], GREEDY, adapter="lora-b")[0].token_ids == before


def test_a_non_finite_adapter_is_refused_over_http_with_a_clear_error(base, adapters, tmp_path):
    bad = _poisoned_copy(adapters["lora-a"], tmp_path / "bad", float("nan"))
    app = create_app(_engine(base, kv_layout="forkkv"), enable_lora_loading=True)
    with TestClient(app) as client:
        r = _load(client, "bad", bad)
        assert r.status_code == 400 and "not finite" in r.json()["error"]["message"], r.text
        assert client.get("/v1/models/bad").status_code == 404


def test_the_base_is_fingerprinted_once_for_every_load(tiny_llama, adapters, monkeypatch):
    """A read-only model folder (the cache file cannot be written) was hashed again, twice, for
    every adapter loaded."""
    import kvshare.fingerprint as fp

    (tiny_llama / fp.CACHE_FILE).unlink(missing_ok=True)
    monkeypatch.setattr(fp, "write_text_atomic", lambda *a, **kw: (_ for _ in ()).throw(OSError("read-only")))
    calls = []
    real = fp.compute_fingerprints
    monkeypatch.setattr(fp, "compute_fingerprints", lambda model_dir: (calls.append(model_dir), real(model_dir))[1])
    engine = _engine(tiny_llama, [adapters["lora-a"]])
    for name in ("lora-b", "icarus-a", "alora-a"):
        engine.load_adapter(adapters[name])
    assert len(engine.adapters()) == 4 and len(calls) == 1


def test_a_slow_load_does_not_stall_the_engine(base, adapters, monkeypatch):
    """The adapter's file is read on the load worker: requests in flight keep decoding."""
    import kvshare.serve.exec.adapters as serve_adapters

    engine = _engine(base, [adapters["lora-a"]])
    real_read, seen = serve_adapters.read_tensor_file, []

    def slow_read(path):
        before = engine.counters["generated_tokens"]
        time.sleep(0.6)
        seen.append((threading.current_thread().name, engine.counters["generated_tokens"] - before))
        return real_read(path)

    real_run = engine.runner.run
    monkeypatch.setattr(engine.runner, "run", lambda *a: (time.sleep(0.01), real_run(*a))[1])  # keep it in flight
    monkeypatch.setattr(serve_adapters, "read_tensor_file", slow_read)
    with running_server(engine, enable_lora_loading=True) as srv:
        with httpx.stream("POST", srv["url"] + "/v1/completions", headers=AUTH, timeout=60,
                          json={"model": "lora-a", "prompt": "Rome is", "max_tokens": 200, "ignore_eos": True,
                                "stream": True}) as streaming:
            lines = streaming.iter_lines()  # held: a dropped iterator closes the stream
            next(lines)
            r = _post(srv, "/v1/load_lora_adapter", {"lora_name": "hot", "lora_path": str(adapters["lora-b"])})
            assert r.status_code == 200, r.text
    (thread, progressed), = seen
    assert thread != "kvshare-engine" and progressed > 0
