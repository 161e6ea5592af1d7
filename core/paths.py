"""Where kvshare keeps models and finds data, overridable by environment variables."""

from __future__ import annotations

import os
from pathlib import Path


def kvshare_home() -> Path:
    """Root of kvshare's own files: ``$KVSHARE_HOME``, default ``~/.cache/kvshare``."""
    env = os.environ.get("KVSHARE_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kvshare"


def models_dir() -> Path:
    return kvshare_home() / "models"


def downloads_dir() -> Path:
    return kvshare_home() / "downloads"


def data_dir() -> Path | None:
    """Local data sets: ``$KVSHARE_DATA``, else ``../shared/data`` when that folder exists.

    Returns None when neither is there, so loaders fall back to the Hugging Face Hub.
    """
    env = os.environ.get("KVSHARE_DATA")
    if env:
        return Path(env).expanduser()
    candidate = Path.cwd().parent / "shared" / "data"
    return candidate if candidate.is_dir() else None
