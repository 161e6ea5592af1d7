"""User mistakes on the command line are one ``kvshare: error:`` line, before any work: numbers
a command cannot take, devices that do not exist, paths that are not there, a port in use,
files that are not text (from a read-only review of every subcommand, session 28)."""

from __future__ import annotations

import socket

import pytest

from conftest import assert_one_line_error
from test_engine import base  # noqa: F401


@pytest.mark.parametrize("argv,fragment", [
    (["bench", "kernels", "--threads", "0"], "--threads must be at least 1"),
    (["bench", "kernels", "--device", "gpu"], "device must be cpu or cuda"),
    (["bench", "engine", "--device", "gpu"], "device must be cpu or cuda"),
    (["bench", "engine", "--threads", "0"], "--threads must be at least 1"),
    (["bench", "alora", "--evaluators", "0"], "--evaluators must be at least 1"),
    (["bench", "forkkv", "--agents", "2", "0"], "--agents must be at least 1"),
    (["bench", "forkkv", "--qps", "0"], "--qps must be > 0"),
    (["bench", "forkkv", "--workflow-kv-contexts", "0"], "--workflow-kv-contexts must be > 0"),
    (["bench", "forkkv-quality", "--adapters", "a", "--batch", "0"], "--batch must be at least 1"),
    (["bench", "forkkv-quality", "--adapters", "a", "--limit", "0"], "--limit must be at least 1"),
    (["bench", "workflow", "--kv-cache-tokens", "0"], "--kv-cache-tokens must be at least 1"),
    (["eval", "gsm8k", "--out", "o", "--shots", "-1"], "--shots must be at least 0"),
    (["eval", "f1", "--out", "o", "--device", "gpu"], "device must be cpu or cuda"),
    (["eval", "suite", "--out", "o", "--spec", "suite.yaml", "--device", "cuda"], "from --spec, not --device"),
    (["eval", "gsm8k", "--out", "o", "--adapter", "no/such/adapter"], "no/such/adapter: no such adapter folder"),
    (["eval", "suite", "--out", "o", "--spec", "suite.yaml", "--limit", "3"], "from --spec, not --limit"),
    (["eval", "suite", "--out", "o", "--spec", "suite.yaml", "--max-tokens", "64"], "from --spec, not --max-tokens"),
    (["eval", "suite", "--out", "o", "--spec", "suite.yaml", "--dtype", "bfloat16"], "from --spec, not --dtype"),
    (["eval", "suite", "--out", "o", "--spec", "suite.yaml", "--shots", "5"], "from --spec, not --shots"),
])
def test_numbers_devices_and_paths_a_command_cannot_take(cli, argv, fragment, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # nothing written, but "o" would land here
    assert_one_line_error(cli(*argv), fragment)
    assert not (tmp_path / "o").exists()


def test_a_recipe_that_is_not_text_and_a_stop_after_of_nothing(cli, tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_bytes(b"\xff\xfe\x00name: x\n")
    assert_one_line_error(cli("train", recipe), "not UTF-8 text")
    assert_one_line_error(cli("train", recipe, "--stop-after", "0"), "--stop-after must be at least 1")


def test_a_port_in_use_is_refused_before_the_model_loads(cli, base, monkeypatch):
    import uvicorn

    from kvshare.serve.engine import llm_engine as engine

    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: pytest.fail("served on a port in use"))
    monkeypatch.setattr(engine.LLMEngine, "__init__", lambda *a, **k: pytest.fail("loaded the model first"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert_one_line_error(cli("serve", base, "--port", port), f"cannot listen on 127.0.0.1:{port}")


def test_a_model_without_a_chat_template_is_a_clear_error(base):
    from kvshare.errors import KvshareError
    from kvshare.serve import LLM

    llm = LLM(base, kv_cache_tokens=256)
    llm.engine.tokenizer.chat_template = None
    with pytest.raises(KvshareError, match="has no chat template"):
        llm.engine.chat_prompt([{"role": "user", "content": "hi"}])
