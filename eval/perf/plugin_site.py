"""kvshare's vLLM plugin on the path of a vLLM peer venv, for the benchmarks' plugin modes.

A user installs kvshare into vLLM's venv and vLLM finds the plugin through its entry point.
The benchmark's peer venv holds vLLM only (its pins differ from ours), so for the
``vllm-icarus`` and ``vllm-alora`` modes the plugin's few modules (they import nothing of
kvshare beyond :mod:`kvshare.kinds` and :mod:`kvshare.errors`) are copied from the running
kvshare, with a ``dist-info`` that declares the entry point, into a folder put on the
server's ``PYTHONPATH``. Copied from the imported modules, it works from a wheel install and
from an editable checkout alike.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import kvshare
import kvshare.errors
import kvshare.kinds
import kvshare.serve
import kvshare.serve.vllm_plugin

ENTRY_POINT = "[vllm.general_plugins]\nkvshare = kvshare.serve.vllm_plugin:register\n"


def plugin_site(dest: Path) -> Path:
    """Write the plugin's site folder at ``dest`` (replaced if present); returns it."""
    dest = Path(dest)
    shutil.rmtree(dest, ignore_errors=True)
    for module, target in ((kvshare, "kvshare/__init__.py"), (kvshare.errors, "kvshare/errors.py"),
                           (kvshare.kinds, "kvshare/kinds.py"), (kvshare.serve, "kvshare/serve/__init__.py")):
        (dest / target).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(module.__file__, dest / target)
    shutil.copytree(Path(kvshare.serve.vllm_plugin.__file__).parent, dest / "kvshare/serve/vllm_plugin",
                    ignore=shutil.ignore_patterns("__pycache__"))
    info = dest / f"kvshare-{kvshare.__version__}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: kvshare\nVersion: {kvshare.__version__}\n")
    (info / "entry_points.txt").write_text(ENTRY_POINT)
    return dest
