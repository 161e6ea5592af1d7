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

from ...adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS, lora_alpha
from ...errors import KvshareError
from ...export import verify_adapter_dir
from ...manifest import check_loaded_files
from ...safetensors_io import read_json, read_tensor_file
from ...kinds import AdapterKind, KindSpec, kind_spec, parse_kind, serving_spec
from ..kv_layout import EXACT, KVLayout, layout_named

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
    layout: KVLayout = EXACT  # ForkKV: k/v LoRA kept apart as a rank-r residual

    @property
    def kv_layout(self) -> str:
        """The layout's public name (what ``load_adapter(kv_layout=...)`` took)."""
        return self.layout.name

    @property
    def spec(self) -> KindSpec:
        return serving_spec(self.kind, self.layout.name)

    @property
    def rank(self) -> int:
        return max((a.shape[0] for a, _, _ in self.weights.values()), default=0)


def adapter_digest(path: Path, kind: AdapterKind, invocation: list[int] | None, *, config: dict | None = None,
                   weights: bytes | None = None) -> str:
    """sha256 over what changes the adapter's KV and outputs: weight bytes, LoRA config,
    kind and invocation ids (not its name or provenance). ``config`` and ``weights``, when
    given, are what the caller already read from ``path`` (the same digest)."""
    h = hashlib.sha256(f"kvshare-adapter:{kind.value}:{invocation}".encode())
    h.update(json.dumps(config if config is not None else read_json(path / ADAPTER_CONFIG), sort_keys=True).encode())
    if weights is not None:
        h.update(weights)
    else:
        with open(path / ADAPTER_WEIGHTS, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return "sha256:" + h.hexdigest()


def check_finite(path: Path, weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, float]]) -> None:
    """Refuse NaN or Inf in an adapter's factors or scales, as they will be served (after the
    cast to the engine's dtype, which can overflow). Such an adapter's rows write NaN into KV
    that other adapters read in the shared layouts (ForkKV's base part, full reuse), so one bad
    adapter would break every other; it is refused before it is ever served."""
    for (layer, module), (a, b, scale) in sorted(weights.items()):
        if not math.isfinite(scale):
            raise KvshareError(f"{path}: adapter weights are not finite: layer {layer} {module} has scale {scale} "
                               "(lora_alpha / rank); refusing to load it")
        for factor, tensor in (("A", a), ("B", b)):
            if not bool(torch.isfinite(tensor).all()):
                raise KvshareError(f"{path}: adapter weights are not finite: layer {layer} {module}.lora_{factor} "
                                   "holds NaN or Inf values; refusing to load it")


class AdapterSet:
    def __init__(self, base_dir: Path, dtype: torch.dtype, device: torch.device | str = "cpu"):
        self.base_dir = base_dir
        self.dtype = dtype
        self.device = torch.device(device)
        self.slots: list[LoadedAdapter | None] = []
        self.by_name: dict[str, int] = {}
        self._lookup: dict[tuple[int, str], list] = {}
        self._residual: dict[int, ResidualStack] = {}
        self.residual_rank = 0  # the residual pool's width: ForkKV adapters may have at most this rank
        self.default_layout = EXACT  # the layout of lora adapters loaded without one
        self.version = 0  # counts loads and unloads: what caches of the slots compare against

    def layout_of(self, path: Path, kv_layout: str | None) -> tuple[dict, KVLayout]:
        """(manifest, the layout the adapter at ``path`` is served with): the one ``kv_layout``
        names, or the default for its kind; a clear error for a layout its kind has not. Its
        files are checked by :meth:`load`, on what loads."""
        manifest = verify_adapter_dir(Path(path), base=self.base_dir, check_files=False)
        if kv_layout is not None:
            layout = layout_named(kv_layout)
        else:
            layout = self.default_layout if manifest["kind"] == AdapterKind.LORA.value else EXACT
        serving_spec(manifest["kind"], layout.name)
        return manifest, layout

    def load(self, path: str | Path, name: str | None = None, kv_layout: str | None = None) -> str:
        """Load an exported adapter under ``name``; ``kv_layout="forkkv"`` serves a lora
        adapter with ForkKV's shared base part and private rank-r residual (None: the
        default layout for lora adapters, exact for other kinds)."""
        return self.install(self.prepare(path, name, kv_layout))

    def prepare(self, path: str | Path, name: str | None = None, kv_layout: str | None = None) -> LoadedAdapter:
        """Read, check and digest the adapter at ``path`` without touching the slots, so a
        server can run it off the engine thread (reading and checking cost the file's size;
        :meth:`install` then costs nothing). Every load goes through here: here the weights
        are refused if they are not finite."""
        path = Path(path)
        manifest, layout = self.layout_of(path, kv_layout)
        name = name or manifest["name"]
        self._check_name_free(name)
        # the config and weights are read once: what is checked, loaded and digested is one thing,
        # even if the files are replaced while this runs
        config = read_json(path / ADAPTER_CONFIG)
        raw, tensors = read_tensor_file(path / ADAPTER_WEIGHTS)
        check_loaded_files(manifest, path, {ADAPTER_CONFIG: config, ADAPTER_WEIGHTS: raw})
        weights = self._weights_of(path, tensors, config)
        check_finite(path, weights)
        kind = parse_kind(manifest["kind"])
        invocation = manifest["alora"]["invocation_token_ids"] if kind_spec(kind).needs_invocation else None
        return LoadedAdapter(name, kind, path, manifest, invocation, weights,
                             adapter_digest(path, kind, invocation, config=config, weights=raw), layout)

    def _weights_of(self, path: Path, tensors: dict[str, torch.Tensor], config: dict) -> dict:
        """(layer, projection) -> (A, B, scale) on this set's device and dtype."""
        alpha, use_rslora = lora_alpha(config), bool(config.get("use_rslora"))
        parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        for key, tensor in tensors.items():
            match = _KEY.match(key)
            if not match:
                raise KvshareError(f"{path}: tensor {key!r} is not a decoder-layer LoRA weight")
            parts.setdefault((int(match[1]), match[2]), {})[match[3]] = tensor.to(self.device, self.dtype)
        weights = {}
        for module, ab in parts.items():
            rank = ab["A"].shape[0]
            scale = alpha / math.sqrt(rank) if use_rslora else alpha / rank
            weights[module] = (ab["A"].contiguous(), ab["B"].contiguous(), scale)
        return weights

    def install(self, adapter: LoadedAdapter) -> str:
        """Put a :meth:`prepare`-d adapter in a slot: cheap, the part that must run between
        steps (on the engine thread). Its name is checked again: another load may have taken
        it meanwhile."""
        self._check_name_free(adapter.name)
        if adapter.layout.uses_residual_pool and adapter.rank > self.residual_rank:
            raise KvshareError(f"adapter {adapter.name!r} has rank {adapter.rank}; the ForkKV residual pool holds "
                               f"rank {self.residual_rank} at most (raise forkkv_max_rank)")
        slot = next((i for i, s in enumerate(self.slots) if s is None), len(self.slots))
        if slot == len(self.slots):
            self.slots.append(adapter)
        else:
            self.slots[slot] = adapter
        self.by_name[adapter.name] = slot
        self.version += 1
        self._lookup.clear()
        self._residual.clear()
        return adapter.name

    def _check_name_free(self, name: str) -> None:
        if name in self.by_name:
            raise KvshareError(f"an adapter named {name!r} is already loaded")

    def unload(self, name: str) -> None:
        slot = self.get_slot(name)
        self.slots[slot] = None
        del self.by_name[name]
        self.version += 1
        self._lookup.clear()
        self._residual.clear()

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

    def residual_index(self) -> dict[int, int]:
        """Slot -> index into :meth:`residual_stack` of every ForkKV adapter (slot order)."""
        forkkv = [i for i, s in enumerate(self.slots) if s is not None and s.layout.uses_residual_pool]
        return {slot: index for index, slot in enumerate(forkkv)}

    def residual_stack(self, layer: int, hidden: int, kv_size: int) -> ResidualStack:
        """The ForkKV adapters' k/v LoRA of one layer, stacked in :meth:`residual_index` order
        and zero-padded to the pool's rank (zeros add exact zeros): what the residual pool's
        writes (A) and residual attention (B, scale) need. Cached until slots change."""
        if layer not in self._residual:
            adapters = [self.slots[slot] for slot in self.residual_index()]
            self._residual[layer] = ResidualStack.build(adapters, layer, self.residual_rank, hidden, kv_size,
                                                        self.dtype, self.device)
        return self._residual[layer]


@dataclass
class ResidualStack:
    """One layer's ForkKV weights: A_k, A_v (adapters, r, hidden), B_k, B_v (adapters, kv_size, r),
    scales (adapters,). An adapter that does not adapt k (or v) in this layer has zeros."""

    a_k: torch.Tensor
    a_v: torch.Tensor
    b_k: torch.Tensor
    b_v: torch.Tensor
    scales: torch.Tensor

    @staticmethod
    def build(adapters: list[LoadedAdapter], layer: int, rank: int, hidden: int, kv_size: int,
              dtype: torch.dtype, device: torch.device) -> ResidualStack:
        a = torch.zeros(2, len(adapters), rank, hidden, device=device, dtype=dtype)
        b = torch.zeros(2, len(adapters), kv_size, rank, device=device, dtype=dtype)
        scales = torch.zeros(len(adapters), dtype=torch.float32, device=device)
        for i, adapter in enumerate(adapters):
            for j, name in enumerate(("k_proj", "v_proj")):
                entry = adapter.weights.get((layer, name))
                if entry is not None:
                    a_w, b_w, scale = entry
                    a[j, i, :a_w.shape[0]] = a_w
                    b[j, i, :, :b_w.shape[1]] = b_w
                    scales[i] = scale
        return ResidualStack(a[0], a[1], b[0], b[1], scales)


def _fuse(adapter: LoadedAdapter, layer: int, parts: tuple[tuple[str, int], ...]):
    # a ForkKV adapter's k/v LoRA is not added to K/V: it goes to the residual pool instead
    split = adapter.layout.residual_projections
    found = [(adapter.weights.get((layer, name)) if name not in split else None, out) for name, out in parts]
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
