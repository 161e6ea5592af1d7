"""``kvshare eval compare`` on synthetic runs written as ``samples.jsonl`` logs: it reports a
real difference (McNemar significant), equivalence and an undecided case as such, resamples
clusters and seeds, refuses runs of other items with one line, and writes its report."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kvshare.eval import compare
from kvshare.train.data import qa_prompt

REPLICATES = "2000"  # enough for stable intervals, fast


def write_run(folder: Path, scores, contexts=None, task: str = "f1-squad", field: str = "f1") -> Path:
    """A run's log: a header, then one record per item with the layout of ``kvshare eval f1``."""
    folder.mkdir(parents=True)
    header = {"kvshare_eval_log": 1, "settings_hash": f"sha256:{folder.name}", "settings": {"task": task},
              "scoring": 2}
    lines = [header]
    for i, value in enumerate(scores):
        context = contexts[i] if contexts is not None else f"paragraph {i}"
        lines.append({"id": f"q{i}", "prompt": f"<|im_start|>user\n{qa_prompt(f'question {i}?', [('', context)])}",
                      "output": "x", field: float(value), "exact_match": float(value >= 0.5)})
    (folder / "samples.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return folder


def run_cli(cli, *args):
    return cli("eval", "compare", *map(str, args), "--bootstrap", REPLICATES)


def test_a_real_loss_is_reported_as_a_difference_with_mcnemar_significant(tmp_path, cli):
    rng = np.random.default_rng(1)
    lora = (rng.random(300) < 0.6).astype(float)
    icarus = lora.copy()
    icarus[np.flatnonzero(lora)[:45]] = 0  # 45 items lost, 3 gained: -14 points
    icarus[np.flatnonzero(lora == 0)[:3]] = 1
    result = run_cli(cli, f"lora={write_run(tmp_path / 'l', lora)}", f"icarus={write_run(tmp_path / 'i', icarus)}",
                     "--metric", "em", "--out", tmp_path / "out")
    assert result.code == 0, result.err
    row = json.loads((tmp_path / "out" / "compare.json").read_text())["systems"]["icarus"]
    assert row["difference"] == pytest.approx(-14.0)
    assert row["verdict"].startswith("different: costs 14.0 [") and not row["equivalent"]
    assert row["ci95"][1] < -9
    assert row["mcnemar"]["only_reference"] == 45 and row["mcnemar"]["only_other"] == 3
    assert row["mcnemar"]["p"] < 1e-9
    assert "different: costs 14.0" in result.out and "| icarus |" in result.out


def test_a_tiny_difference_on_many_items_is_equivalent_within_the_margin(tmp_path, cli):
    rng = np.random.default_rng(2)
    lora = rng.random(400)
    icarus = np.clip(lora + rng.normal(0, 0.02, 400), 0, 1)
    result = run_cli(cli, f"lora={write_run(tmp_path / 'l', lora)}", f"icarus={write_run(tmp_path / 'i', icarus)}",
                     "--margin", "3", "--out", tmp_path / "out")
    row = json.loads((tmp_path / "out" / "compare.json").read_text())["systems"]["icarus"]
    assert row["equivalent"] and row["verdict"] == "equivalent within ±3"
    assert -3 < row["ci90"][0] < row["difference"] < row["ci90"][1] < 3
    assert row["mcnemar"] is None  # F1 is not pass/fail
    # the same data at a margin the interval does not fit in: not equivalent
    narrow = run_cli(cli, f"lora={tmp_path / 'l'}", f"icarus={tmp_path / 'i'}", "--margin", "0.1")
    assert "equivalent" not in narrow.out.split("| icarus |")[1]


def test_few_noisy_items_are_undecided(tmp_path, cli):
    rng = np.random.default_rng(3)
    lora = rng.random(30)
    icarus = np.clip(lora + rng.normal(0, 0.3, 30), 0, 1)
    result = run_cli(cli, f"lora={write_run(tmp_path / 'l', lora)}", f"icarus={write_run(tmp_path / 'i', icarus)}",
                     "--out", tmp_path / "out")
    row = json.loads((tmp_path / "out" / "compare.json").read_text())["systems"]["icarus"]
    assert row["verdict"] == "undecided"
    assert row["ci95"][0] < 0 < row["ci95"][1] and (row["ci90"][0] < -3 or row["ci90"][1] > 3)


def test_questions_on_one_paragraph_are_resampled_together(tmp_path):
    """20 paragraphs of 10 questions; the systems differ by paragraph, not by question, so the
    items are not independent and the paragraph bootstrap's interval is much wider."""
    rng = np.random.default_rng(4)
    effect = np.repeat(rng.normal(0, 0.2, 20), 10)
    lora = np.full(200, 0.5)
    contexts = [f"paragraph {i // 10}" for i in range(200)]
    write_run(tmp_path / "l", lora, contexts)
    write_run(tmp_path / "i", np.clip(lora + effect + rng.normal(0, 0.02, 200), 0, 1), contexts)

    def width(cluster: str) -> tuple[float, dict]:
        systems = {name: [compare.load_run(tmp_path / name[0], cluster=cluster)] for name in ("lora", "icarus")}
        result = compare.compare_systems(systems, replicates=2000)
        ci = result["systems"]["icarus"]["ci95"]
        return ci[1] - ci[0], result

    clustered, result = width("auto")
    independent, flat = width("none")
    assert result["clusters"] == 20 and result["cluster_source"] == "the QA prompt's context"
    assert flat["clusters"] == 200
    assert clustered > 2.5 * independent
    assert result["systems"]["icarus"]["difference"] == flat["systems"]["icarus"]["difference"]


def test_a_cluster_field_in_the_records_is_used():
    records = [{"id": f"q{i}", "title": f"t{i % 3}", "prompt": "p"} for i in range(9)]
    clusters, source = compare.cluster_keys(records)
    assert source == "title" and len(set(clusters.values())) == 3
    assert compare.cluster_keys(records, "none")[1] == "item"


def test_seeds_are_grouped_per_system_and_resampled(tmp_path, cli):
    """Three seeds each; ICaRus's seeds differ by a whole-run offset. The difference is that of
    the seed-averaged items, and resampling seeds widens the interval over one averaged run."""
    rng = np.random.default_rng(5)
    base = rng.random(200) * 0.8
    lora = [np.clip(base + rng.normal(0, 0.05, 200), 0, 1) for _ in range(3)]
    icarus = [np.clip(base + offset + rng.normal(0, 0.05, 200), 0, 1) for offset in (-0.1, 0.0, 0.1)]
    lora_dirs = [write_run(tmp_path / f"lora-s{s}", v) for s, v in enumerate(lora)]
    icarus_dirs = [write_run(tmp_path / f"icarus-s{s}", v) for s, v in enumerate(icarus)]
    result = run_cli(cli, "lora=" + ",".join(map(str, lora_dirs)), f"icarus={icarus_dirs[0]}",
                     f"icarus={icarus_dirs[1]},{icarus_dirs[2]}", "--out", tmp_path / "out")
    assert result.code == 0, result.err
    report = json.loads((tmp_path / "out" / "compare.json").read_text())
    row = report["systems"]["icarus"]
    assert report["systems"]["lora"]["runs"] == row["runs"] == 3 and len(report["runs"]["icarus"]) == 3
    assert row["difference"] == pytest.approx(100 * (np.mean(icarus, axis=0) - np.mean(lora, axis=0)).mean())
    assert row["mcnemar"] is None
    write_run(tmp_path / "lora-mean", np.mean(lora, axis=0))
    write_run(tmp_path / "icarus-mean", np.mean(icarus, axis=0))
    averaged = compare.compare_systems({n: [compare.load_run(tmp_path / f"{n}-mean")] for n in ("lora", "icarus")},
                                       replicates=2000)["systems"]["icarus"]
    assert averaged["difference"] == pytest.approx(row["difference"])
    assert row["ci95"][1] - row["ci95"][0] > 2 * (averaged["ci95"][1] - averaged["ci95"][0])


def test_the_share_of_the_references_gain_over_the_base(tmp_path, cli):
    rng = np.random.default_rng(6)
    noise = lambda: rng.normal(0, 0.05, 300)  # noqa: E731
    runs = {"base": 0.2 + noise(), "lora": 0.6 + noise(), "icarus": 0.5 + noise()}
    args = [f"{name}={write_run(tmp_path / name, np.clip(v, 0, 1))}" for name, v in runs.items()]
    result = run_cli(cli, *args, "--reference", "lora", "--base", "base", "--out", tmp_path / "out")
    report = json.loads((tmp_path / "out" / "compare.json").read_text())
    share = report["systems"]["icarus"]["gain_share"]
    assert share["share"] == pytest.approx(0.75, abs=0.03)
    assert share["ci95"][0] < share["share"] < share["ci95"][1] and share["ci95"][1] - share["ci95"][0] < 0.1
    assert share["reference_gain"] == pytest.approx(40, abs=1.5)
    assert report["systems"]["base"]["gain_share"] is None and "lora" == report["reference"]
    assert "share of lora's gain over base" in result.out


def test_the_report_files_and_their_provenance(tmp_path, cli):
    lora, icarus = np.linspace(0, 1, 50), np.linspace(0, 1, 50)[::-1]
    result = run_cli(cli, write_run(tmp_path / "lora", lora), write_run(tmp_path / "icarus", icarus),
                     "--seed", "7", "--out", tmp_path / "out")
    assert result.code == 0, result.err
    out = tmp_path / "out"
    assert (out / "compare.md").read_text() == result.out
    assert (out / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = json.loads((out / "compare.json").read_text())
    assert report["reference"] == "lora" and report["metric"] == "f1" and report["task"] == "f1-squad"
    assert report["bootstrap"] == {"replicates": 2000, "seed": 7} and report["unit"].startswith("points")
    prov = report["provenance"]
    assert prov["command"].startswith("kvshare eval compare ") and "--seed 7" in prov["command"]
    assert prov["cpu"] and prov["python"] and set(prov["versions"]) == {"numpy", "scipy", "matplotlib"}
    assert "commit" in prov and isinstance(prov["cpu_flags"], list)
    again = run_cli(cli, tmp_path / "lora", tmp_path / "icarus", "--seed", "7")
    assert again.out == result.out  # seeded: the same intervals


def test_mistakes_are_one_line_errors(tmp_path, cli):
    from conftest import assert_one_line_error

    a = write_run(tmp_path / "a", np.zeros(10))
    b = write_run(tmp_path / "b", np.zeros(8))
    assert_one_line_error(run_cli(cli, a, b), "do not cover the same items", "lacks 2 of its 10")
    assert_one_line_error(run_cli(cli, f"x={a}", f"x={a}"), "at least two systems", "not 1")
    assert_one_line_error(run_cli(cli, a, a), "two runs are named 'a'")
    c = write_run(tmp_path / "c", np.zeros(10))
    assert_one_line_error(run_cli(cli, a, c, "--metric", "bleu"), "10 of 10 items have no numeric 'bleu'")
    assert_one_line_error(run_cli(cli, a, c, "--reference", "lora"), "--reference lora: no such system")
    assert_one_line_error(run_cli(cli, a, c, "--base", "a"), "same system")
    assert_one_line_error(run_cli(cli, a, tmp_path / "nowhere"), "no samples.jsonl")
    d = write_run(tmp_path / "d", np.zeros(10), task="gsm8k", field="f1")
    assert_one_line_error(run_cli(cli, a, d, "--metric", "f1"), "different tasks")
    assert_one_line_error(cli("eval", "--out", tmp_path / "o", "compare"), "right after 'compare'")


def test_eval_keeps_its_task_usage_and_compare_has_its_own_help(cli):
    assert cli("eval", "compare", "--help").code == 0
    help_text = cli("eval", "compare", "--help").out
    assert "TOST" in help_text and "NAME=" in help_text and "x100" in help_text
    usage = cli("eval", "--help").out
    assert "compare" in usage and "gsm8k" in usage
    assert cli("eval", "poetry", "--out", "x").code == 2


def test_the_qa_marker_is_the_qa_prompts_layout():
    prompt = qa_prompt("Who?", [("", "A paragraph.")])
    assert prompt.rpartition(compare.QA_MARKER)[0] == "A paragraph."


def test_mcnemar_and_tost_on_known_cases():
    reference = np.array([1, 1, 1, 1, 0, 0, 1, 0], dtype=float)
    other = np.array([0, 0, 0, 1, 0, 1, 1, 0], dtype=float)
    test = compare.mcnemar(reference, other)
    assert (test["only_reference"], test["only_other"]) == (3, 1) and test["p"] == pytest.approx(0.625)
    assert compare.tost([-2.9, 2.9], 3) and not compare.tost([-3.1, 1], 3)
    assert compare.verdict(2.0, [0.5, 3.5], [0.8, 3.2], 3) == "different: gains 2.0 [0.5, 3.5]"


def test_runs_alike_on_every_item_are_bounded_by_what_few_items_could_hide(tmp_path, cli):
    """No item differs: the bootstrap's interval would be the point 0; the exact bound on the
    share of items that could differ unseen decides instead (0 of 100: 2.95 points)."""
    rng = np.random.default_rng(7)
    scores = (rng.random(100) < 0.3).astype(float)
    many = run_cli(cli, f"lora={write_run(tmp_path / 'l', scores)}", f"icarus={write_run(tmp_path / 'i', scores)}",
                   "--out", tmp_path / "many")
    row = json.loads((tmp_path / "many" / "compare.json").read_text())["systems"]["icarus"]
    assert many.code == 0 and row["ci90"] == pytest.approx([-2.95, 2.95], abs=0.01) and row["equivalent"]
    write_run(tmp_path / "l40", scores[:40])
    write_run(tmp_path / "i40", scores[:40])
    run_cli(cli, f"lora={tmp_path / 'l40'}", f"icarus={tmp_path / 'i40'}", "--out", tmp_path / "few")
    row = json.loads((tmp_path / "few" / "compare.json").read_text())["systems"]["icarus"]
    assert row["verdict"] == "undecided" and row["ci90"][1] > 7


def test_too_few_clusters_get_no_verdict(tmp_path):
    write_run(tmp_path / "l", np.ones(12))
    write_run(tmp_path / "i", np.zeros(12))
    result = compare.compare_systems({n: [compare.load_run(tmp_path / n)] for n in ("l", "i")}, replicates=500)
    assert result["systems"]["i"]["verdict"].startswith("undecided: 12 clusters, too few")
    assert not result["systems"]["i"]["equivalent"]


def test_no_share_of_a_gain_the_reference_does_not_make(tmp_path, cli):
    scores = np.linspace(0, 1, 40)
    args = [f"{n}={write_run(tmp_path / n, s)}" for n, s in (("lora", scores), ("icarus", scores[::-1]),
                                                               ("base", np.clip(scores + 0.2, 0, 1)))]
    result = run_cli(cli, *args, "--base", "base", "--out", tmp_path / "out")
    share = json.loads((tmp_path / "out" / "compare.json").read_text())["systems"]["icarus"]["gain_share"]
    assert share["share"] is None and "does not beat the base" in result.out


def test_a_committed_compressed_log_compares_like_the_log_itself(tmp_path, cli):
    """Results folders commit ``samples.jsonl.gz``: compare reads it where no log is beside it."""
    import gzip

    rng = np.random.default_rng(5)
    lora, icarus = rng.random(200), rng.random(200)
    plain = run_cli(cli, f"lora={write_run(tmp_path / 'l', lora)}", f"icarus={write_run(tmp_path / 'i', icarus)}")
    for run in ("l", "i"):
        log = tmp_path / run / "samples.jsonl"
        (tmp_path / run / "samples.jsonl.gz").write_bytes(gzip.compress(log.read_bytes()))
        log.unlink()
    packed = run_cli(cli, f"lora={tmp_path / 'l'}", f"icarus={tmp_path / 'i'}")
    assert packed.code == 0, packed.err
    assert packed.out == plain.out and "| icarus |" in packed.out
