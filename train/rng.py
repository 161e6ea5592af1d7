"""Every random number generator a training step draws from, saved and restored per rank.

Dropout and the data order use torch's CPU generator and, on a GPU, the current CUDA
device's; Python's and NumPy's are kept too for code that draws from them. The state is a
dict of CPU tensors (safetensors) plus JSON, never a pickle.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file


def rng_state() -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors, JSON-able rest) describing every generator of this process."""
    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        tensors["cuda"] = torch.cuda.get_rng_state().cpu()  # this process's device
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    tensors["numpy"] = torch.from_numpy(np.asarray(keys, dtype=np.int64))
    py = random.getstate()
    meta = {"python": [py[0], list(py[1]), py[2]],
            "numpy": [kind, int(pos), int(has_gauss), float(cached)]}
    return tensors, meta


def set_rng_state(tensors: dict[str, torch.Tensor], meta: dict) -> None:
    """Restore :func:`rng_state`'s output. A CUDA state is restored only where CUDA is
    available: a run saved on a GPU may go on on a CPU (its dropout then differs)."""
    torch.set_rng_state(tensors["torch"])
    if "cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["cuda"])
    if "numpy" in tensors and "numpy" in meta:
        kind, pos, has_gauss, cached = meta["numpy"]
        keys = tensors["numpy"].numpy().astype(np.uint32)
        np.random.set_state((kind, keys, pos, has_gauss, cached))
    version, inner, gauss = meta["python"]
    random.setstate((version, tuple(inner), gauss))


def save_rng(path: Path) -> None:
    tensors, meta = rng_state()
    save_file(tensors, str(path))
    Path(path).with_suffix(".json").write_text(json.dumps(meta))


def read_rng(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """The state saved at ``path``, checked to hold at least torch's and Python's generators."""
    tensors = load_file(str(path))
    meta = json.loads(Path(path).with_suffix(".json").read_text())
    if "torch" not in tensors or not isinstance(meta, dict) or "python" not in meta:
        raise ValueError(f"{Path(path).name} is not an RNG state")
    return tensors, meta


def load_rng(path: Path) -> None:
    set_rng_state(*read_rng(path))
