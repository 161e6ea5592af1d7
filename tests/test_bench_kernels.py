"""``kvshare bench kernels``: every backend's paged attention is checked against SDPA over the
same gathered K/V before it is timed, and the report has a row per case and a column per
backend. On CPU Triton runs in its interpreter (tiny shapes: a correctness run, not a speed)."""

from __future__ import annotations

import json

import pytest

from conftest import assert_one_line_error

pytest.importorskip("triton")


def test_bench_kernels_times_each_backend_after_checking_it_against_sdpa(cli, tmp_path):
    result = cli("bench", "kernels", "--device", "cpu", "--dtype", "float32", "--shapes", "smollm2-135m",
                 "--batches", "2", "--contexts", "40", "--lora-rows", "16", "--kernels", "torch", "triton",
                 "--threads", "1", "--out", tmp_path)
    assert result.code == 0, result.err
    report = json.loads((tmp_path / "kernel_bench.json").read_text())
    assert report["backends"] == ["torch", "triton"] and report["timings"] == ["launch"]  # no CUDA graphs on CPU
    assert [(r["rows"], r["batch"], r["context"]) for r in report["attention"]] == [("decode", 2, 40), ("icarus pair", 2, 40)]
    for row in report["attention"]:
        assert row["triton_rel_err"] < 1e-5 and row["torch_rel_err"] < 1e-5 and row["triton_ms"] > 0
    (lora,) = report["lora"]
    assert lora["rows"] == 16 and lora["triton_8_adapters_ms"] > 0 and lora["torch_1_adapters_ms"] > 0
    assert lora["bgmv_8_adapters_ms"] > 0  # the CUDA-graph step's LoRA, checked against the reference first
    table = (tmp_path / "kernel_bench.md").read_text()
    assert "triton / SDPA" in table and "triton 8 / 1" in table and "bgmv 8 / 1" in table and table in result.out


def test_bench_kernels_refuses_what_it_cannot_run(cli):
    assert_one_line_error(cli("bench", "kernels", "--device", "cpu", "--shapes", "gpt-5"), "unknown shape 'gpt-5'")
    assert_one_line_error(cli("bench", "kernels", "--device", "cpu", "--kernels", "cutlass"), "cutlass")
