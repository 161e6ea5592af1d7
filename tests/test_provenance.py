"""Every results JSON records the command, the commit, the machine and the versions."""
from __future__ import annotations

import json
import subprocess
import sys

from kvshare.provenance import provenance


def test_the_block_names_command_commit_machine_and_versions():
    block = provenance(["kvshare", "bench", "engine", "--out", "a dir"])
    assert block["command"] == "kvshare bench engine --out 'a dir'"
    assert block["cpu"] and block["python"] and block["cpu_count"] >= 1
    assert set(block["versions"]) >= {"torch", "transformers"} and block["versions"]["torch"].startswith("2.13")
    assert "commit" in block and all(flag.startswith(("avx", "amx", "fma", "f16c", "sse4")) for flag in block["cpu_flags"])


def test_every_benchmark_report_is_stamped(tmp_path):
    from kvshare.eval.perf.common import write_report

    write_report({"figure": 1.5}, tmp_path, "bench", lambda r: f"figure {r['figure']}\n")
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert saved["figure"] == 1.5 and saved["provenance"]["versions"]["torch"]
    assert (tmp_path / "bench.md").read_text() == "figure 1.5\n"


def test_scripts_stamp_their_results_from_the_command_line(tmp_path):
    out = tmp_path / "provenance.json"
    subprocess.run([sys.executable, "-m", "kvshare.provenance", str(out), "kvshare", "eval", "f1"], check=True)
    assert json.loads(out.read_text())["command"] == "kvshare eval f1"
