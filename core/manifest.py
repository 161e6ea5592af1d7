"""The adapter manifest, ``kvshare.json``: what an adapter is and which KV it may share.

It sits beside PEFT's own files, so ``PeftModel.from_pretrained`` still loads the folder
unchanged. The JSON Schema in ``schemas/manifest.schema.json`` is the contract; it is
enforced on every read and every write, and writes are atomic (temporary file + rename).
"""

from __future__ import annotations

import hashlib
import json
import time
from functools import lru_cache
from pathlib import Path
from typing import Any

from jsonschema import Draft202012Validator, FormatChecker

from . import __version__
from .adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from .errors import KvshareError
from .fsutil import write_text_atomic
from .safetensors_io import read_json
from .kinds import AdapterKind, kind_spec, parse_kind

MANIFEST_FILE = "kvshare.json"
FORMAT_VERSION = 1
SCHEMA_PATH = Path(__file__).parent / "schemas" / "manifest.schema.json"


@lru_cache(maxsize=1)
def schema() -> dict:
    return json.loads(SCHEMA_PATH.read_text())


@lru_cache(maxsize=1)
def _validator() -> Draft202012Validator:
    return Draft202012Validator(schema(), format_checker=FormatChecker())


def validate(data: Any, source: str = "manifest") -> None:
    """Raise KvshareError naming the first schema violation, if any."""
    if isinstance(data, dict) and "kind" in data and isinstance(data["kind"], str):
        parse_kind(data["kind"])  # a clearer message than the schema's enum error
    errors = sorted(_validator().iter_errors(data), key=lambda e: list(e.absolute_path))
    if errors:
        err = errors[0]
        where = "/".join(str(p) for p in err.absolute_path) or "(top level)"
        more = f" (+{len(errors) - 1} more)" if len(errors) > 1 else ""
        raise KvshareError(f"{source}: invalid manifest at {where}: {err.message}{more}")


def build(
    *,
    name: str,
    kind: AdapterKind | str,
    base_name: str,
    base_family: str,
    base_fingerprint: str,
    tokenizer_fingerprint: str,
    rank: int,
    alpha: float,
    target_modules: list[str],
    dropout: float | None = None,
    use_rslora: bool | None = None,
    invocation_string: str | None = None,
    invocation_token_ids: list[int] | None = None,
    provenance: dict | None = None,
    eval_scores: dict | None = None,
    system_prompt: str | None = None,
) -> dict:
    """Assemble a manifest dict (validated) from its parts; the sharing rule comes from the kind."""
    kind = parse_kind(kind) if isinstance(kind, str) else kind
    lora: dict[str, Any] = {"rank": rank, "alpha": alpha, "target_modules": list(target_modules)}
    if dropout is not None:
        lora["dropout"] = dropout
    if use_rslora is not None:
        lora["use_rslora"] = use_rslora
    data: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "name": name,
        "kind": kind.value,
        "kv_sharing": kind_spec(kind).to_json(),
        "base_model": {
            "name": base_name,
            "family": base_family,
            "fingerprint": base_fingerprint,
            "tokenizer_fingerprint": tokenizer_fingerprint,
        },
        "lora": lora,
        "provenance": {
            "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "kvshare_version": __version__,
            **(provenance or {}),
        },
    }
    if kind_spec(kind).needs_invocation:
        data["alora"] = {
            "invocation_string": invocation_string,
            "invocation_token_ids": list(invocation_token_ids or []),
        }
    if eval_scores:
        data["eval"] = eval_scores
    if system_prompt:
        data["chat"] = {"system_prompt": system_prompt}
    validate(data, source=f"manifest for {name!r}")
    return data


def read(path: Path) -> dict:
    """Read and validate ``kvshare.json`` (give the file or its adapter folder)."""
    path = Path(path)
    if path.is_dir():
        path = path / MANIFEST_FILE
    data = read_json(path)
    validate(data, source=str(path))
    # the scope is the rule; the description is prose that may be reworded between versions
    if data["kv_sharing"]["scope"] != kind_spec(data["kind"]).scope.value:
        raise KvshareError(
            f"{path}: kv_sharing does not state the rule of kind {data['kind']!r}"
        )
    return data


EXPORTED_FILES = (ADAPTER_CONFIG, ADAPTER_WEIGHTS)


def file_digests(folder: Path, contents: dict[str, dict | bytes] | None = None) -> dict[str, str]:
    """sha256 of the adapter's files in ``folder``: what the manifest's ``files`` records. The
    config is hashed as canonical JSON, so a checkout that rewrites line ends or a re-indent
    is not a change; its values are. ``contents``: files the caller already read (a JSON
    file's parsed value, another's bytes), hashed as they are instead of read again."""
    digests, contents = {}, contents or {}
    for name in EXPORTED_FILES:
        h = hashlib.sha256()
        if name.endswith(".json"):
            value = contents[name] if name in contents else read_json(Path(folder) / name)
            h.update(json.dumps(value, sort_keys=True, separators=(",", ":")).encode())
        elif name in contents:
            h.update(contents[name])
        else:
            with open(Path(folder) / name, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
        digests[name] = "sha256:" + h.hexdigest()
    return digests


def check_files(data: dict, folder: Path) -> None:
    """A file changed since export (edited, truncated, swapped) is a clear error: its KV and
    outputs would no longer be the manifest's adapter. Manifests from before the ``files``
    field carry no digests and pass."""
    check_loaded_files(data, folder, {})


def check_loaded_files(data: dict, folder: Path, contents: dict[str, dict | bytes]) -> None:
    """:func:`check_files` over what a loader read (``contents`` as for :func:`file_digests`),
    so that the files checked are the ones loaded."""
    recorded = data.get("files")
    if not recorded:
        return
    for name, digest in file_digests(folder, contents).items():
        if digest != recorded[name]:
            raise KvshareError(f"{Path(folder) / name} changed since it was exported (sha256 {digest[7:19]}..., "
                               f"kvshare.json records {recorded[name][7:19]}...); export the adapter again")


def write(data: dict, folder: Path) -> Path:
    """Validate, then write ``folder/kvshare.json`` atomically. Returns the file path."""
    validate(data, source=f"manifest for {folder}")
    target = Path(folder) / MANIFEST_FILE
    write_text_atomic(target, json.dumps(data, indent=2, ensure_ascii=False) + "\n")
    return target
