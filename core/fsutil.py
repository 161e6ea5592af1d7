"""Atomic file and folder writes: a reader sees the old version or the new one, never half."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to a temporary file beside ``path``, fsync it, then rename over ``path``."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def replace_dir(staging: Path, target: Path) -> None:
    """Move a finished folder into place; a previous ``target`` is deleted only afterwards."""
    staging, target = Path(staging), Path(target)
    if not target.exists():
        os.replace(staging, target)
        return
    old = target.with_name(f".{target.name}.old-{os.getpid()}")
    os.replace(target, old)
    try:
        os.replace(staging, target)
    except BaseException:
        os.replace(old, target)  # put the previous version back
        raise
    shutil.rmtree(old, ignore_errors=True)


def fsync_files(folder: Path) -> None:
    for path in Path(folder).iterdir():
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
