"""End-to-end training on tiny models: every kind, exact resume after a kill, DDP, plots."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kvshare import manifest
from kvshare.train.recipe import load_recipe
from kvshare.train.trainer import train

from conftest import assert_one_line_error

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def toy_data(tmp_path_factory) -> Path:
    rows = [{"q": f"What is {a} plus {b}?", "a": f"{a} plus {b} is {a + b}."}
            for a in range(10) for b in range(8)]
    path = tmp_path_factory.mktemp("toy") / "toy.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def toy_recipe(tmp_path: Path, base: Path, data: Path, kind: str, **train_over) -> Path:
    train_cfg = {"batch_size": 4, "grad_accum": 2, "lr": 5e-3, "max_steps": 12, "log_every": 2,
                 "save_every": 5, "seed": 0}
    train_cfg.update(train_over)
    recipe = {
        "name": f"toy-{kind}", "base_model": str(base),
        "adapter": {"kind": kind, "rank": 4, "alpha": 8, "dropout": 0.1,
                    **({"invocation": "<|invoke|>"} if kind == "alora" else {})},
        "data": {"sources": [{"path": str(data), "prompt_field": "q", "response_field": "a"}],
                 "max_length": 64},
        "train": train_cfg,
        "output_dir": str(tmp_path / f"run-{kind}"),
    }
    path = tmp_path / f"toy-{kind}.yaml"
    path.write_text(json.dumps(recipe))  # JSON is YAML
    return path


@pytest.mark.parametrize("kind", ["icarus", "alora", "lora"])
def test_each_kind_trains_logs_and_exports(tmp_path, tiny_models, toy_data, kind, cli):
    base = tiny_models("llama")
    path = toy_recipe(tmp_path, base, toy_data, kind)
    result = cli("train", path)
    assert result.code == 0, result.err
    run = tmp_path / f"run-{kind}"
    summary = json.loads((run / "summary.json").read_text())
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [2, 4, 6, 8, 10, 12]
    assert metrics[-1]["loss"] < metrics[0]["loss"]
    assert all(m["tokens_per_s"] > 0 and m["lr"] >= 0 for m in metrics)
    data = manifest.read(run / "adapter")
    assert data["kind"] == kind
    assert data["provenance"]["steps"] == 12 and data["provenance"]["seed"] == 0
    assert data["provenance"]["final_loss"] == pytest.approx(summary["final_loss"])
    assert data["provenance"]["recipe"] == str(path)
    assert cli("inspect", run / "adapter", "--base", base).code == 0
    if kind == "icarus":
        assert set(data["lora"]["target_modules"]) == {"q_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def test_a_second_run_into_the_same_folder_needs_resume(tmp_path, tiny_models, toy_data, cli):
    path = toy_recipe(tmp_path, tiny_models("llama"), toy_data, "lora", max_steps=5)
    assert cli("train", path).code == 0
    assert_one_line_error(cli("train", path), "--resume")


def test_a_finished_run_whose_checkpoints_were_deleted_is_not_overwritten(tmp_path, tiny_models, toy_data, cli):
    path = toy_recipe(tmp_path, tiny_models("llama"), toy_data, "lora", max_steps=2, save_every=2)
    assert cli("train", path).code == 0
    run = tmp_path / "run-lora"
    shutil.rmtree(run / "checkpoints")
    metrics = (run / "metrics.jsonl").read_text()
    assert_one_line_error(cli("train", path), "already holds a run")
    assert (run / "metrics.jsonl").read_text() == metrics


def test_a_run_killed_while_exporting_resumes_with_its_final_loss(tmp_path, tiny_models, toy_data, cli):
    """Resumed at its last step (killed after the last checkpoint, while exporting), a run trains
    no more and logs no window: its summary keeps the final loss logged before, not NaN."""
    path = toy_recipe(tmp_path, tiny_models("llama"), toy_data, "lora", max_steps=4, log_every=2, save_every=2)
    assert cli("train", path).code == 0
    run = tmp_path / "run-lora"
    final = json.loads((run / "summary.json").read_text())["final_loss"]
    (run / "summary.json").unlink()
    shutil.rmtree(run / "adapter")
    result = cli("train", path, "--resume")
    assert result.code == 0, result.err
    assert json.loads((run / "summary.json").read_text())["final_loss"] == final


def test_a_run_killed_in_its_first_save_may_start_over(tmp_path, tiny_models, toy_data, cli):
    path = toy_recipe(tmp_path, tiny_models("llama"), toy_data, "lora", max_steps=2, save_every=2)
    staging = tmp_path / "run-lora" / "checkpoints" / ".step-2.tmp"
    staging.mkdir(parents=True)
    (tmp_path / "run-lora" / "metrics.jsonl").write_text('{"step": 1, "loss": 9.0}\n')
    result = cli("train", path)
    assert result.code == 0, result.err
    assert [json.loads(line)["step"] for line in (tmp_path / "run-lora" / "metrics.jsonl").read_text().splitlines()] == [2]


def test_a_base_without_a_pad_token_trains(tmp_path, tiny_llama, toy_data, cli):
    """Llama and Mistral tokenizers have no pad token; padding is masked, so eos pads."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    tokenizer.pad_token = None
    tokenizer.save_pretrained(tiny_llama)
    assert AutoTokenizer.from_pretrained(tiny_llama).pad_token_id is None
    path = toy_recipe(tmp_path, tiny_llama, toy_data, "icarus", max_steps=2, batch_size=4, grad_accum=1)
    result = cli("train", path)
    assert result.code == 0, result.err


def test_a_base_without_a_chat_template_is_one_line_error(tmp_path, tiny_llama, toy_data, cli):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    tokenizer.chat_template = None
    (tiny_llama / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((tiny_llama / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (tiny_llama / "tokenizer_config.json").write_text(json.dumps(config))
    assert not AutoTokenizer.from_pretrained(tiny_llama).chat_template
    path = toy_recipe(tmp_path, tiny_llama, toy_data, "icarus", max_steps=2)
    assert_one_line_error(cli("train", path), "no chat template")


def test_a_base_the_engine_cannot_serve_is_refused_before_training(tmp_path, tiny_llama, toy_data, cli):
    """A base with its sliding window on: the engine would refuse the adapter at serving."""
    config = json.loads((tiny_llama / "config.json").read_text())
    config["sliding_window"] = 16
    (tiny_llama / "config.json").write_text(json.dumps(config))
    path = toy_recipe(tmp_path, tiny_llama, toy_data, "lora", max_steps=2)
    assert_one_line_error(cli("train", path), "sliding window")
    assert not (tmp_path / "run-lora" / "checkpoints").exists()


def test_sharded_training_is_refused_before_it_starts(tmp_path, tiny_models, toy_data, cli, monkeypatch):
    """FSDP (and DeepSpeed): the trainer saves and exports on the main process, which would hold
    only its shard of the adapter; a clear error, not a crash or a partial checkpoint at the
    first save (a read-only review, session 28)."""
    import accelerate
    from accelerate.utils import DistributedType

    class Sharded(accelerate.Accelerator):
        @property
        def distributed_type(self):
            return DistributedType.FSDP

    monkeypatch.setattr(accelerate, "Accelerator", Sharded)
    path = toy_recipe(tmp_path, tiny_models("llama"), toy_data, "lora", max_steps=2)
    assert_one_line_error(cli("train", path), "FSDP is not supported by kvshare train", "gpu-ddp.yaml")
    assert not (tmp_path / "run-lora" / "summary.json").exists()


@pytest.mark.parametrize("targets", [["qproj"], ["q_proj", "qproj"]])
def test_target_modules_the_base_lacks_are_refused_before_training(tmp_path, tiny_models, toy_data, cli, targets):
    path = toy_recipe(tmp_path, tiny_models("llama"), toy_data, "lora", max_steps=2)
    result = cli("train", path, f"adapter.target_modules={json.dumps(targets)}")
    assert_one_line_error(result, "'qproj' not in")
    assert "q_proj" in result.err  # the message lists what the base has
    assert not (tmp_path / "run-lora" / "metrics.jsonl").exists()


@pytest.mark.parametrize("kind,targets,message", [
    ("icarus", ["q_proj", "self_attn.k_proj"], "adapts k_proj, which an icarus adapter may not target"),
    ("lora", ["lm_head"], "names lm_head, which the engine does not serve"),
    ("lora", ["mlp"], "names model.layers.0.mlp, which the engine does not serve"),
    ("lora", ["embed_tokens"], "which the engine does not serve"),
])
def test_targets_export_or_serving_would_refuse_are_refused_before_training(tmp_path, tiny_models, toy_data, cli,
                                                                          kind, targets, message):
    """A path naming ICaRus's k_proj, the head, a whole block: PEFT takes them, and the run
    used to fail at export (or the engine at load) after all its steps."""
    path = toy_recipe(tmp_path, tiny_models("llama", tied=False), toy_data, kind, max_steps=2)
    assert_one_line_error(cli("train", path, f"adapter.target_modules={json.dumps(targets)}"), message)
    assert not (tmp_path / f"run-{kind}" / "metrics.jsonl").exists()


def test_an_evaluation_without_its_data_stops_the_run_before_it_trains(tmp_path, tiny_models, toy_data, cli,
                                                                      monkeypatch):
    monkeypatch.setenv("KVSHARE_DATA", str(tmp_path / "no-data"))
    path = toy_recipe(tmp_path, tiny_models("llama"), toy_data, "lora", max_steps=4, eval_every=2, eval_task="f1-squad")
    assert_one_line_error(cli("train", path), "no local data folder")
    metrics = tmp_path / "run-lora" / "metrics.jsonl"
    assert not metrics.exists() or not metrics.read_text().strip()  # it failed at step 2 before


def test_an_override_that_is_not_yaml_is_one_line_error(tmp_path, tiny_models, toy_data, cli):
    path = toy_recipe(tmp_path, tiny_models("llama"), toy_data, "lora")
    assert_one_line_error(cli("train", path, "adapter.target_modules=[q_proj"), "not valid YAML")


def _final_weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run / "adapter" / "adapter_model.safetensors"))


def test_resume_after_a_kill_reaches_the_same_weights(tmp_path, tiny_models, toy_data):
    """Kill -9 a run mid-way, resume it, compare with a run never interrupted."""
    base = tiny_models("llama")
    over = {"max_steps": 150, "save_every": 10, "log_every": 10}
    (tmp_path / "a").mkdir()
    whole = toy_recipe(tmp_path / "a", base, toy_data, "icarus", **over)
    train(load_recipe(whole), recipe_path=str(whole))

    (tmp_path / "b").mkdir()
    broken = toy_recipe(tmp_path / "b", base, toy_data, "icarus", **over)
    run = tmp_path / "b" / "run-icarus"
    cmd = [sys.executable, "-m", "kvshare.train", str(broken)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while not (run / "checkpoints" / "step-30").is_dir():
        assert proc.poll() is None and time.time() < deadline, "run ended before it could be killed"
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (run / "summary.json").exists()  # really interrupted
    resumed = subprocess.run(cmd + ["--resume"], capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    a, b = _final_weights(tmp_path / "a" / "run-icarus"), _final_weights(run)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(set(steps)) and steps[-1] == 150  # no duplicated log lines


def test_a_run_stopped_in_mid_window_logs_what_an_unbroken_run_logs(tmp_path, tiny_models, toy_data):
    """--stop-after 4 with log_every 3, then --resume: the same loss records and final loss as
    a run never stopped (the open window travels in the checkpoint)."""
    base = tiny_models("llama")
    over = {"max_steps": 6, "log_every": 3, "save_every": 2, "batch_size": 2, "grad_accum": 1}
    runs = {}
    for name, stops in (("whole", [None]), ("stopped", [4, None])):
        (tmp_path / name).mkdir()
        path = toy_recipe(tmp_path / name, base, toy_data, "lora", **over)
        for i, stop in enumerate(stops):
            summary = train(load_recipe(path), recipe_path=str(path), resume=i > 0, stop_after=stop)
        records = [json.loads(line) for line in (tmp_path / name / "run-lora" / "metrics.jsonl").read_text().splitlines()]
        runs[name] = ([(r["step"], r["loss"]) for r in records], summary["final_loss"])
    assert runs["stopped"] == runs["whole"] and [step for step, _ in runs["whole"][0]] == [3, 6]


def test_two_process_ddp_on_cpu_keeps_ranks_identical(tmp_path, tiny_models, toy_data):
    path = toy_recipe(tmp_path, tiny_models("llama"), toy_data, "icarus", max_steps=6, batch_size=2)
    config = ROOT / "recipes" / "accelerate" / "cpu-ddp.yaml"
    accelerate = Path(sys.executable).with_name("accelerate")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([str(accelerate), "launch", "--config_file", str(config),
                           "--main_process_port", "29533", "-m", "kvshare.train", str(path)],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "run-icarus" / "summary.json").read_text())
    assert summary["processes"] == 2
    assert len(summary["rank_weight_digests"]) == 2 and summary["ranks_in_sync"] is True
    assert manifest.read(tmp_path / "run-icarus" / "adapter")["kind"] == "icarus"


def test_plot_overlays_runs(tmp_path, cli):
    for name, losses in (("icarus", [3.0, 2.0, 1.5]), ("lora", [3.0, 1.8, 1.2])):
        run = tmp_path / name
        run.mkdir()
        (run / "metrics.jsonl").write_text("".join(
            json.dumps({"step": 5 * (i + 1), "loss": v}) + "\n" for i, v in enumerate(losses)))
    out = tmp_path / "loss.png"
    result = cli("plot-loss", tmp_path / "icarus", tmp_path / "lora", "--out", out)
    assert result.code == 0, result.err
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert_one_line_error(cli("plot-loss", tmp_path / "nothing", "--out", out), "metrics.jsonl")
    before = out.read_bytes()
    assert_one_line_error(cli("plot-loss", tmp_path / "icarus", "--out", tmp_path / "loss.txt"), "image format")
    assert out.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["icarus", "lora", "loss.png"]
    assert cli("plot-loss", tmp_path / "icarus", "--out", tmp_path / "loss.svg").code == 0


def test_data_shuffle_seed_orders_the_data_apart_from_train_seed(tmp_path, tiny_models, toy_data):
    """data.shuffle_seed (HF's data_seed): another data order, the same initialisation."""
    base = tiny_models("llama")
    losses = {}
    for name, over in (("a", []), ("b", ["data.shuffle_seed=5"]), ("c", ["data.shuffle_seed=0"])):
        (tmp_path / name).mkdir()
        path = toy_recipe(tmp_path / name, base, toy_data, "lora", max_steps=2, log_every=1, seed=0)
        train(load_recipe(path, over), recipe_path=str(path))
        losses[name] = [json.loads(line)["loss"] for line in (tmp_path / name / "run-lora" / "metrics.jsonl").read_text().splitlines()]
    assert losses["a"] == losses["c"] and losses["a"] != losses["b"]  # None = train.seed (0)


def test_grad_accumulation_weighs_every_response_token_alike(tmp_path, tiny_models, toy_data):
    """4 x 2 micro-batches and one batch of 8 take the same examples in a step: with the loss
    summed over the step's tokens (transformers' num_items_in_batch), the same loss and the
    same weights; averaging each micro-batch's mean gave short answers more weight."""
    base = tiny_models("llama")
    runs = {}
    for name, batch, accum in (("accum", 4, 2), ("whole", 8, 1)):
        (tmp_path / name).mkdir()
        path = toy_recipe(tmp_path / name, base, toy_data, "icarus", max_steps=2, log_every=1, batch_size=batch,
                          grad_accum=accum, save_every=100)
        recipe = load_recipe(path, ["adapter.dropout=0"])
        train(recipe, recipe_path=str(path))
        run = tmp_path / name / "run-icarus"
        runs[name] = ([json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()],
                      load_file(str(run / "adapter" / "adapter_model.safetensors")))
    assert runs["accum"][0] == pytest.approx(runs["whole"][0], rel=1e-5)
    for key, value in runs["whole"][1].items():
        torch.testing.assert_close(runs["accum"][1][key], value, rtol=1e-4, atol=1e-6)


def test_a_system_prompt_trained_with_is_served_with(tmp_path, tiny_models, toy_data, cli):
    """data.system_prompt goes into the manifest; the engine puts it before a conversation
    that brings no system message, so serving and evaluation see the layout training saw."""
    from kvshare.serve import LLM
    from kvshare.train.collate import tokenize_example
    from kvshare.train.data import Example

    base = tiny_models("llama")
    path = toy_recipe(tmp_path, base, toy_data, "icarus", max_steps=1)
    result = cli("train", path, "data.system_prompt=You add numbers.")
    assert result.code == 0, result.err
    adapter = tmp_path / "run-icarus" / "adapter"
    assert manifest.read(adapter)["chat"] == {"system_prompt": "You add numbers."}
    engine = LLM(base, [adapter]).engine
    question = "What is 2 plus 3?"
    trained = tokenize_example(Example("x", question, ""), engine.tokenizer, system_prompt="You add numbers.")
    prompt_len = trained.labels.index(next(t for t in trained.labels if t != -100))
    served = engine.chat_prompt([{"role": "user", "content": question}], "toy-icarus")
    assert served == trained.input_ids[:prompt_len]
    own = engine.chat_prompt([{"role": "system", "content": "Be brief."}, {"role": "user", "content": question}],
                             "toy-icarus")
    assert engine.tokenizer.decode(own).count("You add numbers.") == 0  # the conversation's own wins
