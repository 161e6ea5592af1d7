"""Typed YAML files (training recipes, evaluation suites): read, override, validate, and turn
every problem into one clear KvshareError naming the file and the key."""

from __future__ import annotations

from pathlib import Path
from types import NoneType, UnionType
from typing import Any, TypeVar, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError, ValidationInfo, field_validator

from .errors import KvshareError

Spec = TypeVar("Spec", bound=BaseModel)


class StrictSpec(BaseModel):
    """Base of every YAML spec: unknown keys, booleans given as numbers and infinite or NaN
    numbers are refused, as pydantic's lax mode would turn ``rank: yes`` into rank 1 and let
    ``epochs: .inf`` through to crash the trainer."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_as_number(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, bool) and info.field_name and _is_number(cls.model_fields[info.field_name].annotation):
            raise ValueError(f"expected a number, not the boolean {str(value).lower()} "
                             "(YAML reads yes/no/on/off/true/false as booleans)")
        return value


def _is_number(annotation: Any) -> bool:
    """Whether a field holds an int or float (optionally None), and not also a bool."""
    kinds = set(get_args(annotation)) if get_origin(annotation) in (Union, UnionType) else {annotation}
    kinds -= {NoneType}
    return bool(kinds) and kinds <= {int, float}


def load_spec(path: str | Path, model: type[Spec], what: str, overrides: list[str] | None = None) -> Spec:
    path = Path(path)
    if not path.is_file():
        raise KvshareError(f"{path}: no such {what} file")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as err:
        raise KvshareError(f"{path}: malformed YAML ({' '.join(str(err).split())})") from None
    except UnicodeDecodeError:
        raise KvshareError(f"{path}: not UTF-8 text (a {what} is a YAML file)") from None
    if not isinstance(data, dict):
        raise KvshareError(f"{path}: a {what} is a mapping of keys to values")
    for item in overrides or []:
        apply_override(data, item)
    try:
        return model.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "(top level)"
        message = first["msg"].removeprefix("Value error, ")
        if first["type"] == "extra_forbidden":
            message = "unknown key"
        more = f" (+{err.error_count() - 1} more)" if err.error_count() > 1 else ""
        raise KvshareError(f"{path}: {where}: {message}{more}") from None


def apply_override(data: dict, item: str) -> None:
    """Set a dotted key from ``key=value`` (value parsed as YAML), e.g. ``train.lr=1e-4``."""
    key, sep, raw = item.partition("=")
    if not sep or not key:
        raise KvshareError(f"override {item!r} is not of the form key=value")
    try:
        value = yaml.safe_load(raw) if raw else None
    except yaml.YAMLError as err:
        problem = str(getattr(err, "problem", None) or err).splitlines()[0]
        raise KvshareError(f"override {item!r}: its value is not valid YAML ({problem})") from None
    node = data
    parts = key.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise KvshareError(f"override {item!r}: {part} is not a section")
    node[parts[-1]] = value
