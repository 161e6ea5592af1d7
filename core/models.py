"""Resolve a model name or folder and load it: the project's own loader.

Wherever kvshare accepts a model it accepts a name from the model zoo
(``smollm2-135m-instruct``), a local Hugging Face folder of a supported family, or a hub id
(``HuggingFaceTB/SmolLM2-135M-Instruct``) already in the local Hugging Face cache
(``HF_HUB_CACHE``, or ``HF_HOME``/hub): found there offline, never downloaded. Weights are
read from safetensors only.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch

from . import zoo
from .errors import KvshareError
from .model_check import check_model_dir
from .safetensors_io import model_weight_files, read_json, tensor_specs


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
        try:
            check_model_dir(installed)
        except KvshareError as err:  # a file of the pulled folder went missing or was damaged
            raise KvshareError(f"{err}; run `kvshare models pull {text} --force` to pull it again") from None
        return installed
    if path.exists():
        raise KvshareError(f"{path}: not a folder")
    if is_hub_id(text):
        snapshot = hub_cached_dir(text)
        if snapshot is None:
            raise KvshareError(
                f"model {text!r} is not in the local Hugging Face cache ({hub_cache_dir()}); "
                f"download it where the hub is reachable (`hf download {text}`) or pass a local folder"
            )
        check_model_dir(snapshot)
        return snapshot
    known = ", ".join(sorted(zoo.ZOO))
    raise KvshareError(
        f"unknown model {text!r}: not a local folder, not a zoo name (known: {known}) "
        "and not a Hugging Face hub id (org/name)"
    )


def is_hub_id(text: str) -> bool:
    """``org/name`` as the hub spells repository ids (not a path: no ./, no more slashes)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if text.count("/") != 1 or text.startswith((".", "~")):
        return False
    try:
        validate_repo_id(text)
    except HFValidationError:
        return False
    return True


def hub_cache_dir() -> Path:
    """The hub cache huggingface_hub would use, read from the environment now (its own
    constants are fixed when it is first imported)."""
    from huggingface_hub import constants

    for variable in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(variable):
            return Path(os.path.expandvars(os.environ[variable])).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.path.expandvars(os.environ["HF_HOME"])).expanduser() / "hub"
    return Path(constants.HF_HUB_CACHE)


def hub_cached_dir(repo_id: str) -> Path | None:
    """The cached snapshot folder of hub model ``repo_id``: the revision ``main`` points to,
    else the most recently modified cached revision that has a config.json; None if absent."""
    from huggingface_hub import CacheNotFound, scan_cache_dir, try_to_load_from_cache

    cache = hub_cache_dir()
    config = try_to_load_from_cache(repo_id, "config.json", cache_dir=cache)
    if isinstance(config, str):
        return Path(config).parent
    try:
        repos = scan_cache_dir(cache).repos
    except (CacheNotFound, ValueError):  # no cache there (or a file in its place)
        return None
    revisions = [rev for repo in repos if repo.repo_type == "model" and repo.repo_id == repo_id
                 for rev in repo.revisions if (rev.snapshot_path / "config.json").is_file()]
    if not revisions:
        return None
    return max(revisions, key=lambda rev: rev.last_modified).snapshot_path


_BATCH_DEPENDENT_ROPE = ("dynamic", "longrope")  # frequencies chosen from the batch's largest position


def refuse_what_the_engine_lacks(config, tensor_names) -> None:
    """A model whose transformers forward does something the engine's does not is refused, not
    served (or trained for serving) wrongly: biases beyond q/k/v (Llama's attention_bias,
    mlp_bias), a sliding window that is on (Mistral, Qwen with use_sliding_window), RoPE whose
    frequencies depend on the batch (a short request batched beside a long one would be
    rotated as the long one). ``config``: the transformers config; ``tensor_names``: the
    weights' names."""
    extra_bias = sorted({k.split(".")[-2] for k in tensor_names if k.endswith(".bias")
                         and k.split(".")[-2] in ("o_proj", "gate_proj", "up_proj", "down_proj")})
    if extra_bias:
        raise KvshareError(f"this model has biases on {', '.join(extra_bias)}, which the engine does not add")
    window = getattr(config, "sliding_window", None)
    if window and getattr(config, "use_sliding_window", True) and window < config.max_position_embeddings:
        raise KvshareError(f"this model attends within a sliding window of {window} tokens, which the engine "
                           "does not apply")
    rope = (getattr(config, "rope_scaling", None) or {}).get("rope_type") or \
        (getattr(config, "rope_parameters", None) or {}).get("rope_type")
    if rope in _BATCH_DEPENDENT_ROPE:
        raise KvshareError(f"this model's RoPE ({rope}) picks its frequencies from the batch; the engine batches "
                           "requests of every length, so it is not supported")


def check_servable(model_dir: Path) -> None:
    """:func:`refuse_what_the_engine_lacks` from the folder's config and weight names (no weight
    is read): what trains an adapter checks the engine can serve its base first."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    refuse_what_the_engine_lacks(config, [name for file in model_weight_files(model_dir)
                                          for name in tensor_specs(file)])


def model_family(model_dir: Path) -> str:
    return check_model_dir(model_dir)["model_type"]


def load_tokenizer(name_or_dir: str | Path):
    from transformers import AutoTokenizer

    model_dir = resolve_model_dir(name_or_dir)
    return AutoTokenizer.from_pretrained(str(model_dir))


def end_of_sequence_ids(model_dir: Path, tokenizer) -> frozenset[int]:
    """Every token that ends a generation: the tokenizer's end-of-sequence token and the
    ``eos_token_id`` (an id or a list) of ``generation_config.json``, or of ``config.json``
    when there is none, as transformers' ``generate`` and vLLM stop on. A chat model's
    end of turn is often not the tokenizer's EOS (Qwen2.5's ``<|im_end|>`` beside
    ``<|endoftext|>``, Llama 3's ``<|eot_id|>``): stopping on the tokenizer's alone, it would
    write the next turns itself."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    for name in ("generation_config.json", "config.json"):
        path = Path(model_dir) / name
        if not path.is_file():
            continue
        value = read_json(path).get("eos_token_id")
        values = value if isinstance(value, list) else [value]
        ids.update(v for v in values if isinstance(v, int) and not isinstance(v, bool))
        break  # generation_config.json, when there is one, is what generate() follows
    return frozenset(ids)


# what a model's generation_config.json may set for sampling, with transformers' defaults
# (a value equal to its default is no setting, as in GenerationConfig.to_diff_dict)
_SAMPLING_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "min_p": None, "repetition_penalty": 1.0}
_SAMPLING_VALID = {"temperature": lambda v: 0 <= v < math.inf, "top_p": lambda v: 0 < v <= 1,
                   "top_k": lambda v: 0 <= v == int(v), "min_p": lambda v: 0 <= v <= 1,
                   "repetition_penalty": lambda v: 0 < v < math.inf}


def sampling_defaults(model_dir: Path) -> dict[str, float]:
    """The sampling a model ships in ``generation_config.json`` (Qwen2.5-Instruct: temperature
    0.7, top_p 0.8, top_k 20, repetition_penalty 1.05), which vLLM (0.8+, its default
    ``--generation-config auto``) uses for what a request leaves out. transformers' defaults
    and values out of range are no setting (a broken file must not fail every request)."""
    path = Path(model_dir) / "generation_config.json"
    try:
        config = read_json(path) if path.is_file() else {}
    except KvshareError:
        return {}
    found = {}
    for name, default in _SAMPLING_DEFAULTS.items():
        value = config.get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value != default \
                and _SAMPLING_VALID[name](value):
            found[name] = int(value) if name == "top_k" else float(value)
    return found


def load_model(name_or_dir: str | Path, dtype: torch.dtype = torch.float32):
    """Load (model, tokenizer) from a zoo name or a local folder, offline, safetensors only."""
    from transformers import AutoModelForCausalLM

    model_dir = resolve_model_dir(name_or_dir)
    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=dtype, use_safetensors=True, local_files_only=True
    )
    model.eval()
    return model, load_tokenizer(model_dir)
