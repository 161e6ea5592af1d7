"""Stable identifiers of a base model and of its tokenizer.

KV computed by one base is only reusable by requests on the very same base, so every
adapter manifest and every prefix-cache key carries the base fingerprint: a hash of the
architecture config, the tokenizer vocabulary and the weight bytes. It is computed once and
cached beside the model (keyed by the files' sizes and modification times), so a
checkpoint saved again - same tensors, new files, other shards - keeps its fingerprint, while
any change of weights, vocabulary or architecture gives a new one.
"""

from __future__ import annotations

import hashlib
import json
import sys
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

from .errors import KvshareError
from .fsutil import write_text_atomic
from .safetensors_io import model_weight_files

CACHE_FILE = "kvshare-fingerprint.json"
CACHE_VERSION = 2  # 2: tensors in name order across shards (1: shard by shard)
_PROGRESS_BYTES = 1 << 30  # bases larger than this show a progress bar while hashed (on a terminal)

# Config keys that describe a run or a save, not the architecture.
_VOLATILE_CONFIG_KEYS = {
    "_name_or_path", "_model_name_or_path", "transformers_version", "torch_dtype", "dtype",
    "use_cache", "output_attentions", "output_hidden_states", "return_dict",
    "_attn_implementation", "_attn_implementation_autoset", "_commit_hash",
    "bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "architectures",
}


@dataclass(frozen=True)
class Fingerprints:
    base: str  # architecture + tokenizer vocabulary + weights
    tokenizer: str  # tokenizer vocabulary alone


_KNOWN: dict[tuple[str, str], Fingerprints] = {}  # (folder, its files' sizes and times) -> fingerprints, per process


def fingerprints(model_dir: Path) -> Fingerprints:
    """Return the model folder's fingerprints: known in this process (a server checks every
    adapter it loads against its base: the base is hashed once, even where the cache file
    cannot be written), else from the cache file when it is still valid, else computed."""
    model_dir = Path(model_dir)
    stats = _file_stats(model_dir)
    key = (str(model_dir.resolve()), json.dumps(stats))
    if key not in _KNOWN:
        _KNOWN[key] = _cached_or_computed(model_dir, stats)
    return _KNOWN[key]


def _cached_or_computed(model_dir: Path, stats: dict[str, list[int]]) -> Fingerprints:
    """The fingerprints from the folder's cache file when it is still valid, else computed
    (and the cache file written, where it can be)."""
    cache = model_dir / CACHE_FILE
    if cache.is_file():
        try:
            data = json.loads(cache.read_text(encoding="utf-8"))
            if data.get("files") == stats and (data.get("version") == CACHE_VERSION or (
                    data.get("version") == 1 and len(model_weight_files(model_dir)) == 1)) and \
                    all(isinstance(data[k], str) and data[k].startswith("sha256:") for k in ("base", "tokenizer")):
                return Fingerprints(data["base"], data["tokenizer"])  # version 1 = 2 for one file
        except (ValueError, KeyError, TypeError, AttributeError, OSError):
            pass  # a damaged (or unreadable) cache is simply recomputed
    result = compute_fingerprints(model_dir)
    payload = {"version": CACHE_VERSION, "base": result.base, "tokenizer": result.tokenizer,
               "files": stats}
    try:
        write_text_atomic(cache, json.dumps(payload, indent=1))
    except OSError:
        pass  # read-only model folder: the fingerprint is still correct, just not cached
    return result


def base_fingerprint(model_dir: Path) -> str:
    return fingerprints(model_dir).base


def compute_fingerprints(model_dir: Path) -> Fingerprints:
    """Hash architecture, vocabulary and weights from scratch (no cache)."""
    model_dir = Path(model_dir)
    config, vocab = _config_and_vocab(model_dir)
    return Fingerprints(_base_digest(model_dir, config, vocab, by_shard=False), f"sha256:{vocab}")


_LEGACY: dict[tuple[str, str], str] = {}  # (folder, its files' sizes and times) -> legacy digest, per process


def legacy_base_fingerprint(model_dir: Path) -> str:
    """The base fingerprint as kvshare computed it before it was independent of sharding
    (tensors hashed shard by shard): what manifests of adapters exported then record. Equal
    to :func:`base_fingerprint` for a model in one file. Kept for the process, so a server
    loading several such adapters hashes the base once."""
    model_dir = Path(model_dir)
    key = (str(model_dir.resolve()), json.dumps(_file_stats(model_dir)))
    if key not in _LEGACY:
        config, vocab = _config_and_vocab(model_dir)
        _LEGACY[key] = _base_digest(model_dir, config, vocab, by_shard=True)
    return _LEGACY[key]


def matches_base(model_dir: Path, recorded: str) -> bool:
    """Whether a manifest's recorded base fingerprint names this base: today's fingerprint,
    or, for a sharded base, the shard-by-shard one of adapters exported before (computed only
    when today's does not match)."""
    if fingerprints(model_dir).base == recorded:
        return True
    return len(model_weight_files(Path(model_dir))) > 1 and legacy_base_fingerprint(model_dir) == recorded


def _config_and_vocab(model_dir: Path) -> tuple[dict, str]:
    from transformers import AutoConfig, AutoTokenizer

    try:
        config = AutoConfig.from_pretrained(str(model_dir), local_files_only=True).to_dict()
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    except (OSError, ValueError) as err:
        raise KvshareError(f"{model_dir}: cannot read config or tokenizer ({err})") from None
    return config, _tokenizer_digest(tokenizer)


def _base_digest(model_dir: Path, config: dict, vocab: str, by_shard: bool) -> str:
    """Architecture, vocabulary, and every tensor's name, dtype, shape and bytes in name
    order: across all shards (the same tensors saved in other shards give the same digest),
    or, ``by_shard``, shard by shard as before (:func:`legacy_base_fingerprint`)."""
    arch = {k: v for k, v in sorted(config.items()) if k not in _VOLATILE_CONFIG_KEYS}
    digest = hashlib.sha256()
    digest.update(b"kvshare-base-v1\0")
    digest.update(json.dumps(arch, sort_keys=True, default=str).encode())
    digest.update(vocab.encode())
    skip = {"lm_head.weight"} if config.get("tie_word_embeddings") else set()
    files = model_weight_files(model_dir)
    # a 7B base is 14-28 GB to read once; small ones finish before a bar would say anything
    size = sum(file.stat().st_size for file in files)
    with ExitStack() as stack, tqdm(total=size, unit="B", unit_scale=True, desc=f"fingerprinting {model_dir.name}",
                                    file=sys.stderr, disable=None if size > _PROGRESS_BYTES else True) as bar:
        try:
            handles = [stack.enter_context(safe_open(str(file), framework="pt")) for file in files]
        except (SafetensorError, OSError) as err:
            raise KvshareError(f"{model_dir}: not a valid safetensors file ({err})") from None
        order = [(name, handle, file) for file, handle in zip(files, handles) for name in sorted(handle.keys())]
        if not by_shard:
            shard_of: dict[str, str] = {}
            for name, _, file in order:
                if name in shard_of:
                    raise KvshareError(f"{model_dir}: tensor {name!r} is in two shards ({shard_of[name]}, {file.name})")
                shard_of[name] = file.name
            order.sort(key=lambda entry: entry[0])
        for name, handle, _ in order:
            if name in skip:
                continue
            try:
                tensor = handle.get_tensor(name).contiguous()
            except (SafetensorError, OSError) as err:  # a header that lies about offsets or dtypes
                raise KvshareError(f"{model_dir}: {name!r} cannot be read: not a valid safetensors file ({err})") \
                    from None
            digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}\0".encode())
            digest.update(tensor.view(-1).view(torch.uint8).numpy().tobytes())
            bar.update(tensor.nbytes)
    return f"sha256:{digest.hexdigest()}"


def tokenizer_fingerprint_of(tokenizer) -> str:
    """Fingerprint of an already loaded tokenizer (vocabulary and special tokens)."""
    return f"sha256:{_tokenizer_digest(tokenizer)}"


def _tokenizer_digest(tokenizer) -> str:
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    special = sorted(str(t) for t in tokenizer.all_special_tokens)
    blob = json.dumps({"vocab": vocab, "special": special}, ensure_ascii=False)
    return hashlib.sha256(blob.encode()).hexdigest()


def _file_stats(model_dir: Path) -> dict[str, list[int]]:
    stats = {}
    for path in sorted(model_dir.iterdir()):
        if path.is_file() and _hashed_input(path.name):
            st = path.stat()
            stats[path.name] = [st.st_size, st.st_mtime_ns]
    return stats


def _hashed_input(name: str) -> bool:
    """Files the fingerprint reads (directly or through transformers)."""
    return (
        name == "config.json"
        or name.endswith(".safetensors")
        or name == "model.safetensors.index.json"
        or name.startswith("tokenizer")
        or name in {"special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt"}
    )
