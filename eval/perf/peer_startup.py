"""The peers' start-ups beside kvshare's in ``kvshare bench startup``: vLLM's CPU build as an
OpenAI server and llama.cpp through llama-cpp-python, each a fresh process timed from its
launch to its first token, as :mod:`.startup` times kvshare.

vLLM: cold over empty compile caches (its own ``VLLM_CACHE_ROOT`` and Inductor's), warm over
the ones the cold start filled; the base alone and with the same random LoRA adapters
kvshare loads (``--lora-modules``); the first token is one base completion over loopback,
sent as soon as ``/health`` answers. Its peak RSS is sampled every 0.2 s over the server's
process tree (API server and engine core) and summed: pages the processes share count twice.
llama.cpp has no compile cache, so one start: the zoo's Q4_1 GGUF (llama.cpp's own format;
it has no float32 file of the model), base only.
"""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.request
from pathlib import Path

import psutil

from ...loopback import free_port
from .common import folder_mb
from .peers import (LLAMACPP_VERSION, VLLM_VERSION, VLLMServer, _run_probe, ensure_llamacpp_venv,
                    ensure_vllm_venv, kv_space_gib, llamacpp_gguf, vllm_serve_command)

LLAMACPP_STARTUP_PROBE = Path(__file__).with_name("llamacpp_startup_probe.py")  # imports llama_cpp only


class TreePeakRss:
    """The peak of a process's and its descendants' summed RSS, sampled on a thread."""

    def __init__(self, pid: int, every: float = 0.2):
        self.root, self.every, self.peak = psutil.Process(pid), every, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.is_set():
            total = 0
            try:
                for process in [self.root, *self.root.children(recursive=True)]:
                    total += process.memory_info().rss
            except psutil.Error:  # a process ended between the listing and the read
                pass
            self.peak = max(self.peak, total)
            self._stop.wait(self.every)

    def stop_mb(self) -> float:
        self._stop.set()
        self._thread.join()
        return self.peak / 2**20


def vllm_starts(venv: Path | None, model_dir: Path, adapters: list[Path], prompt: str, dtype: str, threads: int,
                kv_pool_bytes: int, scratch: Path) -> dict:
    """vLLM's four starts: the base and the base with ``adapters``, cold then warm."""
    venv = ensure_vllm_venv(venv)
    runs = {}
    for label, chosen in (("base", []), (f"{len(adapters)} adapters", adapters)):
        caches = scratch / f"vllm-caches-{len(chosen)}"  # empty: the cold start fills it
        for phase in ("cold", "warm"):
            runs[f"{label}, {phase}"] = _vllm_start(venv, model_dir, chosen, prompt, dtype, threads, kv_pool_bytes,
                                                    caches, scratch / f"vllm-{len(chosen)}-{phase}.log")
    return {"version": VLLM_VERSION, "runs": runs}


def _vllm_start(venv: Path, model_dir: Path, adapters: list[Path], prompt: str, dtype: str, threads: int,
                kv_pool_bytes: int, caches: Path, log: Path) -> dict:
    port = free_port()
    named = {f"lora-{i}": path for i, path in enumerate(adapters)}
    command = vllm_serve_command(venv, model_dir, named, port, dtype, max_model_len=2048)
    server = VLLMServer(command, port, threads, kv_space_gib(kv_pool_bytes), log)
    server.env |= {"VLLM_CACHE_ROOT": str(caches / "vllm"), "TORCHINDUCTOR_CACHE_DIR": str(caches / "inductor")}
    started = time.time()
    with server:
        rss = TreePeakRss(server.process.pid)
        up = time.time() - started
        body = json.dumps({"model": "base", "prompt": prompt, "max_tokens": 1, "temperature": 0}).encode()
        request = urllib.request.Request(f"{server.base_url}/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=600) as reply:
            json.loads(reply.read())
        first_token = time.time() - started
        peak = rss.stop_mb()
    return {"loaded_s": up, "first_token_s": first_token, "peak_rss_mb": peak, "cache_mb": folder_mb(caches)}


def llamacpp_start(venv: Path | None, model_dir: Path, prompt: str, threads: int, scratch: Path) -> dict:
    """One llama.cpp start on the model's GGUF, base only."""
    venv = ensure_llamacpp_venv(venv)
    gguf = llamacpp_gguf(model_dir)
    command = [str(Path(venv) / "bin" / "python"), "-P", str(LLAMACPP_STARTUP_PROBE.resolve()), "--gguf", str(gguf),
               "--prompt", prompt, "--threads", str(threads), "--t0", str(time.time())]
    figures = _run_probe("llama.cpp", command, dict(os.environ, OMP_NUM_THREADS=str(threads)),
                         scratch / "llamacpp-startup.log", timeout=600)
    return {"version": LLAMACPP_VERSION, "gguf": gguf.name, "runs": {"base": figures}}
