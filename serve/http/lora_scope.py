"""What runtime LoRA loading may touch: which folders, and which adapters it may replace.

``/v1/load_lora_adapter`` reads a path a client names. With a LoRA root (``--lora-root``)
that path, symlinks followed, must lie under the root. A refused path gets one message
whatever the reason (missing, not a folder, not an exported adapter, outside the root,
unreadable), so that clients cannot use the route to learn what exists on the server's
disk; the real reason goes to the server's log. Adapters given at start-up are the
deployment's: a client may not unload or replace them unless the server was started with
``--allow-runtime-replace-startup-adapters``.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from ...adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from ...errors import KvshareError
from ...manifest import MANIFEST_FILE, read as read_manifest

if TYPE_CHECKING:
    from ..exec.adapters import LoadedAdapter
    from ..driver.colocation import Colocation

logger = logging.getLogger(__name__)

ALLOW_REPLACE_FLAG = "--allow-runtime-replace-startup-adapters"
REFUSED_PATH = ("lora_path is not an exported adapter folder this server may load (see the server's log "
                "for why)")


class AdapterPathRefused(KvshareError):
    """A runtime load's path is refused; the message never says why (see :data:`REFUSED_PATH`)."""


class StartupAdapterLocked(KvshareError):
    """A client asked to unload or replace an adapter given at start-up."""


class RuntimeLoraScope:
    def __init__(self, root: str | Path | None, startup: set[str], allow_replace_startup: bool = False):
        """``root``: the folder runtime-loaded adapters must lie in (None: anywhere this process
        can read); ``startup``: the names of the adapters given at start-up, which stay loaded
        unless ``allow_replace_startup``."""
        self.root = lora_root(root) if root is not None else None
        self.startup = set(startup)
        self.allow_replace_startup = allow_replace_startup

    def adapter_path(self, path: str) -> Path:
        """The real path (symlinks followed) of the adapter folder a client named; raises
        :class:`AdapterPathRefused`, with one message for every reason, logging the reason."""
        real = None
        try:
            real = Path(os.path.realpath(path))
            reason = self._refusal(real)
        except (OSError, ValueError) as err:  # e.g. permission denied on a parent, a NUL in the path
            reason = f"cannot be read ({err})"
        if reason is not None:
            logger.warning("load_lora_adapter: refused lora_path %r (real path %s): %s", path, real, reason)
            raise AdapterPathRefused(REFUSED_PATH)
        return real

    def _refusal(self, real: Path) -> str | None:
        """Why ``real`` may not be loaded, or None."""
        if self.root is not None and not real.is_relative_to(self.root):
            return f"outside the LoRA root {self.root}"
        if not real.exists():
            return "does not exist"
        if not real.is_dir():
            return "is not a folder"
        for name in (MANIFEST_FILE, ADAPTER_CONFIG, ADAPTER_WEIGHTS):
            file = real / name
            if not file.is_file():
                return f"is not an exported adapter folder (no {name})"
            if not os.access(file, os.R_OK):
                return f"{name} is not readable (permission denied)"
        try:
            read_manifest(real)
        except KvshareError as err:
            return f"is not an exported adapter folder ({err})"
        return None

    def prepare(self, colocation: Colocation, base: str, path: str, name: str) -> LoadedAdapter:
        """The adapter a client asked for, read and checked for base ``base`` (on the load
        worker, not the engine thread). An OS error while reading it is refused as a bad path
        is: its text would tell what exists."""
        real = self.adapter_path(path)
        try:
            return colocation.prepare_adapter(base, real, name)
        except OSError as err:
            logger.warning("load_lora_adapter: refused lora_path %r (real path %s): %s", path, real, err)
            raise AdapterPathRefused(REFUSED_PATH) from None

    def check_replaceable(self, name: str) -> None:
        """Refuse to unload or replace ``name`` when it was given at start-up (unless allowed)."""
        if name in self.startup and not self.allow_replace_startup:
            raise StartupAdapterLocked(f"adapter {name!r} was given at start-up: it cannot be unloaded or replaced "
                                       f"at runtime unless the server runs with {ALLOW_REPLACE_FLAG}")

    def unloaded(self, name: str) -> None:
        """``name`` is gone: a later adapter of that name is a runtime one."""
        self.startup.discard(name)


def lora_root(root: str | Path) -> Path:
    """``root`` as a real path (symlinks followed), checked to be a folder."""
    real = Path(os.path.realpath(root))
    if not real.is_dir():
        raise KvshareError(f"LoRA root {root}: no such folder")
    return real
