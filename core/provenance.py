"""What reproduces a result: the command, kvshare's commit, the machine and the versions.

Every results JSON a kvshare command writes (the benchmarks' reports, ``kvshare eval compare``)
carries this block, so a figure quoted in the docs can be traced to the code and the machine
kind it was measured on. Light on purpose: torch is asked for its GPU only if already imported.
"""
from __future__ import annotations

import importlib.metadata
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

from . import __version__

PACKAGES = ("torch", "transformers", "peft", "numpy")
ISA_PREFIXES = ("avx", "amx", "fma", "f16c", "sse4")  # the flags that decide which CPU kernels run


def _git(root: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10,
                          check=True).stdout.strip()


def git_commit() -> str | None:
    """The checkout's commit (``-dirty`` with uncommitted changes to tracked files), None
    where kvshare is not run from a git checkout (an installed wheel)."""
    root = Path(__file__).resolve().parent.parent
    if not (root / ".git").exists():
        return None
    try:
        dirty = _git(root, "status", "--porcelain", "--untracked-files=no")
        return _git(root, "rev-parse", "HEAD") + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def _cpuinfo_field(name: str) -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(name):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_model() -> str:
    return _cpuinfo_field("model name") or platform.processor() or platform.machine()


def cpu_flags() -> list[str]:
    """The CPU's vector-instruction flags (AVX2, AVX-512, AVX512-BF16, AMX, ...)."""
    return sorted(f for f in (_cpuinfo_field("flags") or "").split() if f.startswith(ISA_PREFIXES))


def gpu() -> str | None:
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_name(0)


def versions(packages: tuple[str, ...] = PACKAGES) -> dict[str, str | None]:
    found = {}
    for name in packages:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def provenance(command: list[str] | str, packages: tuple[str, ...] = PACKAGES) -> dict:
    """The block a results JSON records under ``"provenance"``."""
    return {"command": command if isinstance(command, str) else shlex.join(command), "kvshare": __version__,
            "commit": git_commit(), "cpu": cpu_model(), "cpu_flags": cpu_flags(), "cpu_count": _cpu_count(),
            "gpu": gpu(), "python": platform.python_version(), "versions": versions(packages)}


def this_command() -> list[str]:
    """The running command as a user typed it (``kvshare bench engine ...``)."""
    return [Path(sys.argv[0]).name, *sys.argv[1:]]


def _cpu_count() -> int | None:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


if __name__ == "__main__":  # python -m kvshare.provenance OUT.json COMMAND...: for scripts under results/
    import json

    try:  # a script's result may come from a GPU: torch names it
        import torch  # noqa: F401
    except ImportError:
        pass

    Path(sys.argv[1]).write_text(json.dumps(provenance(sys.argv[2:]), indent=1) + "\n")
