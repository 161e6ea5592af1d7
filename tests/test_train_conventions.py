"""Training conventions of transformers/TRL users: gradient checkpointing, experiment
trackers (tensorboard, trackio), evaluation every N steps through the engine, and a
multi-node launch (two "nodes" on 127.0.0.1)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kvshare.loopback import free_port
from kvshare.paths import data_dir
from kvshare.train import trainer as trainer_module
from kvshare.train.recipe import load_recipe
from kvshare.train.trainer import train

from conftest import assert_one_line_error
from test_trainer import ROOT, toy_data, toy_recipe  # noqa: F401


def _count_attention_calls(monkeypatch) -> list[int]:
    """Count the first decoder layer's attention calls in the model ``train`` builds."""
    calls = [0]
    original = trainer_module.build_model

    def build_and_watch(recipe, base_dir):
        model, tokenizer, invocation = original(recipe, base_dir)
        layer = model.get_base_model().model.layers[0].self_attn
        layer.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
        return model, tokenizer, invocation

    monkeypatch.setattr(trainer_module, "build_model", build_and_watch)
    return calls


@pytest.mark.parametrize("kind", ["icarus", "lora"])
def test_gradient_checkpointing_recomputes_and_trains_the_same_weights(tmp_path, tiny_models, toy_data,
                                                                        kind, monkeypatch):
    """Same weights with and without (dropout on: the recompute replays the RNG); the layer
    really runs again in the backward pass; ICaRus's gradient-free base pass keeps its cache."""
    weights, calls = {}, {}
    for checkpointing in (False, True):
        folder = tmp_path / str(checkpointing)
        folder.mkdir()
        path = toy_recipe(folder, tiny_models("llama"), toy_data, kind, max_steps=3, grad_accum=1,
                          gradient_checkpointing=checkpointing)
        counter = _count_attention_calls(monkeypatch)
        summary = train(load_recipe(path))
        assert summary["finished"]
        calls[checkpointing] = counter[0]
        weights[checkpointing] = load_file(folder / f"run-{kind}" / "adapter" / "adapter_model.safetensors")
    assert calls[True] == calls[False] + 3  # one recompute per step (ICaRus: + its base pass, both runs)
    for name, value in weights[False].items():
        torch.testing.assert_close(weights[True][name], value, rtol=1e-5, atol=1e-6)


def test_trackers_receive_what_metrics_jsonl_holds(tmp_path, tiny_models, toy_data):
    """tensorboard and trackio (offline, TRACKIO_DIR) get every logged loss; run as a process
    because trackio reads its folder once at import."""
    path = toy_recipe(tmp_path, tiny_models("llama"), toy_data, "lora", max_steps=4, log_every=2,
                      report_to=["tensorboard", "trackio"])
    env = dict(os.environ, TRACKIO_DIR=str(tmp_path / "trackio"), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "kvshare.train", str(path)], capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "run-lora"
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    expected = [(r["step"], r["loss"]) for r in logged]
    assert [s for s, _ in expected] == [2, 4]

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "logs" / "toy-lora"))
    events.Reload()
    board = [(e.step, e.value) for e in events.Scalars("loss")]
    assert [s for s, _ in board] == [2, 4]
    assert [v for _, v in board] == pytest.approx([v for _, v in expected], rel=1e-6)

    reader = ("import json, sys; from trackio.sqlite_storage import SQLiteStorage as S; "
              "runs = S.get_runs('toy-lora'); print(json.dumps(S.get_logs('toy-lora', runs[-1])))")
    out = subprocess.run([sys.executable, "-c", reader], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    tracked = [(r["step"], r["loss"]) for r in json.loads(out.stdout.strip().splitlines()[-1]) if "loss" in r]
    assert [s for s, _ in tracked] == [2, 4]
    assert [v for _, v in tracked] == pytest.approx([v for _, v in expected], rel=1e-6)


@pytest.mark.skipif(data_dir() is None, reason="needs the local SQuAD copy (../shared/data)")
def test_eval_every_scores_the_adapter_as_kvshare_eval_would(tmp_path, toy_data):
    from kvshare.testing import make_tiny_model

    base = make_tiny_model(tmp_path / "long-context", max_position_embeddings=4096)  # SQuAD paragraphs fit
    path = toy_recipe(tmp_path, base, toy_data, "icarus", max_steps=4, log_every=2, eval_every=2,
                      eval_task="f1-squad", eval_limit=3, eval_max_tokens=4)
    summary = train(load_recipe(path))
    run = tmp_path / "run-icarus"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "eval" in r]
    assert [r["step"] for r in evals] == [2, 4]
    assert all(r["eval"]["task"] == "f1-squad" and r["eval"]["n"] == 3 for r in evals)
    assert summary["last_eval"] == evals[-1]
    # the same score as `kvshare eval f1` on the adapter the step exported
    from kvshare.eval.qa import evaluate_f1

    again = evaluate_f1(str(base), str(run / "eval" / "step-4" / "adapter"), tmp_path / "again",
                        dataset="squad", limit=3, max_tokens=4)
    assert evals[-1]["eval"]["f1"] == pytest.approx(again["f1"]["mean"])
    assert evals[-1]["eval"]["exact_match"] == pytest.approx(again["exact_match"]["mean"])
    # evaluating draws no random numbers from the run: the same weights as without it (dropout on)
    plain_dir = tmp_path / "plain"
    plain_dir.mkdir()
    train(load_recipe(toy_recipe(plain_dir, base, toy_data, "icarus", max_steps=4, log_every=2)))
    with_eval = load_file(run / "adapter" / "adapter_model.safetensors")
    without = load_file(plain_dir / "run-icarus" / "adapter" / "adapter_model.safetensors")
    assert all(torch.equal(with_eval[k], without[k]) for k in without)


def test_bad_convention_keys_are_one_line_errors(tmp_path, tiny_models, toy_data, cli):
    base = tiny_models("llama")
    cases = [({"eval_every": 2}, "eval_every and eval_task go together"),
             ({"eval_every": 2, "eval_task": "mmlu"}, "unknown eval_task"),
             ({"report_to": ["wandb"]}, "report_to"),
             ({"gradient_checkpointing": "sometimes"}, "gradient_checkpointing")]
    for over, fragment in cases:
        path = toy_recipe(tmp_path, base, toy_data, "lora", **over)
        assert_one_line_error(cli("train", path), fragment)


def test_two_nodes_on_loopback_train_in_sync(tmp_path, tiny_models, toy_data):
    """The multi-node template, as two machines (ranks 0 and 1) meeting at rank 0's store on loopback."""
    path = toy_recipe(tmp_path, tiny_models("llama"), toy_data, "icarus", max_steps=4, batch_size=2)
    config = ROOT / "recipes" / "accelerate" / "cpu-multi-node.yaml"
    accelerate = Path(sys.executable).with_name("accelerate")
    # gloo on the loopback device, not on whatever address the hostname resolves to
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    port = str(free_port())
    # output to files, not pipes: reading one node's pipes while the other's fill up would
    # block that node in a write, and its peer in the next collective (a hang seen in CI)
    logs = [open(tmp_path / f"node{rank}.log", "w") for rank in (0, 1)]
    nodes = [subprocess.Popen([str(accelerate), "launch", "--config_file", str(config), "--machine_rank", str(rank),
                               "--main_process_ip", "127.0.0.1", "--main_process_port", port,
                               "-m", "kvshare.train", str(path)],
                              stdout=log, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
             for rank, log in zip((0, 1), logs)]
    try:
        for node in nodes:
            node.wait(timeout=300)
    except subprocess.TimeoutExpired:
        pytest.fail("the two nodes did not finish in 300 s; their logs:\n" + "\n".join(
            f"--- node {rank}\n" + (tmp_path / f"node{rank}.log").read_text()[-3000:] for rank in (0, 1)))
    finally:
        for node, log in zip(nodes, logs):
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)  # the launcher and the training process it started
            log.close()
    for rank, node in enumerate(nodes):
        assert node.returncode == 0, (tmp_path / f"node{rank}.log").read_text()[-3000:]
    summary = json.loads((tmp_path / "run-icarus" / "summary.json").read_text())
    assert summary["processes"] == 2 and summary["ranks_in_sync"] is True
