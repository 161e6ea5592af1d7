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
