"""Resumable training state without pickle: tensors in safetensors, the rest in JSON.

A checkpoint holds the LoRA weights, the optimizer's moments, the scheduler, every rank's
RNG state and the data position, so a resumed run reaches the same weights as one that was
never interrupted. Folders are written under a temporary name and renamed when complete; a
run killed mid-save leaves only the previous, complete checkpoints.
"""

from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..errors import KvshareError
from ..fsutil import fsync_files, replace_dir

_STEP_DIR = re.compile(r"^step-(\d+)$")


def lora_state(model) -> dict[str, torch.Tensor]:
    """The trainable (LoRA) parameters by name, detached and contiguous."""
    return {n: p.detach().contiguous().clone() for n, p in model.named_parameters() if p.requires_grad}


def save_rng(path: Path) -> None:
    state = {"torch": torch.get_rng_state()}
    save_file(state, str(path))
    py = random.getstate()
    path.with_suffix(".json").write_text(json.dumps([py[0], list(py[1]), py[2]]))


def load_rng(path: Path) -> None:
    torch.set_rng_state(load_file(str(path))["torch"])
    version, inner, gauss = json.loads(path.with_suffix(".json").read_text())
    random.setstate((version, tuple(inner), gauss))


def save_optimizer(optimizer: torch.optim.Optimizer, folder: Path) -> None:
    state = optimizer.state_dict()
    tensors = {}
    scalars = {}
    for index, entry in state["state"].items():
        for key, value in entry.items():
            if torch.is_tensor(value):
                tensors[f"{index}.{key}"] = value.contiguous()
            else:
                scalars[f"{index}.{key}"] = value
    save_file(tensors, str(folder / "optimizer.safetensors"))
    (folder / "optimizer.json").write_text(json.dumps(
        {"param_groups": state["param_groups"], "scalars": scalars}, indent=1))


def load_optimizer(optimizer: torch.optim.Optimizer, folder: Path) -> None:
    tensors = load_file(str(folder / "optimizer.safetensors"))
    meta = json.loads((folder / "optimizer.json").read_text())
    state: dict[int, dict] = {}
    for key, value in list(tensors.items()) + list(meta["scalars"].items()):
        index, name = key.split(".", 1)
        state.setdefault(int(index), {})[name] = value
    optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})


def save_checkpoint(folder: Path, *, model, optimizer, scheduler, trainer_state: dict,
                    rng_files: dict[int, Path]) -> Path:
    """Write a complete checkpoint at ``folder`` (atomically). Main process only."""
    staging = folder.with_name(f".{folder.name}.tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    save_file(lora_state(model), str(staging / "lora.safetensors"))
    save_optimizer(optimizer, staging)
    (staging / "scheduler.json").write_text(json.dumps(scheduler.state_dict(), default=_jsonable))
    for rank, src in rng_files.items():
        shutil.copyfile(src, staging / f"rng-{rank}.safetensors")
        shutil.copyfile(src.with_suffix(".json"), staging / f"rng-{rank}.json")
    (staging / "trainer_state.json").write_text(json.dumps(trainer_state, indent=1))
    fsync_files(staging)
    replace_dir(staging, folder)
    return folder


def latest_checkpoint(run_dir: Path) -> Path | None:
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return None
    steps = [(int(m[1]), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and
             (p / "trainer_state.json").is_file()]
    return max(steps)[1] if steps else None


def load_checkpoint(folder: Path, *, model, optimizer, scheduler, rank: int) -> dict:
    """Restore weights, optimizer, scheduler and this rank's RNG; return the trainer state."""
    try:
        weights = load_file(str(folder / "lora.safetensors"))
        params = dict(model.named_parameters())
        missing = set(params_requiring_grad(model)) - set(weights)
        if missing:
            raise KvshareError(f"{folder}: checkpoint lacks {sorted(missing)[0]} (another recipe?)")
        with torch.no_grad():
            for name, value in weights.items():
                if name not in params or params[name].shape != value.shape:
                    raise KvshareError(f"{folder}: tensor {name} does not fit this model (another recipe?)")
                params[name].copy_(value)
        load_optimizer(optimizer, folder)
        scheduler.load_state_dict(json.loads((folder / "scheduler.json").read_text()))
        load_rng(folder / f"rng-{rank}.safetensors")
        return json.loads((folder / "trainer_state.json").read_text())
    except (OSError, ValueError, KeyError) as err:
        raise KvshareError(f"{folder}: cannot resume from this checkpoint ({err})") from None


def params_requiring_grad(model) -> list[str]:
    return [n for n, p in model.named_parameters() if p.requires_grad]


def _jsonable(value):
    if torch.is_tensor(value):
        return value.tolist()
    return str(value)
