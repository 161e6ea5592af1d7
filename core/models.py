"""Resolve a model name or folder and load it: the project's own loader.

Wherever kvshare accepts a model it accepts either a name from the model zoo
(``smollm2-135m-instruct``) or a local Hugging Face folder of a supported family.
Weights are read from safetensors only.
"""

from __future__ import annotations

from pathlib import Path

import torch

from . import zoo
from .errors import KvshareError
from .families import FAMILIES
from .safetensors_io import model_weight_files, read_json

# Llama-family decoders whose attention the engine reproduces exactly (families.py).
SUPPORTED_FAMILIES = tuple(FAMILIES)


def resolve_model_dir(name_or_dir: str | Path) -> Path:
    """Return the folder of a zoo model name or a local model folder, checked."""
    text = str(name_or_dir)
    path = Path(text).expanduser()
    if path.is_dir():
        check_model_dir(path)
        return path
    if text in zoo.ZOO:
        installed = zoo.installed_dir(text)
        if not zoo.is_pulled(text):
            raise KvshareError(
                f"model {text!r} is not pulled yet: run `kvshare models pull {text}`"
            )
        return installed
    if path.exists():
        raise KvshareError(f"{path}: not a folder")
    known = ", ".join(sorted(zoo.ZOO))
    raise KvshareError(
        f"unknown model {text!r}: not a local folder and not a zoo name (known: {known})"
    )


def check_model_dir(model_dir: Path) -> dict:
    """Check a Hugging Face model folder is of a supported family with safetensors weights.

    Returns its config.json as a dict.
    """
    model_dir = Path(model_dir)
    config = read_json(model_dir / "config.json")
    family = config.get("model_type")
    if family not in SUPPORTED_FAMILIES:
        raise KvshareError(
            f"{model_dir}: model_type {family!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_FAMILIES)})"
        )
    model_weight_files(model_dir)
    if not any((model_dir / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        raise KvshareError(f"{model_dir}: no tokenizer (tokenizer.json or tokenizer_config.json)")
    return config


def model_family(model_dir: Path) -> str:
    return check_model_dir(model_dir)["model_type"]


def load_tokenizer(name_or_dir: str | Path):
    from transformers import AutoTokenizer

    model_dir = resolve_model_dir(name_or_dir)
    return AutoTokenizer.from_pretrained(str(model_dir))


def load_model(name_or_dir: str | Path, dtype: torch.dtype = torch.float32):
    """Load (model, tokenizer) from a zoo name or a local folder, offline, safetensors only."""
    from transformers import AutoModelForCausalLM

    model_dir = resolve_model_dir(name_or_dir)
    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=dtype, use_safetensors=True, local_files_only=True
    )
    model.eval()
    return model, load_tokenizer(model_dir)
