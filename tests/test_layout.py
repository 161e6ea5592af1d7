"""Packaging: one namespace over the fixed layout, one CLI with --help everywhere."""

from __future__ import annotations

import importlib
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SUBSYSTEMS = {"train": "train", "serve": "serve", "kernels": "kernels", "eval": "eval"}


@pytest.mark.parametrize("sub,folder", SUBSYSTEMS.items())
def test_subsystems_map_to_root_folders(sub, folder):
    module = importlib.import_module(f"kvshare.{sub}")
    assert Path(module.__file__).resolve().parent == ROOT / folder


def test_core_is_kvshare_and_schema_ships():
    import kvshare
    from kvshare import manifest

    assert Path(kvshare.__file__).resolve().parent == ROOT / "core"
    assert manifest.SCHEMA_PATH.is_file()


HELP_COMMANDS = [
    [], ["models"], ["models", "pull"], ["models", "list"], ["models", "path"],
    ["models", "fingerprint"], ["export"], ["inspect"], ["demo"], ["train"], ["plot-loss"],
    ["bench"], ["bench", "engine"], ["bench", "kernels"], ["bench", "workflow"], ["bench", "alora"], ["bench", "kvflow"], ["bench", "quant"], ["serve"], ["story"], ["eval"], ["eval", "compare"],
]


@pytest.mark.parametrize("argv", HELP_COMMANDS, ids=lambda a: " ".join(a) or "kvshare")
def test_every_subcommand_has_help(cli, argv):
    result = cli(*argv, "--help")
    assert result.code == 0
    assert "usage: kvshare" in result.out


def test_console_script_and_module_entry_points():
    exe = Path(sys.executable).with_name("kvshare")
    for cmd in ([str(exe), "--version"], [sys.executable, "-m", "kvshare", "--version"]):
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.startswith("kvshare ")


def test_trainer_module_entry_point_has_help():
    proc = subprocess.run([sys.executable, "-m", "kvshare.train", "--help"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and "RECIPE.yaml" in proc.stdout


def test_missing_subcommand_is_a_usage_error(cli):
    result = cli()
    assert result.code == 2
    assert "Traceback" not in result.err


def test_regular_wheel_install_imports_every_subsystem(tmp_path):
    """A normal (non-editable) install: build the wheel, unpack it, import from it alone."""
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-cache-dir",
         "-w", str(tmp_path / "dist"), str(ROOT)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    wheel = next((tmp_path / "dist").glob("kvshare-*.whl"))
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        archive.extractall(site)
    for expected in ("kvshare/__init__.py", "kvshare/train/__init__.py", "kvshare/serve/__init__.py",
                     "kvshare/kernels/__init__.py", "kvshare/eval/__init__.py", "kvshare/serve/http/__init__.py",
                     "kvshare/serve/cache/__init__.py", "kvshare/eval/perf/__init__.py",
                     "kvshare/schemas/manifest.schema.json", "kvshare/serve/vllm_plugin/__init__.py"):
        assert expected in names
    entry_points = next(site.glob("kvshare-*.dist-info")) / "entry_points.txt"
    assert "[vllm.general_plugins]\nkvshare = kvshare.serve.vllm_plugin:register" in entry_points.read_text()
    code = ("import kvshare, kvshare.train, kvshare.serve, kvshare.kernels, kvshare.eval;"
            "import kvshare.serve.cache, kvshare.serve.http, kvshare.eval.perf.engine, kvshare.cli;"
            "from kvshare import manifest; manifest.schema(); print(kvshare.__file__)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=tmp_path, env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"},
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().startswith(str(site))
