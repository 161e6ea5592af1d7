"""Resume safety: broken checkpoints, a changed recipe, a torn log line, the RNG state."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from kvshare.errors import KvshareError
from kvshare.train import rng
from kvshare.train.metrics import read_metrics
from kvshare.train.recipe import load_recipe
from kvshare.train.trainer import train

from conftest import assert_one_line_error
from test_trainer import toy_data, toy_recipe  # noqa: F401 (toy_data: a fixture)

SHORT = {"max_steps": 6, "save_every": 2, "log_every": 1, "batch_size": 2, "grad_accum": 1}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_models, toy_data) -> dict[str, torch.Tensor]:
    """Final adapter weights of a run never interrupted."""
    folder = tmp_path_factory.mktemp("whole")
    path = toy_recipe(folder, tiny_models("llama"), toy_data, "lora", **SHORT)
    train(load_recipe(path), recipe_path=str(path))
    return load_file(str(folder / "run-lora" / "adapter" / "adapter_model.safetensors"))


def interrupted(tmp_path, tiny_models, toy_data, after: int = 4) -> tuple[Path, Path]:
    """A recipe and its run folder, stopped after ``after`` steps (checkpoints every 2)."""
    path = toy_recipe(tmp_path, tiny_models("llama"), toy_data, "lora", **SHORT)
    train(load_recipe(path), recipe_path=str(path), stop_after=after)
    return path, tmp_path / "run-lora"


def weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run / "adapter" / "adapter_model.safetensors"))


def truncate(file: Path) -> None:
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])


def test_broken_latest_checkpoint_falls_back_to_the_previous(tmp_path, tiny_models, toy_data,
                                                             reference, cli):
    path, run = interrupted(tmp_path, tiny_models, toy_data)
    truncate(run / "checkpoints" / "step-4" / "lora.safetensors")
    with pytest.warns(UserWarning, match=r"skipping checkpoint \S+step-4 .*lora.safetensors.*step-2"):
        result = cli("train", path, "--resume")
    assert result.code == 0, result.err
    got = weights(run)
    assert got.keys() == reference.keys() and all(torch.equal(got[k], reference[k]) for k in got)
    steps = [r["step"] for r in read_metrics(run / "metrics.jsonl")]
    assert steps == [1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize("damage", ["truncate", "delete", "manifest", "garbage"])
def test_no_intact_checkpoint_is_one_line_error(tmp_path, tiny_models, toy_data, cli, damage):
    path, run = interrupted(tmp_path, tiny_models, toy_data)
    for folder in (run / "checkpoints").iterdir():
        if damage == "truncate":
            truncate(folder / "optimizer.safetensors")
        elif damage == "delete":
            (folder / "rng-0.safetensors").unlink()
        elif damage == "manifest":  # as if killed before the checkpoint was complete
            (folder / "checkpoint.json").unlink()
        else:
            (folder / "trainer_state.json").write_text("{not json")
    before = {p: p.read_bytes() for p in (run / "checkpoints").rglob("*") if p.is_file()}
    assert_one_line_error(cli("train", path, "--resume"), "no intact checkpoint", "step-4", "step-2")
    after = {p: p.read_bytes() for p in (run / "checkpoints").rglob("*") if p.is_file()}
    assert before == after  # nothing deleted or rewritten


def test_changed_recipe_is_refused_unless_forced(tmp_path, tiny_models, toy_data, cli):
    path, run = interrupted(tmp_path, tiny_models, toy_data)
    refused = cli("train", path, "train.lr=1e-3", "adapter.dropout=0.2", "--resume")
    assert_one_line_error(refused, "train.lr", "adapter.dropout", "--force-resume")
    assert json.loads((run / "summary.json").read_text())["steps"] == 4  # untouched
    harmless = cli("train", path, "train.log_every=3", "--resume", "--stop-after", "5")
    assert harmless.code == 0, harmless.err
    with pytest.warns(UserWarning, match="changed recipe .train.lr"):
        forced = cli("train", path, "train.lr=1e-3", "--force-resume")
    assert forced.code == 0, forced.err
    assert json.loads((run / "summary.json").read_text())["finished"] is True
    assert json.loads((run / "recipe.resolved.json").read_text())["train"]["lr"] == 1e-3
    assert json.loads((run / "checkpoints" / "step-6" / "recipe.json").read_text())["train"]["lr"] == 1e-3


def test_a_forced_resume_trains_with_the_changed_learning_rate(tmp_path, tiny_models, toy_data, cli):
    """The optimizer and schedule come back from the checkpoint with the old rate; the steps
    after a resume forced over train.lr follow the schedule of the new one."""
    from kvshare.train.trainer import make_scheduler

    path, run = interrupted(tmp_path, tiny_models, toy_data)
    with pytest.warns(UserWarning, match="changed recipe .train.lr"):
        assert cli("train", path, "train.lr=1e-3", "--force-resume").code == 0
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1e-3)
    schedule = make_scheduler(optimizer, load_recipe(path, ["train.lr=1e-3"]), 6)
    want = []
    for _ in range(6):
        optimizer.step()
        schedule.step()
        want.append(schedule.get_last_lr()[0])
    logged = {m["step"]: m["lr"] for m in read_metrics(run / "metrics.jsonl") if "lr" in m}
    assert logged[5] == pytest.approx(want[4]) and logged[5] > 0


def test_checkpoint_of_another_adapter_shape_is_one_line_error(tmp_path, tiny_models, toy_data, cli):
    path, _ = interrupted(tmp_path, tiny_models, toy_data)
    assert_one_line_error(cli("train", path, "adapter.rank=8", "--force-resume"),
                          "shape", "adapter.rank")
    assert_one_line_error(cli("train", path, "adapter.target_modules=[q_proj]", "--force-resume"),
                          "only one of checkpoint and model")


def test_torn_metrics_line_is_dropped_on_resume(tmp_path, tiny_models, toy_data, reference, cli):
    path, run = interrupted(tmp_path, tiny_models, toy_data)
    with open(run / "metrics.jsonl", "a") as handle:
        handle.write('{"step": 5, "loss": 1.2')  # killed mid-line
    result = cli("train", path, "--resume")
    assert result.code == 0, result.err
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3, 4, 5, 6]
    got = weights(run)
    assert all(torch.equal(got[k], reference[k]) for k in got)


def test_broken_metrics_line_in_the_middle_is_an_error(tmp_path):
    log = tmp_path / "metrics.jsonl"
    log.write_text('{"step": 1}\n{"step": 2, "lo\n{"step": 3}\n')
    with pytest.raises(KvshareError, match="line 2 is not a JSON record"):
        read_metrics(log)
    log.write_text('{"step": 1}\n{"step": 2}\n{"st')
    assert [r["step"] for r in read_metrics(log)] == [1, 2]


def _draws() -> tuple:
    return torch.rand(3).tolist(), random.random(), np.random.rand()


def test_rng_state_round_trip(tmp_path):
    torch.manual_seed(1), random.seed(1), np.random.seed(1)
    rng.save_rng(tmp_path / "rng.safetensors")
    first = _draws()
    _draws()
    rng.load_rng(tmp_path / "rng.safetensors")
    assert _draws() == first


class _FakeCuda:
    """Stands in for torch.cuda on a CPU machine: the CUDA branch of save and restore runs."""

    def __init__(self, available: bool):
        self.available, self.state, self.restored = available, torch.arange(16, dtype=torch.uint8), None

    def is_available(self) -> bool:
        return self.available

    def get_rng_state(self) -> torch.Tensor:
        return self.state.clone()

    def set_rng_state(self, state: torch.Tensor) -> None:
        self.restored = state.clone()


def test_cuda_rng_state_is_saved_and_restored(tmp_path, monkeypatch):
    saving = _FakeCuda(available=True)
    monkeypatch.setattr(rng.torch, "cuda", saving)
    rng.save_rng(tmp_path / "rng.safetensors")
    assert torch.equal(load_file(str(tmp_path / "rng.safetensors"))["cuda"], saving.state)
    resuming = _FakeCuda(available=True)
    monkeypatch.setattr(rng.torch, "cuda", resuming)
    rng.load_rng(tmp_path / "rng.safetensors")
    assert torch.equal(resuming.restored, saving.state)
    on_cpu = _FakeCuda(available=False)  # a GPU run resumed on a CPU: the CUDA state is unused
    monkeypatch.setattr(rng.torch, "cuda", on_cpu)
    rng.load_rng(tmp_path / "rng.safetensors")
    assert on_cpu.restored is None


def test_stale_staging_folder_is_not_a_checkpoint(tmp_path, tiny_models, toy_data, reference, cli):
    """A run killed mid-save leaves ``.step-N.tmp``; resume ignores it and replaces it."""
    path, run = interrupted(tmp_path, tiny_models, toy_data)
    stale = run / "checkpoints" / ".step-6.tmp"
    shutil.copytree(run / "checkpoints" / "step-4", stale)
    truncate(stale / "lora.safetensors")
    assert cli("train", path, "--resume").code == 0
    assert not stale.exists()
    got = weights(run)
    assert all(torch.equal(got[k], reference[k]) for k in got)


def _save_small(folder: Path, tmp_path: Path) -> Path:
    """A real checkpoint of a 2x2 linear layer: fast, and verified like a trained one."""
    from kvshare.train import checkpoint as ckpt

    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    rng.save_rng(tmp_path / "rank-0.safetensors")
    return ckpt.save_checkpoint(folder, model=model, optimizer=optimizer, scheduler=scheduler,
                                trainer_state={"step": 1}, rng_files={0: tmp_path / "rank-0.safetensors"},
                                recipe={"name": "r"})


def _rewrite_manifest(folder: Path, change) -> None:
    manifest = json.loads((folder / "checkpoint.json").read_text())
    (folder / "checkpoint.json").write_text(json.dumps(change(manifest)))


DAMAGE = {
    "truncated weights": lambda f: truncate(f / "lora.safetensors"),
    "missing file": lambda f: (f / "optimizer.json").unlink(),
    "files not a mapping": lambda f: _rewrite_manifest(f, lambda m: {**m, "files": 5}),
    "entry without a size": lambda f: _rewrite_manifest(
        f, lambda m: {**m, "files": {**m["files"], "lora.safetensors": "7"}}),
    "manifest a list": lambda f: (f / "checkpoint.json").write_text("[1]"),
    "weights unlisted": lambda f: _rewrite_manifest(
        f, lambda m: {**m, "files": {k: v for k, v in m["files"].items() if k != "lora.safetensors"}}),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_newest_checkpoint_is_skipped_for_an_intact_one(tmp_path, damage):
    from kvshare.train import checkpoint as ckpt

    older = _save_small(tmp_path / "checkpoints" / "step-2", tmp_path)
    newest = _save_small(tmp_path / "checkpoints" / "step-4", tmp_path)
    DAMAGE[damage](newest)
    folder, skipped = ckpt.pick_checkpoint(tmp_path)
    assert folder == older and [f for f, _ in skipped] == [newest]
    DAMAGE[damage](older)
    with pytest.raises(KvshareError, match="no intact checkpoint .*step-4: .*step-2: "):
        ckpt.pick_checkpoint(tmp_path)


@pytest.mark.parametrize("fails_in", ["save_optimizer", "replace_dir"])
def test_a_failed_save_leaves_no_temporary_folder(tmp_path, monkeypatch, fails_in):
    from kvshare.train import checkpoint as ckpt

    _save_small(tmp_path / "checkpoints" / "step-2", tmp_path)

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ckpt, fails_in, disk_full)
    with pytest.raises(OSError, match="No space left"):
        _save_small(tmp_path / "checkpoints" / "step-4", tmp_path)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-2"]
    assert ckpt.verify(tmp_path / "checkpoints" / "step-2") is None
