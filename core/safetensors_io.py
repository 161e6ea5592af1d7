"""Safe reading of weight files: safetensors only, every failure a clear KvshareError.

Pickle-based checkpoints (``.bin``, ``.pt``, ``.pth``, ``.ckpt``) are refused without being
opened: unpickling a user file can run arbitrary code.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load as safetensors_load
from safetensors.torch import load_file

from .errors import KvshareError

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


@dataclass(frozen=True)
class TensorSpec:
    dtype: str  # safetensors dtype name, e.g. "F32", "BF16"
    shape: tuple[int, ...]


def tensor_specs(path: Path) -> dict[str, TensorSpec]:
    """Names, dtypes and shapes of a safetensors file, read from its header only."""
    path = Path(path)
    if not path.is_file():
        raise KvshareError(f"{path}: no such file")
    try:
        with safe_open(str(path), framework="pt") as handle:
            specs = {}
            for name in handle.keys():
                view = handle.get_slice(name)
                specs[name] = TensorSpec(str(view.get_dtype()), tuple(view.get_shape()))
            return specs
    except (SafetensorError, OSError, ValueError) as err:
        raise KvshareError(f"{path}: not a valid safetensors file ({_one_line(err)})") from None


def load_tensors(path: Path) -> dict[str, torch.Tensor]:
    path = Path(path)
    if not path.is_file():
        raise KvshareError(f"{path}: no such file")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as err:
        raise KvshareError(f"{path}: not a valid safetensors file ({_one_line(err)})") from None


def read_tensor_file(path: Path) -> tuple[bytes, dict[str, torch.Tensor]]:
    """A safetensors file's bytes and its tensors, parsed from those bytes: one read, so what a
    caller hashes (an adapter's digest, the manifest's check) is what it loaded, even if the
    file is replaced meanwhile. For small files (adapters): the bytes are held beside the tensors."""
    path = Path(path)
    if not path.is_file():
        raise KvshareError(f"{path}: no such file")
    try:
        raw = path.read_bytes()
        return raw, safetensors_load(raw)
    except (SafetensorError, OSError, ValueError) as err:
        raise KvshareError(f"{path}: not a valid safetensors file ({_one_line(err)})") from None


def model_weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a Hugging Face model folder (single file or sharded), in
    transformers' order: ``model.safetensors`` where there is one (a folder saved over
    again may keep an older index beside it, or the reverse), else the index's shards.

    Refuses folders that only hold pickle checkpoints, naming the file found.
    """
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if (model_dir / "model.safetensors").is_file():
        return [model_dir / "model.safetensors"]
    if index.is_file():
        data = read_json(index)
        weight_map = data.get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise KvshareError(f"{index}: weight_map must map tensor names to shard file names")
        shards = sorted(set(weight_map.values()))
        if not shards:
            raise KvshareError(f"{index}: weight_map is empty")
        if any(Path(shard).name != shard for shard in shards):  # a shard is a file of this folder
            raise KvshareError(f"{index}: weight_map's shard names may not contain folders ({', '.join(shards)})")
        files = [model_dir / shard for shard in shards]
        for file in files:
            if not file.is_file():
                raise KvshareError(f"{index} names {file.name}, which is missing")
        return files
    refuse_pickles(model_dir, what="model weights")
    raise KvshareError(f"{model_dir}: no model.safetensors found")


def refuse_pickles(folder: Path, what: str) -> None:
    """Raise a clear error if ``folder`` holds only pickle checkpoints for ``what``."""
    pickles = sorted(p.name for p in Path(folder).iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise KvshareError(
            f"{folder}: {what} are only in pickle format ({', '.join(pickles)}); kvshare loads "
            "safetensors only and never unpickles user files - convert them to safetensors first"
        )


def read_json(path: Path) -> dict:
    """Read a JSON object from a file, turning every failure into a one-line KvshareError."""
    path = Path(path)
    if not path.is_file():
        raise KvshareError(f"{path}: no such file")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise KvshareError(f"{path}: malformed JSON ({_one_line(err)})") from None
    if not isinstance(data, dict):
        raise KvshareError(f"{path}: expected a JSON object, found {type(data).__name__}")
    return data


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split())
