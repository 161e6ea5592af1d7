"""MkDocs hook: lays out the ``kvshare`` package as one folder for the API reference.

The package's folders are mapped at install time (``core/`` is ``kvshare``, ``serve/`` is
``kvshare.serve``, ... in pyproject.toml), which griffe's static loader cannot follow. This
hook makes ``.api-tree/kvshare`` (gitignored): links to ``core/``'s entries and to each
subsystem's folder, and mkdocstrings reads the package from there without importing it.
"""
from __future__ import annotations

import shutil
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TREE = REPO / ".api-tree"


def build_tree() -> Path:
    mapping = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    shutil.rmtree(TREE, ignore_errors=True)
    root = TREE / "kvshare"
    root.mkdir(parents=True)
    for entry in (REPO / mapping["kvshare"]).iterdir():
        if entry.name != "__pycache__":
            (root / entry.name).symlink_to(entry)
    for package, folder in mapping.items():
        if package != "kvshare":
            (root / package.split(".", 1)[1]).symlink_to(REPO / folder)
    return TREE


# Built when MkDocs loads this hook, before any plugin's on_config: mkdocstrings drops search
# paths that do not exist when it configures its handler.
build_tree()
