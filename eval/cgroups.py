"""Memory and process caps that hold across all of a sandboxed program's processes.

``RLIMIT_AS`` caps one process and ``RLIMIT_NPROC`` counts a uid's tasks; a program that forks
(``ctypes`` can call ``fork`` past any Python guard) multiplies the first. A cgroup of its own
caps the sum: ``memory`` (tmpfs pages it writes included) and ``pids``. Both cgroup versions are
handled (v2's unified tree, v1's per-controller trees), wherever the harness itself sits in them.
Where no cgroup can be made (no write access to the tree: most non-root users), :func:`make`
returns None and :class:`MemoryWatch` polls the resident memory of every process in the jail's
PID namespace instead (a cap that can be overshot between two polls, 50 ms, by what the
processes' address-space limits allow).
"""

from __future__ import annotations

import os
import secrets
import signal
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Cgroup:
    """One cgroup per run (a folder per hierarchy): join by writing a pid into ``procs``."""
    folders: list[Path]

    @property
    def procs(self) -> list[str]:
        return [str(folder / "cgroup.procs") for folder in self.folders]

    def kill_and_remove(self) -> None:
        """SIGKILL every process still in it, then remove it (a cgroup with tasks cannot go)."""
        for _ in range(200):
            pids = {int(pid) for folder in self.folders for pid in _read(folder / "cgroup.procs").split()}
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if not pids:
                break
            time.sleep(0.01)
        for folder in self.folders:
            try:
                folder.rmdir()
            except OSError:
                pass


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _mounts() -> list[tuple[str, str, set[str]]]:
    """(mount point, type, options) of each cgroup file system the harness can see."""
    found = []
    for line in _read(Path("/proc/self/mountinfo")).splitlines():
        fields = line.split()
        if " - " not in line:
            continue
        after = line.split(" - ", 1)[1].split()
        if after[0] in ("cgroup", "cgroup2"):
            found.append((fields[4].replace("\\040", " "), after[0], set(after[2].split(","))))
    return found


def _own_paths() -> dict[str, str]:
    """Where this process sits: controller (or "" for v2) -> path in that hierarchy."""
    paths = {}
    for line in _read(Path("/proc/self/cgroup")).splitlines():
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(",") if controllers else [""]:
            paths[controller] = path
    return paths


def _make_folder(parent: Path, settings: dict[str, str]) -> Path | None:
    folder = parent / f"kvshare-sandbox-{secrets.token_hex(6)}"
    try:
        folder.mkdir()
    except OSError:
        return None
    try:
        for name, value in settings.items():
            (folder / name).write_text(value)
    except OSError:
        folder.rmdir()
        return None
    return folder


def _v2(memory_bytes: int, processes: int) -> Cgroup | None:
    mount = next((point for point, kind, _ in _mounts() if kind == "cgroup2"), None)
    own = _own_paths().get("")
    if mount is None or own is None:
        return None
    parent = Path(mount + own)
    if not {"memory", "pids"} <= set(_read(parent / "cgroup.subtree_control").split()):
        return None  # enabling them would need an empty parent (v2's no-internal-process rule)
    folder = _make_folder(parent, {"memory.max": str(memory_bytes), "memory.swap.max": "0", "pids.max": str(processes)})
    return Cgroup([folder]) if folder else None


def _v1(memory_bytes: int, processes: int) -> Cgroup | None:
    own = _own_paths()
    folders = []
    for controller, settings in (("memory", {"memory.limit_in_bytes": str(memory_bytes)}),
                                 ("pids", {"pids.max": str(processes)})):
        mount = next((point for point, kind, options in _mounts() if kind == "cgroup" and controller in options), None)
        folder = _make_folder(Path(mount + own[controller]), settings) if mount and controller in own else None
        if folder is None:
            Cgroup(folders).kill_and_remove()
            return None
        folders.append(folder)
    return Cgroup(folders)


def make(memory_bytes: int, processes: int) -> Cgroup | None:
    """A fresh cgroup capping memory and processes in total, or None where none can be made."""
    return _v2(memory_bytes, processes) or _v1(memory_bytes, processes)


def join_argv(group: Cgroup | None) -> list[str]:
    """A prefix that moves the command into ``group`` before it runs (a shell that writes its
    own pid into each ``cgroup.procs``, then execs): the program's first instruction is inside."""
    if group is None:
        return []
    script = 'n=$1; shift; while [ "$n" -gt 0 ]; do echo $$ > "$1" || exit 125; shift; n=$((n-1)); done; exec "$@"'
    return ["/bin/sh", "-c", script, "sh", str(len(group.procs)), *group.procs]


class MemoryWatch:
    """The summed resident memory of the processes in the PID namespace that ``unshare`` (``pid``)
    makes for its child, against ``limit`` bytes: the fallback where no cgroup can be made."""

    def __init__(self, pid: int, limit: int):
        self.pid, self.limit, self.namespace = pid, limit, None
        self.own = os.readlink("/proc/self/ns/pid")
        self.page = os.sysconf("SC_PAGE_SIZE")

    def _find_namespace(self) -> str | None:
        try:
            found = os.readlink(f"/proc/{self.pid}/ns/pid_for_children")
        except OSError:
            return None
        return found if found != self.own else None  # not yet unshared

    def resident(self) -> int:
        """Bytes resident in the jail's processes now (0 before the namespace exists)."""
        self.namespace = self.namespace or self._find_namespace()
        total = 0
        for pid in filter(str.isdigit, os.listdir("/proc")) if self.namespace else ():
            try:
                if os.readlink(f"/proc/{pid}/ns/pid") == self.namespace:
                    with open(f"/proc/{pid}/statm") as handle:
                        total += int(handle.read().split()[1]) * self.page
            except (OSError, IndexError, ValueError):
                pass
        return total

    def over(self) -> bool:
        return self.resident() > self.limit
