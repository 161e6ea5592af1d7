"""Is a folder a model kvshare can load? A supported family, safetensors weights, a tokenizer.

Apart from :mod:`.models` (which resolves names to folders) so that the zoo, which checks
what it converts, and the resolver both use it without importing each other.
"""

from __future__ import annotations

from pathlib import Path

from .errors import KvshareError
from .families import FAMILIES
from .safetensors_io import model_weight_files, read_json

# Llama-family decoders whose attention the engine reproduces exactly (families.py).
SUPPORTED_FAMILIES = tuple(FAMILIES)


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
    if config.get("transformers_weights"):  # transformers would load that file; kvshare reads model.safetensors
        raise KvshareError(f"{model_dir}: config.json names its weights (transformers_weights), which kvshare "
                           "does not follow; save the model again with save_pretrained")
    model_weight_files(model_dir)
    if not any((model_dir / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        raise KvshareError(f"{model_dir}: no tokenizer (tokenizer.json or tokenizer_config.json)")
    return config
