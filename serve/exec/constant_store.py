"""The compiled step's packed constants on disk: once per content, not once per graph.

Why our own code: Inductor's FX graph cache pickles each graph's constants into that graph's
entry, and for our graphs those are the GEMM template's packed copies of the projections, equal
in every bucket (:mod:`.shared_constants`): about 400 MB per SmolLM2 float32 graph, ten graphs
for half a gigabyte of weights. An entry of our graphs (keyed by :class:`.graph_cache.WeightsKey`)
names each large constant by a digest of its bytes instead, and the bytes lie once in a
safetensors file under the cache (``kvshare-constants/<digest>.safetensors``). A graph loaded
from the cache reads the file; graphs loaded in one process get the same tensor.
"""

from __future__ import annotations

import os
import threading
import weakref
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ...errors import KvshareError
from . import shared_constants
from .graph_cache import weights_digest

_loaded: weakref.WeakValueDictionary[str, torch.Tensor] = weakref.WeakValueDictionary()
_lock = threading.Lock()


def store_folder() -> Path:
    """Beside Inductor's own entries (``TORCHINDUCTOR_CACHE_DIR``, which the compiled step sets)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir()) / "kvshare-constants"


def storable(value: object) -> bool:
    """A constant worth keeping apart: a large plain CPU tensor laid out densely."""
    return (shared_constants.shareable(value) and value.device.type == "cpu" and value.is_contiguous()
            and value.storage_offset() == 0)


class StoredConstant:
    """What an entry holds in a constant's place: its digest, unpickled as the tensor itself."""

    def __init__(self, digest: str):
        self.digest = digest

    def __reduce__(self):
        return load_constant, (self.digest,)


def store_constant(t: torch.Tensor) -> StoredConstant:
    """Write ``t`` to the store unless its bytes are there already (whole files only: written
    aside, then renamed)."""
    digest = weights_digest([("constant", t)])
    path = store_folder() / f"{digest}.safetensors"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        part = path.with_name(f".{digest}.{os.getpid()}.{threading.get_ident()}.part")
        save_file({"constant": t}, str(part))
        os.replace(part, path)
    return StoredConstant(digest)


def load_constant(digest: str) -> torch.Tensor:
    """The stored constant (one tensor per digest in a process, while any graph holds it)."""
    with _lock:
        kept = _loaded.get(digest)
        if kept is None:
            path = store_folder() / f"{digest}.safetensors"
            if not path.is_file():  # (Inductor then counts the entry a miss and compiles again)
                raise KvshareError(f"a compiled graph's constant is missing from {path.parent}")
            kept = load_file(str(path))["constant"]
            _loaded[digest] = kept
        return kept


def stored_entry_constants(constants: dict) -> dict:
    """An entry's constants, each large one replaced by its :class:`StoredConstant`."""
    return {name: store_constant(v) if storable(v) else v for name, v in constants.items()}
