"""MkDocs hook: pages link repository files outside docs/ by their real relative path.

A page such as ``docs/benchmarks/engine.md`` links ``../../results/engine/engine_bench.json``,
which works when the Markdown is read in the repository. MkDocs sees only ``docs/``, so this
hook adds every repository file a page links (and, for a linked Markdown file, what that one
links in turn) to the site under ``repo/`` and rewrites the links to point there. Links into
folders go to their README.md. A link to a missing file is left alone, so ``--strict`` fails
on it as on any broken link.
"""
from __future__ import annotations

import os
import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File, Files

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
PREFIX = "repo"
_LINK = re.compile(r"(\]\()([^)\s#]+)((?:#[^)\s]*)?\))")
_FENCE = re.compile(r"^(```|~~~)")


def _outside_target(source: Path, target: str) -> Path | None:
    """The repository file a relative link of ``source`` names, if it lies outside docs/."""
    if "://" in target or target.startswith(("/", "mailto:")):
        return None
    path = (source.parent / target).resolve()
    if path.is_dir() and (path / "README.md").is_file():
        path = path / "README.md"
    if not path.is_file() or REPO not in path.parents or DOCS in path.parents:
        return None
    return path


def _links(markdown: str) -> list[str]:
    """Link targets outside fenced code blocks."""
    found, fenced = [], False
    for line in markdown.splitlines():
        if _FENCE.match(line.lstrip()):
            fenced = not fenced
        elif not fenced:
            found += [m.group(2) for m in _LINK.finditer(line)]
    return found


def _site_uri(path: Path) -> str:
    return f"{PREFIX}/{path.relative_to(REPO).as_posix()}"


def on_files(files: Files, config) -> Files:
    todo = [Path(f.abs_src_path) for f in files if f.is_documentation_page()]
    seen: set[Path] = set()
    while todo:
        source = todo.pop()
        for target in _links(source.read_text(encoding="utf-8")):
            path = _outside_target(source, target)
            if path is None or path in seen:
                continue
            seen.add(path)
            files.append(File.generated(config, _site_uri(path), abs_src_path=str(path)))
            if path.suffix == ".md":
                todo.append(path)
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    source = Path(page.file.abs_src_path)
    here = posixpath.dirname(page.file.src_uri)

    def rewrite(match: re.Match) -> str:
        path = _outside_target(source, match.group(2))
        if path is None:
            return match.group(0)
        return match.group(1) + posixpath.relpath(_site_uri(path), here or ".") + match.group(3)

    out, fenced = [], False
    for line in markdown.splitlines(keepends=True):
        if _FENCE.match(line.lstrip()):
            fenced = not fenced
        out.append(line if fenced else _LINK.sub(rewrite, line))
    return "".join(out)
