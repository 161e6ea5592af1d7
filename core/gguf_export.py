"""``kvshare export --format gguf``: a LoRA or aLoRA adapter as a llama.cpp adapter file.

llama.cpp's own converter (``convert_lora_to_gguf.py``) is a script in its source tree, not
a package a user can install, and it needs a llama.cpp checkout of the matching version
beside the base's folder. What it writes is small and fixed, so it is written here with the
``gguf`` package (llama.cpp's own Python library) and its tensor-name map:
``general.type = adapter``, ``adapter.type = lora``, ``adapter.lora.alpha``, aLoRA's
``adapter.alora.invocation_tokens`` (uint32, as llama.cpp requires) and, per module,
``<gguf weight name>.lora_a`` / ``.lora_b`` in float32.

Two conversions make llama.cpp compute what PEFT computes: llama.cpp scales a LoRA by
``alpha / rank``, so an rsLoRA's ``alpha / sqrt(rank)`` is folded into the alpha written; and
for Llama and Mistral bases llama.cpp stores the query and key projections with their rows
permuted (its RoPE pairs neighbouring dimensions, Hugging Face's pairs the two halves), so
the rows of those modules' ``lora_B`` are permuted the same way.

ICaRus adapters are refused: an ICaRus agent's queries read keys and values that the frozen
base computed from the base's own hidden states (a second stream beside the adapter's),
and llama.cpp runs one stream per sequence.
"""

from __future__ import annotations

import math
import os
import tempfile
from pathlib import Path

import numpy as np

from .adapters import _LORA_KEY, ADAPTER_WEIGHTS, lora_alpha, lora_rank, read_peft_checkpoint
from .errors import KvshareError
from .kinds import AdapterKind, parse_kind
from .safetensors_io import load_tensors, read_json

# model_type -> (llama.cpp architecture, whether llama.cpp permutes q/k rows for its RoPE)
GGUF_ARCHITECTURES: dict[str, tuple[str, bool]] = {
    "llama": ("LLAMA", True),
    "mistral": ("LLAMA", True),  # llama.cpp converts MistralForCausalLM as a llama
    "qwen2": ("QWEN2", False),
    "qwen3": ("QWEN3", False),
}


def gguf_architecture(base_config: dict):
    """(llama.cpp's ``gguf.MODEL_ARCH``, permute q/k) for a base's ``config.json``."""
    model_type = base_config.get("model_type")
    if model_type not in GGUF_ARCHITECTURES:
        raise KvshareError(f"no llama.cpp adapter export for model_type {model_type!r} "
                           f"(supported: {', '.join(sorted(GGUF_ARCHITECTURES))})")
    arch, permute = GGUF_ARCHITECTURES[model_type]
    import gguf

    return getattr(gguf.MODEL_ARCH, arch), permute


def permute_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order: within each head, the two RoPE halves interleaved."""
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def gguf_tensors(adapter_dir: Path, base_config: dict, permute: bool, arch) -> dict[str, np.ndarray]:
    """The adapter's A/B pairs under llama.cpp's names, float32, q/k ``B`` rows permuted."""
    import gguf

    layers = int(base_config["num_hidden_layers"])
    heads = int(base_config["num_attention_heads"])
    kv_heads = int(base_config.get("num_key_value_heads") or heads)
    names = gguf.get_tensor_name_map(arch, layers)
    out: dict[str, np.ndarray] = {}
    for key, tensor in sorted(load_tensors(adapter_dir / ADAPTER_WEIGHTS).items()):
        match = _LORA_KEY.match(key)  # read_peft_checkpoint checked every key's form
        module, part = match["module"], match["part"]
        target = names.get_name(f"{module}.weight", try_suffixes=(".weight",))
        if target is None:
            raise KvshareError(f"{adapter_dir}: llama.cpp has no tensor for module {module!r}")
        array = tensor.float().numpy()
        leaf = module.rsplit(".", 1)[-1]
        if permute and part == "B" and leaf in ("q_proj", "k_proj"):
            array = permute_rows(array, heads if leaf == "q_proj" else kv_heads)
        out[f"{target}.lora_{part.lower()}"] = np.ascontiguousarray(array)
    return out


def write_gguf_adapter(adapter_dir: str | Path, base_dir: str | Path, out: str | Path, *,
                       kind: AdapterKind | str, name: str) -> Path:
    """Write the PEFT adapter in ``adapter_dir`` (already checked against ``base_dir``) as a
    llama.cpp adapter GGUF at ``out``, atomically (a temporary file renamed into place)."""
    import gguf

    kind = parse_kind(kind) if isinstance(kind, str) else kind
    _refuse_icarus(kind)
    adapter_dir, out = Path(adapter_dir), Path(out)
    ckpt = read_peft_checkpoint(adapter_dir)
    base_config = read_json(Path(base_dir) / "config.json")
    arch, permute = gguf_architecture(base_config)
    rank, alpha = lora_rank(ckpt.config), lora_alpha(ckpt.config)  # PEFT's defaults where unset
    if ckpt.config.get("use_rslora"):
        alpha *= math.sqrt(rank)  # llama.cpp scales by alpha / rank; rsLoRA by alpha / sqrt(rank)
    tensors = gguf_tensors(adapter_dir, base_config, permute, arch)

    out.parent.mkdir(parents=True, exist_ok=True)
    handle, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    os.close(handle)
    try:
        writer = gguf.GGUFWriter(tmp, gguf.MODEL_ARCH_NAMES[arch])
        writer.add_type(gguf.GGUFType.ADAPTER)
        writer.add_name(name)
        writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
        writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
        if kind is AdapterKind.ALORA:
            writer.add_key_value(gguf.Keys.Adapter.ALORA_INVOCATION_TOKENS, list(ckpt.invocation_tokens or []),
                                 gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.UINT32)
        for tensor_name, array in tensors.items():
            writer.add_tensor(tensor_name, array)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def export_gguf(source: str | Path, *, base: str | Path, out: str | Path, kind: AdapterKind | str | None = None,
                name: str | None = None, invocation: str | None = None, force: bool = False) -> Path:
    """``source`` (an exported kvshare adapter folder, or a PEFT checkpoint with ``kind``) as a
    llama.cpp adapter GGUF: checked against ``base`` the way ``kvshare export`` checks it
    first, so a GGUF is written only for an adapter kvshare would serve on that base."""
    from .export import export_adapter, resolve_base, verify_adapter_dir
    from .manifest import MANIFEST_FILE

    source, out = Path(source), Path(out)
    if out.is_dir():
        raise KvshareError(f"{out} is a folder; --format gguf writes one file (e.g. --out adapter.gguf)")
    if out.exists() and not force:
        raise KvshareError(f"{out} already exists; pass --force to replace it")
    if out.exists() and not _is_gguf(out):
        raise KvshareError(f"{out} is not a GGUF file: --force replaces only a GGUF")
    base_dir = resolve_base(base).folder
    if (source / MANIFEST_FILE).is_file():
        data = verify_adapter_dir(source, base=base)
        return write_gguf_adapter(source, base_dir, out, kind=data["kind"], name=name or data["name"])
    if kind is None:
        raise KvshareError(f"{source} is not an exported kvshare adapter (no {MANIFEST_FILE}): pass --kind "
                           "to export the PEFT checkpoint")
    _refuse_icarus(parse_kind(kind) if isinstance(kind, str) else kind)  # before exporting anything
    with tempfile.TemporaryDirectory(prefix=".kvshare-gguf-", dir=out.parent if out.parent.is_dir() else None) as tmp:
        folder = export_adapter(source, kind=kind, base=base, out=Path(tmp) / "adapter", invocation=invocation,
                                name=name or out.stem)
        return write_gguf_adapter(folder, base_dir, out, kind=kind, name=name or out.stem)


def _refuse_icarus(kind: AdapterKind) -> None:
    if kind is AdapterKind.ICARUS:
        raise KvshareError("an ICaRus adapter cannot run in llama.cpp: its queries read keys and values the "
                           "frozen base computes from its own hidden states, a second stream llama.cpp does "
                           "not have (serve it with kvshare, or use a LoRA or aLoRA adapter)")


def _is_gguf(path: Path) -> bool:
    with open(path, "rb") as handle:
        return handle.read(4) == b"GGUF"
