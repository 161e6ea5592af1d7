"""``kvshare bench swiftcache`` end to end on the tiny model: all three modes run, lending
serves a longer context than the static partition, the layer stream as long as its buffer
and the lenders allow, the ratios are those of the measured figures,
and the report files are written. Speed is printed, not asserted."""

from __future__ import annotations

import json

import pytest

from conftest import assert_one_line_error

TINY = dict(agents=2, home_tokens=128, agent_home_tokens=128, long_requests=3, long_qps=1000.0,
            long_fraction=(0.6, 0.9), long_output=4, chats=4, chat_qps=1000.0, chat_tokens=24, chat_output=4,
            block_size=8, chunk_tokens=64)


def test_swiftcache_bench_measures_both_modes_and_writes_its_report(tiny_models, tmp_path):
    from kvshare.eval.perf.swiftcache import run_swiftcache_bench

    results = run_swiftcache_bench(model=str(tiny_models("llama")), out_dir=tmp_path, **TINY)
    static, lending = results["modes"]["static"], results["modes"]["lending"]

    # maximum context: the static share vs every block the agents may lend (all but their 25% floors)
    assert static["max_context"]["kv_blocks"] == static["home_blocks"]["long"] == 128 // 8
    assert lending["max_context"]["kv_blocks"] == 16 + 2 * (16 - 4)
    # layer stream: the long model's share is 16 x 2 layers rows; the agents can lend 2 x 12 blocks,
    # so it keeps (32 - 24) // 3 = 2 home blocks and 28 buffer rows, and holds 2 + 24 blocks
    stream = results["modes"]["lending+stream"]
    assert stream["home_blocks"]["long"] == 2
    assert stream["max_context"]["kv_blocks"] == min(32 - 2 * 2, 2 + 2 * (16 - 4))
    assert stream["mixed"]["failed"] == 0 and stream["mixed"]["long_stream"]["stream_layers_loaded"] > 0
    for mode in (static, lending):
        c = mode["max_context"]
        assert c["refuses_one_more_token"] and c["output_tokens"] == 4
        assert c["context_tokens"] == c["kv_blocks"] * 8 == c["prompt_tokens"] + 4

    # mixed workload: every request served; only the lending mode moves units
    for mode in (static, lending):
        m = mode["mixed"]
        assert m["requests"] == 3 + 4 and m["long_requests"] == 3 and m["chats"] == 4 and m["failed"] == 0
        assert all(r["output_tokens"] == 4 and r["ttft_s"] > 0 for r in mode["records"])
        longs = [r["prompt_tokens"] + 4 for r in mode["records"] if r["kind"] == "long"]
        assert all(0.6 * 128 - 1 <= n <= 0.9 * 128 + 1 for n in longs)  # one fits the share, two do not
    assert static["mixed"]["units_moved"] == 0 and static["mixed"]["max_lent_bytes"] == 0
    assert lending["mixed"]["units_moved"] > 0 and lending["mixed"]["max_lent_bytes"] > 0
    assert lending["mixed"]["max_long_kv_bytes"] > static["mixed"]["max_long_kv_bytes"]

    # ratios come from the figures above
    r = results["ratios"]
    assert r["max_context_ratio"] == lending["max_context"]["context_tokens"] / static["max_context"]["context_tokens"]
    assert r["long_p99_ttft_reduction"] == pytest.approx(
        1 - lending["mixed"]["long_p99_ttft_s"] / static["mixed"]["long_p99_ttft_s"])
    assert r["agent_mean_tpot_ratio"] == pytest.approx(
        lending["mixed"]["agent_mean_tpot_s"] / static["mixed"]["agent_mean_tpot_s"])
    assert r["goals"]["max_context_ratio"] is (r["max_context_ratio"] >= 2)

    saved = json.loads((tmp_path / "swiftcache_bench.json").read_text())
    assert saved["ratios"] == json.loads(json.dumps(r)) and set(saved["modes"]) == {"static", "lending", "lending+stream"}
    md = (tmp_path / "swiftcache_bench.md").read_text()
    assert "| lending+stream |" in md and "| static |" in md and "| lending |" in md and "streamed" in md
    assert f"{r['max_context_ratio']:.2f}x" in md and "kvshare bench swiftcache" in md and "float32" in md
    assert (tmp_path / "swiftcache_bench.png").stat().st_size > 0


@pytest.mark.parametrize("args, message", [
    (["--long-fraction", "0.4", "0.9"], "--long-fraction"),
    (["--agents", "0"], "--agents"),
    (["--chat-qps", "0"], "--chat-qps"),
    (["--agent-home-tokens", "16"], "--agent-home-tokens"),
])
def test_bad_swiftcache_bench_flags_are_one_line_errors(tiny_models, cli, args, message):
    assert_one_line_error(cli("bench", "swiftcache", "--model", str(tiny_models("llama")), *args), message)
