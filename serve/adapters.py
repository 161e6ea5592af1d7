"""Resident adapters: loaded from exported folders, checked against the base, in slots.

Each adapter occupies a slot; a batch row names its slot and the gathered-LoRA kernel
applies that slot's A/B. Loading verifies the manifest (schema, files, kind rules) and that
its base fingerprint is the engine's base: an adapter made for another base is refused.

Each loaded adapter gets a *content digest* (weights, config, kind, invocation): the owner
its KV blocks are keyed by. A name can be unloaded and reused for other weights; the digest
cannot, so the prefix cache never serves one adapter's KV to another (the bug class of vLLM
issue 42125 and llama.cpp 26207), while the same adapter loaded again reuses its blocks.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from ..adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from ..errors import KvshareError
from ..export import verify_adapter_dir
from ..safetensors_io import load_tensors, read_json
from ..kinds import AdapterKind, KindSpec, kind_spec, parse_kind

_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


@dataclass
class LoadedAdapter:
    name: str
    kind: AdapterKind
    path: Path
    manifest: dict
    invocation: list[int] | None
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, float]]
    digest: str  # content digest: what its KV blocks are keyed by

    @property
    def spec(self) -> KindSpec:
        return kind_spec(self.kind)


def adapter_digest(path: Path, kind: AdapterKind, invocation: list[int] | None) -> str:
    """sha256 over what changes the adapter's KV and outputs: weight bytes, LoRA config,
    kind and invocation ids (not its name or provenance)."""
    h = hashlib.sha256(f"kvshare-adapter:{kind.value}:{invocation}".encode())
    h.update(json.dumps(read_json(path / ADAPTER_CONFIG), sort_keys=True).encode())
    with open(path / ADAPTER_WEIGHTS, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


def find_invocation_start(tokens: list[int], invocation: list[int]) -> int | None:
    """PEFT's rule: the start of the last exact occurrence of the invocation tokens."""
    n = len(invocation)
    for start in range(len(tokens) - n, -1, -1):
        if tokens[start:start + n] == invocation:
            return start
    return None


class AdapterSet:
    def __init__(self, base_dir: Path, dtype: torch.dtype, device: torch.device | str = "cpu"):
        self.base_dir = base_dir
        self.dtype = dtype
        self.device = torch.device(device)
        self.slots: list[LoadedAdapter | None] = []
        self.by_name: dict[str, int] = {}
        self._lookup: dict[tuple[int, str], list] = {}

    def load(self, path: str | Path, name: str | None = None) -> str:
        path = Path(path)
        manifest = verify_adapter_dir(path, base=self.base_dir)
        name = name or manifest["name"]
        if name in self.by_name:
            raise KvshareError(f"an adapter named {name!r} is already loaded")
        config = read_json(path / ADAPTER_CONFIG)
        alpha, use_rslora = float(config.get("lora_alpha", config["r"])), bool(config.get("use_rslora"))
        parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        for key, tensor in load_tensors(path / ADAPTER_WEIGHTS).items():
            match = _KEY.match(key)
            if not match:
                raise KvshareError(f"{path}: tensor {key!r} is not a decoder-layer LoRA weight")
            parts.setdefault((int(match[1]), match[2]), {})[match[3]] = tensor.to(self.device, self.dtype)
        weights = {}
        for module, ab in parts.items():
            rank = ab["A"].shape[0]
            scale = alpha / math.sqrt(rank) if use_rslora else alpha / rank
            weights[module] = (ab["A"].contiguous(), ab["B"].contiguous(), scale)
        kind = parse_kind(manifest["kind"])
        invocation = manifest["alora"]["invocation_token_ids"] if kind_spec(kind).needs_invocation else None
        adapter = LoadedAdapter(name, kind, path, manifest, invocation, weights,
                                adapter_digest(path, kind, invocation))
        slot = next((i for i, s in enumerate(self.slots) if s is None), len(self.slots))
        if slot == len(self.slots):
            self.slots.append(adapter)
        else:
            self.slots[slot] = adapter
        self.by_name[name] = slot
        self._lookup.clear()
        return name

    def unload(self, name: str) -> None:
        slot = self.get_slot(name)
        self.slots[slot] = None
        del self.by_name[name]
        self._lookup.clear()

    def get_slot(self, name: str) -> int:
        if name not in self.by_name:
            raise KvshareError(f"unknown adapter {name!r} (loaded: {', '.join(self.by_name) or 'none'})")
        return self.by_name[name]

    def get(self, name: str) -> LoadedAdapter:
        return self.slots[self.get_slot(name)]

    def lookup(self, layer: int, parts: tuple[tuple[str, int], ...]) -> list:
        """Per slot: (A, B, scale) for a fused projection, or None; cached until slots change.

        ``parts`` names the projections fused in one matmul and their output sizes, e.g.
        q/k/v. Their A matrices (same input) are stacked and their B matrices placed on a
        block diagonal (zeros where a projection is not adapted), so one adapter costs two
        small matmuls per fused projection instead of two per projection; the zeros add
        exact zeros, so the result is PEFT's per-projection ``B(A x) * scale``.
        """
        key = (layer, parts)
        if key not in self._lookup:
            self._lookup[key] = [_fuse(s, layer, parts) if s is not None else None for s in self.slots]
        return self._lookup[key]


def _fuse(adapter: LoadedAdapter, layer: int, parts: tuple[tuple[str, int], ...]):
    found = [(adapter.weights.get((layer, name)), out) for name, out in parts]
    present = [w for w, _ in found if w is not None]
    if not present:
        return None
    scales = {scale for _, _, scale in present}
    if len(scales) > 1:  # one alpha/rank per adapter in every supported config
        raise KvshareError(f"adapter {adapter.name!r} has several LoRA scales in layer {layer}")
    a_cat = torch.cat([a for a, _, _ in present])
    b_fused = a_cat.new_zeros(sum(out for _, out in found), a_cat.shape[0])
    row, col = 0, 0
    for weights, out in found:
        if weights is not None:
            a, b, _ = weights
            b_fused[row:row + out, col:col + a.shape[0]] = b
            col += a.shape[0]
        row += out
    return a_cat, b_fused, scales.pop()
