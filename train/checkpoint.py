"""Resumable training state without pickle: tensors in safetensors, the rest in JSON.

A checkpoint holds the LoRA weights, the optimizer's moments, the scheduler, every rank's
RNG state, the data position and the resolved recipe, so a resumed run reaches the same
weights as one that was never interrupted. Folders are written under a temporary name and
renamed when complete, and ``checkpoint.json`` (written last) lists every file's size and
SHA-256: a checkpoint that fails that check (cut short, damaged, a file missing) is skipped in
favour of the previous one, while one that does not fit the model is an error.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ..errors import KvshareError
from ..fsutil import fsync_files, replace_dir
from .rng import read_rng, set_rng_state

FORMAT = 1
MANIFEST = "checkpoint.json"
_READ_ERRORS = (OSError, ValueError, KeyError, TypeError, SafetensorError)


def lora_state(model) -> dict[str, torch.Tensor]:
    """The trainable (LoRA) parameters by name, as contiguous CPU copies."""
    return {n: p.detach().to("cpu", copy=True).contiguous()
            for n, p in model.named_parameters() if p.requires_grad}


def params_requiring_grad(model) -> list[str]:
    return [n for n, p in model.named_parameters() if p.requires_grad]


def save_optimizer(optimizer: torch.optim.Optimizer, folder: Path) -> None:
    state = optimizer.state_dict()
    tensors, scalars = {}, {}
    for index, entry in state["state"].items():
        for key, value in entry.items():
            if torch.is_tensor(value):
                tensors[f"{index}.{key}"] = value.detach().to("cpu").contiguous()
            else:
                scalars[f"{index}.{key}"] = value
    save_file(tensors, str(folder / "optimizer.safetensors"))
    (folder / "optimizer.json").write_text(json.dumps(
        {"param_groups": state["param_groups"], "scalars": scalars}, indent=1))


def read_optimizer(folder: Path) -> dict:
    """The optimizer state dict stored in ``folder`` (tensors on the CPU)."""
    tensors = load_file(str(folder / "optimizer.safetensors"))
    meta = json.loads((folder / "optimizer.json").read_text())
    state: dict[int, dict] = {}
    for key, value in list(tensors.items()) + list(meta["scalars"].items()):
        index, name = key.split(".", 1)
        state.setdefault(int(index), {})[name] = value
    return {"state": state, "param_groups": meta["param_groups"]}


def save_checkpoint(folder: Path, *, model, optimizer, scheduler, trainer_state: dict,
                    rng_files: dict[int, Path], recipe: dict) -> Path:
    """Write a complete checkpoint at ``folder`` (atomically). Main process only.

    A save that fails (a full disk, Ctrl-C) removes its staging folder, so it leaves nothing
    but the checkpoints written before it.
    """
    staging = folder.with_name(f".{folder.name}.tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        _write_checkpoint(staging, model=model, optimizer=optimizer, scheduler=scheduler,
                          trainer_state=trainer_state, rng_files=rng_files, recipe=recipe)
        replace_dir(staging, folder)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return folder


def _write_checkpoint(staging: Path, *, model, optimizer, scheduler, trainer_state: dict,
                      rng_files: dict[int, Path], recipe: dict) -> None:
    """Every file of a checkpoint into ``staging``, the manifest last, all synced to disk."""
    save_file(lora_state(model), str(staging / "lora.safetensors"))
    save_optimizer(optimizer, staging)
    (staging / "scheduler.json").write_text(json.dumps(scheduler.state_dict(), default=_jsonable))
    for rank, src in rng_files.items():
        shutil.copyfile(src, staging / f"rng-{rank}.safetensors")
        shutil.copyfile(src.with_suffix(".json"), staging / f"rng-{rank}.json")
    (staging / "trainer_state.json").write_text(json.dumps(trainer_state, indent=1))
    (staging / "recipe.json").write_text(json.dumps(recipe, indent=1, sort_keys=True))
    files = {p.name: {"bytes": p.stat().st_size, "sha256": _sha256(p)}
             for p in sorted(staging.iterdir())}
    (staging / MANIFEST).write_text(json.dumps(
        {"format": FORMAT, "processes": len(rng_files), "files": files}, indent=1))
    fsync_files(staging)


def checkpoints(run_dir: Path) -> list[Path]:
    """The run's ``step-N`` folders, newest first (complete or not)."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    steps = [(int(p.name[5:]), p) for p in root.iterdir()
             if p.is_dir() and p.name.startswith("step-") and p.name[5:].isdigit()]
    return [p for _, p in sorted(steps, reverse=True)]


def verify(folder: Path) -> str | None:
    """Why ``folder`` is not a complete, intact checkpoint, or None when it is."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except FileNotFoundError:
        return f"no {MANIFEST} (cut short while being written, or from an older kvshare)"
    except _READ_ERRORS as err:
        return f"unreadable {MANIFEST} ({err})"
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else None
        return f"format {found!r}, this kvshare reads {FORMAT}"
    files = _listed_files(manifest)
    if files is None:
        return f"damaged {MANIFEST} (not the process count and each file's size and checksum)"
    unlisted = [name for name in _needed_files(manifest["processes"]) if name not in files]
    if unlisted:
        return f"{MANIFEST} does not list {unlisted[0]}"
    for name, expected in files.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != expected["bytes"]:
            return f"{name} has {path.stat().st_size} bytes, {expected['bytes']} were written"
        if _sha256(path) != expected["sha256"]:
            return f"{name} is damaged (checksum differs)"
    return None


def _listed_files(manifest: dict) -> dict[str, dict] | None:
    """The manifest's ``{name: {bytes, sha256}}``, or None when it is not of that shape (so a
    damaged manifest skips its checkpoint rather than failing the resume)."""
    files, processes = manifest.get("files"), manifest.get("processes")
    if not isinstance(files, dict) or not files or type(processes) is not int or processes < 1:
        return None
    if not all(isinstance(e, dict) and type(e.get("bytes")) is int and isinstance(e.get("sha256"), str)
               for e in files.values()):
        return None
    return files


def _needed_files(processes: int) -> list[str]:
    """The files :func:`load_checkpoint` reads, each of which the manifest must vouch for."""
    rng = [f"rng-{rank}{ext}" for rank in range(processes) for ext in (".safetensors", ".json")]
    return ["lora.safetensors", "optimizer.safetensors", "optimizer.json", "scheduler.json",
            "trainer_state.json", "recipe.json", *rng]


def pick_checkpoint(run_dir: Path) -> tuple[Path, list[tuple[Path, str]]]:
    """The newest intact checkpoint and the newer broken ones skipped (with the reason)."""
    skipped = []
    for folder in checkpoints(run_dir):
        reason = verify(folder)
        if reason is None:
            return folder, skipped
        skipped.append((folder, reason))
    if not skipped:
        raise KvshareError(f"--resume: no checkpoint in {Path(run_dir) / 'checkpoints'}")
    raise KvshareError("--resume: no intact checkpoint in " f"{Path(run_dir) / 'checkpoints'}: "
                       + "; ".join(f"{f.name}: {why}" for f, why in skipped))


def saved_recipe(folder: Path) -> dict:
    return json.loads((folder / "recipe.json").read_text())


def load_checkpoint(folder: Path, *, model, optimizer, scheduler, rank: int, processes: int) -> dict:
    """Restore weights, optimizer, scheduler and this rank's RNG; return the trainer state.

    Everything is read and checked against the model first, so a checkpoint that does not fit
    changes nothing.
    """
    try:
        written_by = json.loads((folder / MANIFEST).read_text())["processes"]
        if written_by != processes:
            raise KvshareError(f"{folder} was written by {written_by} processes, this run has "
                               f"{processes}; resume with the same number")
        weights = load_file(str(folder / "lora.safetensors"))
        optim_state = read_optimizer(folder)
        sched_state = json.loads((folder / "scheduler.json").read_text())
        trainer_state = json.loads((folder / "trainer_state.json").read_text())
        rng = read_rng(folder / f"rng-{rank}.safetensors")
    except _READ_ERRORS as err:
        raise KvshareError(f"{folder}: cannot resume from this checkpoint ({err})") from None
    _check_fit(folder, model, optimizer, weights, optim_state)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in weights.items():
            params[name].copy_(value)
    optimizer.load_state_dict(optim_state)
    scheduler.load_state_dict(sched_state)
    set_rng_state(*rng)
    return trainer_state


def _check_fit(folder: Path, model, optimizer, weights: dict, optim_state: dict) -> None:
    hint = "(adapter.rank or target_modules differ from the run's?)"
    params = dict(model.named_parameters())
    wanted = set(params_requiring_grad(model))
    if wanted != set(weights):
        odd = sorted(wanted ^ set(weights))[0]
        raise KvshareError(f"{folder}: tensor {odd} is in only one of checkpoint and model {hint}")
    for name, value in weights.items():
        if params[name].shape != value.shape:
            raise KvshareError(f"{folder}: tensor {name} has shape {tuple(value.shape)} in the "
                               f"checkpoint, {tuple(params[name].shape)} in the model {hint}")
    ordered = [p for group in optimizer.param_groups for p in group["params"]]
    groups = [len(g["params"]) for g in optim_state["param_groups"]]
    if groups != [len(g["params"]) for g in optimizer.param_groups]:
        raise KvshareError(f"{folder}: the optimizer state covers other parameters {hint}")
    for index, entry in optim_state["state"].items():
        for key, value in entry.items():
            if index >= len(ordered) or (torch.is_tensor(value) and value.dim() > 0
                                         and value.shape != ordered[index].shape):
                raise KvshareError(f"{folder}: optimizer state {index}.{key} does not fit {hint}")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _jsonable(value):
    if torch.is_tensor(value):
        return value.tolist()
    return str(value)

