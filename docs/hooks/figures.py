"""MkDocs hook: every figure a page quotes is found in the results it links.

A *figure block* is a paragraph, a list item or a table of a page that links something under
``results/`` (a table may take its links from the paragraph just before or after it). Every decimal number in it (``33.7``, ``2.33x``, ``0.88-0.98x``; not versions
such as ``0.3.36``, not inside code spans or links) must be found in what it links: in the text
of a linked file, or as a JSON number that rounds to it. A linked folder, or a folder's
README.md, stands for every text file in that folder and below. On the benchmark pages every
block with a decimal number must link its results. A figure not found is a warning, so
``mkdocs build --strict`` fails on it.
"""
from __future__ import annotations

import json
import logging
import re
from decimal import Decimal
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
RESULTS = REPO / "results"
MUST_LINK = ("benchmarks/",)
TEXT_SUFFIXES = {".json", ".md", ".txt", ".csv", ".jsonl"}
log = logging.getLogger("mkdocs.plugins.kvshare.figures")

_FENCE = re.compile(r"^\s*(```|~~~)")
_LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)\s]*)?\)")
_CODE = re.compile(r"`[^`]*`")
_NUMBER = re.compile(r"(?<![\w.])\d+\.\d+(?![\w.]*\d)")  # 33.7, 2.33x; not 0.3.36
_ITEM = re.compile(r"^\s*([-*]|\d+\.)\s")


def blocks(markdown: str) -> list[str]:
    """Paragraphs, list items and tables, outside fenced code."""
    out, current, fenced, kind = [], [], False, None

    def close():
        if current:
            out.append("\n".join(current))
        current.clear()

    for line in markdown.splitlines():
        if _FENCE.match(line):
            close()
            fenced = not fenced
            continue
        if fenced:
            continue
        if not line.strip():
            close()
            kind = None
            continue
        line_kind = "table" if line.lstrip().startswith("|") else "text"
        if _ITEM.match(line) or line.lstrip().startswith("#") or line_kind != kind:
            close()
        kind = line_kind
        current.append(line)
    close()
    return out


def numbers(block: str) -> list[str]:
    text = _LINK.sub("]()", _CODE.sub("", block))
    return _NUMBER.findall(text)


def _json_numbers(value, found: set[float]) -> None:
    if isinstance(value, bool):
        return
    if isinstance(value, (int, float)):
        found.add(float(value))
    elif isinstance(value, dict):
        for item in value.values():
            _json_numbers(item, found)
    elif isinstance(value, list):
        for item in value:
            _json_numbers(item, found)


class Source:
    """The text and JSON numbers of the results a block links."""

    _cache: dict[Path, tuple[str, set[float]]] = {}

    def __init__(self, paths: list[Path]):
        self.texts, self.values = [], set()
        for path in paths:
            text, values = self._read(path)
            self.texts.append(text)
            self.values |= values

    @classmethod
    def _read(cls, path: Path) -> tuple[str, set[float]]:
        if path not in cls._cache:
            text, values = path.read_text(encoding="utf-8", errors="replace"), set()
            if path.suffix == ".json":
                try:
                    _json_numbers(json.loads(text), values)
                except ValueError:
                    pass
            cls._cache[path] = (text, values)
        return cls._cache[path]

    def holds(self, number: str) -> bool:
        pattern = re.compile(r"(?<![\d.])" + re.escape(number) + r"(?!\d)")
        if any(pattern.search(text) for text in self.texts):
            return True
        places = Decimal(number).as_tuple().exponent
        target = Decimal(number)
        return any(Decimal(repr(abs(v))).quantize(Decimal(1).scaleb(places)) == target for v in self.values)


def linked_results(page: Path, block: str, results: Path = RESULTS) -> list[Path]:
    """The results files a block links (a folder or README: every text file below it)."""
    files = []
    for target in _LINK.findall(block):
        if "://" in target:
            continue
        path = (page.parent / target).resolve()
        if results not in path.parents and path != results:
            continue
        if path.name == "README.md":
            path = path.parent
        if path.is_dir():
            files += sorted(p for p in path.rglob("*") if p.suffix in TEXT_SUFFIXES and p.is_file())
        elif path.is_file():
            files.append(path)
    return files


def check_page(page: Path, docs: Path = DOCS, results: Path = RESULTS) -> list[str]:
    """One line per figure the page quotes that its linked results do not hold."""
    problems = []
    relative = page.relative_to(docs).as_posix()
    found = blocks(page.read_text(encoding="utf-8"))
    for index, block in enumerate(found):
        figures = numbers(block)
        if not figures:
            continue
        linked = linked_results(page, block, results)
        if not linked and block.lstrip().startswith("|"):  # a table's source: the line before or after it
            neighbours = found[max(index - 1, 0):index] + found[index + 1:index + 2]
            linked = [p for other in neighbours for p in linked_results(page, other, results)]
        if not linked:
            if relative.startswith(MUST_LINK):
                problems.append(f"{relative}: figures {', '.join(figures)} link no results: {block[:80]!r}")
            continue
        source = Source(linked)
        missing = [f for f in figures if not source.holds(f)]
        if missing:
            problems.append(f"{relative}: {', '.join(missing)} not found in {', '.join(sorted({p.relative_to(results.parent).as_posix() for p in linked})[:3])}"
                            f"{' ...' if len(linked) > 3 else ''}: {block[:80]!r}")
    return problems


def on_page_markdown(markdown: str, page, config, files) -> str:
    path = Path(page.file.abs_src_path)
    if DOCS in path.parents:
        for problem in check_page(path):
            log.warning(problem)
    return markdown


if __name__ == "__main__":
    import sys

    pages = [Path(p).resolve() for p in sys.argv[1:]] or sorted(DOCS.rglob("*.md"))
    found = [problem for page in pages for problem in check_page(page)]
    print("\n".join(found) or "every quoted figure is found in the results it links")
    sys.exit(1 if found else 0)
