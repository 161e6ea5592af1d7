"""The quality suite on a tiny model: every system of adapters is scored on every task, the
tables come out, and the KV-sharing column shows each kind's rule at work (ICaRus and aLoRA
adapters reuse each other's prompt KV, LoRA adapters never do). A rerun regenerates nothing."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import yaml

pytest.importorskip("evalplus")

from kvshare.errors import KvshareError  # noqa: E402
from kvshare.eval.suite import SuiteSpec, run_suite  # noqa: E402
from kvshare.export import export_adapter  # noqa: E402
from kvshare.testing import ICARUS_TARGETS, make_peft_adapter, make_tiny_model  # noqa: E402
from kvshare.yamlspec import load_spec  # noqa: E402

INVOCATIONS = {"math": "<|im_start|>math<|im_end|>", "code": "<|im_start|>code<|im_end|>",
               "qa": "<|im_start|>qa<|im_end|>"}


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("suite")
    base = make_tiny_model(root / "base", max_position_embeddings=8192)  # HotpotQA: ~6k tiny-BPE tokens
    tokenizer = AutoTokenizer.from_pretrained(base)
    targets = {"icarus": ICARUS_TARGETS, "alora": ["q_proj", "k_proj", "v_proj"], "lora": ["q_proj", "v_proj"]}
    systems = {}
    for seed, kind in enumerate(targets):
        systems[kind] = {}
        for offset, domain in enumerate(INVOCATIONS):
            invocation = INVOCATIONS[domain] if kind == "alora" else None
            tokens = tokenizer.encode(invocation, add_special_tokens=False) if invocation else None
            ckpt = make_peft_adapter(base, root / f"ckpt-{domain}-{kind}", target_modules=targets[kind],
                                     invocation_tokens=tokens, seed=10 * seed + offset)
            systems[kind][domain] = str(export_adapter(ckpt, kind=kind, base=base, out=root / f"{domain}-{kind}",
                                                       invocation=invocation))
    spec = {"model": str(base), "dtype": "float32", "batch": 2, "kv_cache_tokens": 65536,
            "limits": {"gsm8k": 2, "humanevalplus": 1, "hotpotqa": 1},
            "max_tokens": {"gsm8k": 8, "humanevalplus": 8, "hotpotqa": 4}, "systems": systems,
            "cross": ["icarus", "alora", "lora"]}
    (root / "suite.yaml").write_text(yaml.safe_dump(spec))
    return root


def test_suite_scores_every_system_and_shows_each_kinds_sharing(suite):
    report = run_suite(suite / "suite.yaml", suite / "out")
    quality = json.loads((suite / "out" / "quality.json").read_text())
    assert set(quality["rows"]) == {"base", "icarus", "alora", "lora"}
    assert set(quality["icarus_vs_lora"]) == {"GSM8K", "GSM8K strict", "HumanEval", "HumanEval+", "HotpotQA F1"}
    assert all(row["GSM8K"]["n"] == 2 and row["HotpotQA F1"]["n"] == 1 for row in quality["rows"].values())
    for kind in ("icarus", "alora"):  # paired with LoRA item by item, every column
        pairs = quality[f"{kind}_vs_lora"]
        assert set(pairs) == set(quality["icarus_vs_lora"]) and all(p["paired"] for p in pairs.values())
        gsm8k = pairs["GSM8K"]
        assert gsm8k["items"] == 2 and gsm8k["margin"] == 3.0 and gsm8k["paired"]["mcnemar"] is not None
        assert gsm8k["paired"]["difference"] == pytest.approx(100 * (quality["rows"][kind]["GSM8K"]["mean"]
                                                                     - quality["rows"]["lora"]["GSM8K"]["mean"]))
    assert "equivalent iff the 90% interval lies inside ±3" in (suite / "out" / "quality.md").read_text()
    rows = [r["row"] for r in report["orchestration"]["rows"]]
    assert rows[0] == "base" and len(rows) == 1 + 9 + 3  # base, nine single adapters, three routed systems
    sharing = report["orchestration"]["sharing"]
    # three ICaRus adapters on the same prompts: two of every three prompts come from cache;
    # aLoRA shares up to each adapter's invocation; LoRA adapters reuse only their own KV
    # (the chat template's common head), never each other's
    assert sharing["icarus"]["cached_fraction"] > 0.6 and sharing["alora"]["cached_fraction"] > 0.6
    assert sharing["lora"]["cached_fraction"] < 0.1
    for system in sharing.values():  # per task too, and the total is their sum
        assert list(system["by_task"]) == ["gsm8k", "humanevalplus", "f1-hotpotqa"]
        assert system["prompt_tokens_from_cache"] == sum(t["prompt_tokens_from_cache"] for t in system["by_task"].values())
    assert sharing["icarus"]["by_task"]["f1-hotpotqa"]["cached_fraction"] > 0.6
    assert "| icarus (routed: math, code, qa) |" in (suite / "out" / "orchestration.md").read_text()
    samples = sorted((suite / "out" / "samples").rglob("samples.jsonl"))
    assert len(samples) == 3 + 27
    before = {p: p.read_text() for p in samples}
    again = run_suite(suite / "suite.yaml", suite / "out")
    assert {p: p.read_text() for p in samples} == before
    assert json.dumps(again["quality"]) == json.dumps(report["quality"])


def test_a_partial_suite_fills_what_exists(suite, tmp_path):
    spec = yaml.safe_load((suite / "suite.yaml").read_text())
    spec["systems"] = {"icarus": {"math": spec["systems"]["icarus"]["math"]},
                       "lora": {"math": spec["systems"]["lora"]["math"]}}
    spec.update(tasks=["gsm8k"], cross=[], base=False)
    (tmp_path / "partial.yaml").write_text(yaml.safe_dump(spec))
    report = run_suite(tmp_path / "partial.yaml", tmp_path / "out")
    assert report["quality"]["rows"]["icarus"]["GSM8K"]["n"] == 2
    assert report["quality"]["rows"]["icarus"]["HotpotQA F1"] is None
    assert set(report["quality"]["icarus_vs_lora"]) == {"GSM8K", "GSM8K strict"}
    assert "| icarus (routed: math, code, qa) | 0.000 | - | - | - | - |" in report["orchestration_md"]


def test_bad_suite_specs_are_one_line_errors(tmp_path, cli):
    from conftest import assert_one_line_error

    (tmp_path / "bad.yaml").write_text("systems: {icarus: {math: a, poetry: b}}\n")
    assert_one_line_error(cli("eval", "suite", "--spec", str(tmp_path / "bad.yaml"), "--out", str(tmp_path / "o")),
                          "systems.icarus.poetry", "unknown key")
    assert_one_line_error(cli("eval", "suite", "--out", str(tmp_path / "o")), "--spec")
    (tmp_path / "half.yaml").write_text("dtype: {gsm8k: float32}\nsystems: {}\n")
    assert_one_line_error(cli("eval", "suite", "--spec", str(tmp_path / "half.yaml"), "--out", str(tmp_path / "o")),
                          "dtype per task", "f1-hotpotqa")


def test_a_suite_run_in_parts_shows_the_union_of_runs_with_its_settings(suite, tmp_path):
    spec = yaml.safe_load((suite / "suite.yaml").read_text())
    spec.update(cross=[], base=False)
    math_only = {**spec, "tasks": ["gsm8k"],
                 "systems": {kind: {"math": spec["systems"][kind]["math"]} for kind in ("icarus", "lora")}}
    qa_only = {**spec, "tasks": ["f1-hotpotqa"],
               "systems": {kind: {"qa": spec["systems"][kind]["qa"]} for kind in ("icarus", "lora")}}
    for name, part in (("math", math_only), ("qa", qa_only)):
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(part))
    out = tmp_path / "out"
    first = run_suite(tmp_path / "math.yaml", out)
    (out / "samples" / "icarus" / "math-icarus" / "gsm8k" / "samples.jsonl").unlink()  # scores travel without it
    second = run_suite(tmp_path / "qa.yaml", out)
    for kind in ("icarus", "lora"):
        assert second["quality"]["rows"][kind]["GSM8K"] == first["quality"]["rows"][kind]["GSM8K"]
        assert second["quality"]["rows"][kind]["HotpotQA F1"]["n"] == 1
    assert second["quality"]["from_earlier_runs"] == ["math-icarus/gsm8k", "math-lora/gsm8k"]
    assert set(second["quality"]["icarus_vs_lora"]) == {"GSM8K", "GSM8K strict", "HotpotQA F1"}
    assert second["quality"]["icarus_vs_lora"]["GSM8K"]["paired"] is None  # its per-item log is gone
    assert second["quality"]["icarus_vs_lora"]["HotpotQA F1"]["paired"]["verdict"]
    assert "- GSM8K: not paired: no per-item scores" in second["quality_md"]
    assert "math-icarus/gsm8k" in (out / "quality.md").read_text()
    assert re.search(r"\(f1-hotpotqa \d+%\) \|", second["orchestration_md"])  # the KV column names the tasks it measured
    recorded = json.loads((out / "samples" / "icarus" / "qa-icarus" / "f1-hotpotqa" / "results.json").read_text())
    assert recorded["kind"] == "icarus" and recorded["max_tokens"] == spec["max_tokens"]["hotpotqa"]
    # runs with other settings are not mixed in: another dtype, another limit, or another length
    for change in ({"dtype": "bfloat16"}, {"limits": {**spec["limits"], "gsm8k": 1}},
                   {"max_tokens": {**spec["max_tokens"], "gsm8k": 9}}):
        (tmp_path / "other.yaml").write_text(yaml.safe_dump({**qa_only, **change, "tasks": []}))
        other = run_suite(tmp_path / "other.yaml", out)
        assert other["quality"]["rows"]["icarus"]["GSM8K"] is None, change
    # dtype per task: each column takes the runs made in its own dtype
    per_task = {"gsm8k": spec["dtype"], "humanevalplus": "bfloat16", "f1-hotpotqa": "bfloat16"}
    (tmp_path / "mixed.yaml").write_text(yaml.safe_dump({**qa_only, "dtype": per_task, "tasks": []}))
    mixed = run_suite(tmp_path / "mixed.yaml", out)
    assert mixed["quality"]["rows"]["lora"]["GSM8K"] == first["quality"]["rows"]["lora"]["GSM8K"]
    assert mixed["quality"]["rows"]["lora"]["HotpotQA F1"] is None


def test_a_run_of_another_adapter_under_the_same_name_is_not_merged_nor_resumed(suite, tmp_path):
    """The math ICaRus specialist retrained in place (same folder, same name, new weights): its
    earlier GSM8K score is not shown, its log is refused, and --overwrite recomputes it."""
    spec = yaml.safe_load((suite / "suite.yaml").read_text())
    adapter = tmp_path / "math-icarus"
    shutil.copytree(spec["systems"]["icarus"]["math"], adapter)
    math_only = {**spec, "cross": [], "base": False, "tasks": ["gsm8k"],
                 "systems": {"icarus": {"math": str(adapter)}}}
    (tmp_path / "math.yaml").write_text(yaml.safe_dump(math_only))
    (tmp_path / "qa.yaml").write_text(yaml.safe_dump({**math_only, "tasks": ["f1-hotpotqa"]}))
    out = tmp_path / "out"
    first = run_suite(tmp_path / "math.yaml", out)
    merged = run_suite(tmp_path / "qa.yaml", out)["quality"]
    assert merged["rows"]["icarus"]["GSM8K"] == first["quality"]["rows"]["icarus"]["GSM8K"]
    ckpt = make_peft_adapter(spec["model"], tmp_path / "ckpt", target_modules=ICARUS_TARGETS, seed=99)
    export_adapter(ckpt, kind="icarus", base=spec["model"], out=adapter, name="math-icarus", force=True)
    later = run_suite(tmp_path / "qa.yaml", out)
    assert later["quality"]["rows"]["icarus"]["GSM8K"] is None
    assert later["quality"]["from_earlier_runs"] == []
    assert [r.split(" (")[0] for r in later["quality"]["not_merged"]] == ["math-icarus/gsm8k: other settings"]
    assert "adapter_digest" in later["quality"]["not_merged"][0]
    assert "math-icarus/gsm8k" in (out / "quality.md").read_text()
    log = out / "samples" / "icarus" / "math-icarus" / "gsm8k" / "samples.jsonl"
    before = log.read_text()
    with pytest.raises(KvshareError, match="adapter_digest.*--overwrite"):
        run_suite(tmp_path / "math.yaml", out)
    assert log.read_text() == before
    again = run_suite(tmp_path / "math.yaml", out, overwrite=True)
    assert again["quality"]["rows"]["icarus"]["GSM8K"]["n"] == 2 and again["quality"]["not_merged"] == []
    header = json.loads(log.read_text().split("\n")[0])
    recorded = json.loads((log.parent / "results.json").read_text())
    assert recorded["settings_hash"] == header["settings_hash"] != json.loads(before.split("\n")[0])["settings_hash"]


def test_the_committed_quality_spec_is_valid():
    """results/quality/suite.yaml is the spec of the committed tables; it must stay runnable."""
    spec = load_spec(Path(__file__).parents[1] / "results" / "quality" / "suite.yaml", SuiteSpec, "evaluation suite")
    assert {getattr(adapters, domain) for adapters in spec.systems.values() for domain in ("math", "code", "qa")} == {
        f"runs/{domain}-{kind}/adapter" for domain in ("math", "code", "qa") for kind in ("icarus", "lora", "alora")}
