"""The vLLM peer of the workflow benchmark: its command line, its venv check, and the server
lifecycle (start, health wait, metrics, prefix-cache reset, stop) against a stand-in
``vllm`` executable. vLLM itself runs only in the benchmark (README), never in CI."""

from __future__ import annotations

import stat
import sys
import textwrap
from pathlib import Path

import pytest

from kvshare.errors import KvshareError
from kvshare.eval.perf.peers import VLLMServer, ensure_vllm_venv, free_port, vllm_serve_command

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
        ensure_vllm_venv(tmp_path / "absent", create=False)
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
    assert ensure_vllm_venv(venv, create=False) == venv
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
