"""``kvshare export`` and ``kvshare inspect``: PEFT checkpoint -> adapter folder + manifest.

Export validates everything first (checkpoint, base, kind rules), then writes into a
temporary sibling folder and renames it into place, so a failed export leaves nothing
behind and an existing adapter is only replaced with ``force``. Beside PEFT's files and the
manifest it writes a model card (``README.md``, :mod:`.model_card`) for other tools' users.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from . import manifest, model_card, zoo
from .adapters import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    check_against_base,
    check_kind_rules,
    lora_alpha,
    lora_modules,
    lora_rank,
    read_peft_checkpoint,
    target_leaves,
)
from .errors import KvshareError
from .fingerprint import fingerprints, matches_base
from .fsutil import fsync_files, replace_dir, write_text_atomic
from .models import is_hub_id, load_tokenizer, model_family, resolve_model_dir
from .safetensors_io import read_json, tensor_specs
from .kinds import AdapterKind, kind_spec, parse_kind


@dataclass(frozen=True)
class BaseInfo:
    """A resolved base model: where it is, what to call it, what it is."""

    name: str
    folder: Path
    family: str
    fingerprint: str
    tokenizer_fingerprint: str


def resolve_base(name_or_dir: str | Path) -> BaseInfo:
    folder = resolve_model_dir(name_or_dir)
    text = str(name_or_dir)
    named = text in zoo.ZOO or is_hub_id(text)  # a cached hub snapshot's folder is its revision
    name = text if named and not Path(text).expanduser().is_dir() else folder.resolve().name
    prints = fingerprints(folder)
    return BaseInfo(name, folder, model_family(folder), prints.base, prints.tokenizer)


def export_adapter(
    checkpoint_dir: str | Path,
    *,
    kind: AdapterKind | str,
    base: str | Path,
    out: str | Path,
    name: str | None = None,
    invocation: str | None = None,
    provenance: dict | None = None,
    eval_scores: dict | None = None,
    force: bool = False,
    system_prompt: str | None = None,
) -> Path:
    """Check a PEFT LoRA checkpoint and write it with its manifest to ``out``; ``system_prompt``:
    the system message it was trained with, which serving puts before conversations without one."""
    kind = parse_kind(kind) if isinstance(kind, str) else kind
    checkpoint_dir, out = Path(checkpoint_dir), Path(out)
    ckpt = read_peft_checkpoint(checkpoint_dir)
    try:
        source, target = checkpoint_dir.resolve(), out.resolve()
    except (RuntimeError, OSError) as err:  # e.g. a symbolic link loop
        raise KvshareError(f"{out}: {err}") from None
    if target == source or source in target.parents or target in source.parents:
        # --force replaces --out whole: a folder around the checkpoint would go with it
        raise KvshareError("--out must be a folder that neither is, nor is inside, nor contains CHECKPOINT_DIR")
    if out.exists() and not force:
        raise KvshareError(f"{out} already exists; pass --force to replace it")
    if out.exists() and not out.is_dir():
        raise KvshareError(f"{out} exists and is not a folder")
    if out.exists() and any(out.iterdir()) and not (out / manifest.MANIFEST_FILE).is_file():
        # --force deletes what it replaces: only an exported adapter (a base model, a home folder
        # or the working folder is never one)
        raise KvshareError(f"{out} holds files but no {manifest.MANIFEST_FILE}: --force replaces only an "
                           "exported adapter folder (or an empty one)")
    out = target  # named, never "." (the staging folder and the swap work beside it)

    base_info = resolve_base(base)
    modules = lora_modules(ckpt)
    check_against_base(ckpt, modules, base_info.folder)
    leaves = target_leaves(ckpt, modules)
    tokenizer = load_tokenizer(base_info.folder) if kind_spec(kind).needs_invocation else None
    invocation_ids = check_kind_rules(kind, ckpt, leaves, invocation, tokenizer)

    config = ckpt.config
    data = manifest.build(
        name=name or out.name,
        kind=kind,
        base_name=base_info.name,
        base_family=base_info.family,
        base_fingerprint=base_info.fingerprint,
        tokenizer_fingerprint=base_info.tokenizer_fingerprint,
        rank=lora_rank(config),
        alpha=lora_alpha(config),
        dropout=config.get("lora_dropout"),
        use_rslora=config.get("use_rslora"),
        target_modules=leaves,
        invocation_string=invocation if invocation_ids else None,
        invocation_token_ids=invocation_ids,
        provenance={"source_checkpoint": str(checkpoint_dir.resolve()), **(provenance or {})},
        eval_scores=eval_scores,
        system_prompt=system_prompt,
    )

    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        for file in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
            shutil.copyfile(checkpoint_dir / file, staging / file)
        if tensor_specs(staging / ADAPTER_WEIGHTS) != ckpt.specs:
            raise KvshareError(f"copy of {ADAPTER_WEIGHTS} does not match the source")
        if read_json(staging / ADAPTER_CONFIG) != ckpt.config:  # what was checked is what ships
            raise KvshareError(f"{checkpoint_dir / ADAPTER_CONFIG} changed during the export; export it again")
        data["files"] = manifest.file_digests(staging)
        manifest.write(data, staging)
        write_text_atomic(staging / model_card.CARD_FILE, model_card.render(data))
        fsync_files(staging)
        replace_dir(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


def verify_adapter_dir(adapter_dir: str | Path, base: str | Path | None = None, check_files: bool = True) -> dict:
    """Check an exported adapter folder; with ``base``, also that it belongs to that base.
    ``check_files=False`` leaves the files' digests to a caller that checks the bytes it
    loads (:meth:`kvshare.serve.exec.adapters.AdapterSet.load`), instead of reading them twice.

    Returns the manifest. Raises KvshareError on the first problem.
    """
    adapter_dir = Path(adapter_dir)
    if not adapter_dir.is_dir():
        raise KvshareError(f"{adapter_dir}: no such adapter folder")
    data = manifest.read(adapter_dir)
    ckpt = read_peft_checkpoint(adapter_dir)  # first: a missing or pickled file gets its own message
    if check_files:
        manifest.check_files(data, adapter_dir)
    modules = lora_modules(ckpt)
    kind = parse_kind(data["kind"])
    leaves = target_leaves(ckpt, modules)
    if lora_rank(ckpt.config) != data["lora"]["rank"] or sorted(leaves) != sorted(
        data["lora"]["target_modules"]
    ):
        raise KvshareError(f"{adapter_dir}: kvshare.json disagrees with {ADAPTER_CONFIG} (rank or targets)")
    invocation = data.get("alora", {}).get("invocation_string")
    if kind_spec(kind).needs_invocation and data["alora"]["invocation_token_ids"] != ckpt.invocation_tokens:
        raise KvshareError(f"{adapter_dir}: invocation token ids differ between kvshare.json and {ADAPTER_CONFIG}")
    tokenizer = None
    if base is not None:
        base_info = resolve_base(base)
        expected = data["base_model"]["fingerprint"]
        if not matches_base(base_info.folder, expected):
            raise KvshareError(
                f"{adapter_dir}: adapter {data['name']!r} was made for base "
                f"{data['base_model']['name']!r} ({expected[:19]}...), but {base} is "
                f"{base_info.fingerprint[:19]}...; its KV and weights would not match"
            )
        check_against_base(ckpt, modules, base_info.folder)
        if kind_spec(kind).needs_invocation:
            tokenizer = load_tokenizer(base_info.folder)
    check_kind_rules(kind, ckpt, leaves, invocation, tokenizer)
    return data
