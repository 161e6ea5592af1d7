"""GSM8K and F1 harnesses: lm-eval's scoring, resumable runs through the engine, logs bound
to the settings they were made with."""

from __future__ import annotations

import json
import re
import shutil

import pytest

from kvshare.eval.gsm8k import Scorer, evaluate_gsm8k
from kvshare.errors import KvshareError
from kvshare.eval.harness import logged_samples, mean_ci95
from kvshare.eval.qa import evaluate_f1, load_items

from conftest import assert_one_line_error

REFERENCE = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72"


@pytest.mark.parametrize("completion,strict,flexible", [
    ("She sold 48 + 24 = 72 clips.\n#### 72", 1.0, 1.0),
    ("So the total is 72.", 0.0, 1.0),  # no '####': only flexible-extract finds the last number
    ("#### 71\nActually it is 72", 0.0, 1.0),
    ("#### $1,000", 0.0, 0.0),
    ("no number at all", 0.0, 0.0),
])
def test_scoring_is_lm_evals(completion, strict, flexible):
    verdict = Scorer()(completion, REFERENCE)
    assert verdict["strict-match"]["correct"] == strict
    assert verdict["flexible-extract"]["correct"] == flexible
    if completion == "no number at all":
        assert verdict["strict-match"]["extracted"] == "[invalid]"


def test_mean_and_interval():
    result = mean_ci95([1.0, 0.0, 1.0, 1.0])
    assert result["mean"] == 0.75 and result["n"] == 4
    assert result["ci95"][0] < 0.75 < result["ci95"][1]
    none = mean_ci95([0.0] * 100)  # pass/fail: Wilson's interval, not a point at 0 of n
    assert none["ci95"][0] == pytest.approx(0.0, abs=1e-12) and none["ci95"][1] == pytest.approx(0.037, abs=0.001)
    assert mean_ci95([1] * 20)["ci95"][0] == pytest.approx(0.839, abs=0.001)
    f1 = mean_ci95([0.5, 0.25, 0.75])  # a graded score: the normal interval
    assert f1["ci95"] == pytest.approx([0.5 - 1.96 * f1["stderr"], 0.5 + 1.96 * f1["stderr"]])


def test_gsm8k_runs_through_the_engine_and_resumes(tiny_models, tmp_path):
    base = str(tiny_models("llama"))
    first = evaluate_gsm8k(base, None, tmp_path, limit=3, shots=1, max_tokens=8)
    assert first["strict-match"]["n"] == 3
    record = logged_samples(tmp_path / "samples.jsonl")[0]  # the settings header left out
    assert {"prompt", "output", "reference", "strict-match", "flexible-extract"} <= set(record)
    again = evaluate_gsm8k(base, None, tmp_path, limit=4, shots=1, max_tokens=8)  # a larger limit extends
    assert again["strict-match"]["n"] == 4
    assert len((tmp_path / "samples.jsonl").read_text().splitlines()) == 1 + 4  # 3 reused, 1 new


def test_a_log_cut_short_resumes_and_a_damaged_one_is_refused(tiny_models, tmp_path):
    base = str(tiny_models("llama"))
    evaluate_gsm8k(base, None, tmp_path, limit=3, max_tokens=8)
    log = tmp_path / "samples.jsonl"
    whole = log.read_text()
    lines = [line + "\n" for line in whole.split("\n")[:-1]]  # header, 3 samples; outputs may hold other line breaks
    log.write_text("".join(lines[:3]) + lines[3][:25])  # killed while writing the third sample
    again = evaluate_gsm8k(base, None, tmp_path, limit=3, max_tokens=8)
    assert again["strict-match"]["n"] == 3
    assert log.read_text() == whole  # the third sample generated again (greedy: the same line)
    log.write_text(whole.rstrip("\n"))  # killed just before the last newline
    evaluate_gsm8k(base, None, tmp_path, limit=3, max_tokens=8)
    assert log.read_text() == whole
    first = json.loads(lines[1])
    first["output"] += "\u2028\x85"  # line separators JSON leaves unescaped
    log.write_text(lines[0] + json.dumps(first, ensure_ascii=False) + "\n" + "".join(lines[2:]))
    evaluate_gsm8k(base, None, tmp_path, limit=3, max_tokens=8)
    assert log.read_text().count("\n") == 4  # read as header + three records: nothing regenerated
    log.write_text(lines[0] + lines[1][:25] + "\n" + "".join(lines[2:]))  # damage in the middle
    with pytest.raises(KvshareError, match="line 2 is not a JSON record"):
        evaluate_gsm8k(base, None, tmp_path, limit=3, max_tokens=8)
    log.write_text(lines[0] + "".join(lines[1:]) + lines[0])  # two logs joined
    with pytest.raises(KvshareError, match="line 5 is a second header"):
        evaluate_gsm8k(base, None, tmp_path, limit=3, max_tokens=8)


def test_a_rerun_with_other_settings_is_refused_and_overwrite_recomputes(tiny_models, tmp_path, cli):
    from conftest import assert_one_line_error

    base, out = str(tiny_models("llama")), tmp_path / "run"
    settings = {"limit": 2, "shots": 1, "max_tokens": 8}
    first = evaluate_gsm8k(base, None, out, **settings)
    log = out / "samples.jsonl"
    header = json.loads(log.read_text().split("\n")[0])
    assert header["settings"]["sampling"]["max_tokens"] == 8 and header["settings"]["shots"] == 1
    assert header["settings"]["base_fingerprint"].startswith("sha256:") and "limit" not in header["settings"]
    assert first["settings_hash"] == header["settings_hash"]  # results.json names the same run
    before = log.read_text()
    for change, named in (({"max_tokens": 9}, "sampling.max_tokens 8 -> 9"), ({"shots": 0}, "shots 1 -> 0"),
                          ({"prompt_format": "plain"}, "prompt_format chat -> plain")):
        with pytest.raises(KvshareError, match=re.escape(named) + ".*--overwrite"):
            evaluate_gsm8k(base, None, out, **{**settings, **change})
    with pytest.raises(KvshareError, match="base_fingerprint sha256:"):  # another model, same tokenizer
        evaluate_gsm8k(str(tiny_models("llama", seed=1)), None, out, **settings)
    assert log.read_text() == before  # refusals touch nothing
    assert evaluate_gsm8k(base, None, out, **settings) == first and log.read_text() == before  # same: resumes

    argv = ["eval", "gsm8k", "--model", base, "--limit", "2", "--shots", "1", "--out", out]
    assert_one_line_error(cli(*argv, "--max-tokens", "9"), "sampling.max_tokens 8 -> 9", "--overwrite")
    (out / "evalplus.jsonl").write_text("{}\n")  # a cache computed from the old samples
    assert cli(*argv, "--max-tokens", "9", "--overwrite").code == 0
    header = json.loads(log.read_text().split("\n")[0])
    assert header["settings"]["sampling"]["max_tokens"] == 9 and len(log.read_text().splitlines()) == 1 + 2
    assert json.loads((out / "results.json").read_text())["settings_hash"] == header["settings_hash"]
    assert not (out / "evalplus.jsonl").exists()
    # --overwrite with the same settings generates every sample again
    lines = log.read_text().splitlines(keepends=True)
    tampered = {**json.loads(lines[1]), "output": "tampered"}
    log.write_text(lines[0] + json.dumps(tampered) + "\n" + lines[2])
    assert cli(*argv, "--max-tokens", "9", "--overwrite").code == 0
    assert log.read_text() == "".join(lines)

    # a log from before headers: its settings are unknown, so it is refused, not trusted
    log.write_text("".join(lines[1:]))
    with pytest.raises(KvshareError, match="no settings header.*--overwrite"):
        evaluate_gsm8k(base, None, out, **{**settings, "max_tokens": 9})
    assert evaluate_gsm8k(base, None, out, **{**settings, "max_tokens": 9}, overwrite=True)["strict-match"]["n"] == 2
    assert log.read_text() == "".join(lines)


def test_an_adapter_retrained_under_the_same_name_is_not_resumed(tiny_models, tmp_path):
    """Identity is the adapter's content digest: new weights in the same folder under the same
    name are another run; the same weights in another folder are the same run."""
    from kvshare.export import export_adapter
    from kvshare.testing import make_peft_adapter

    base = tiny_models("llama")
    adapter, out = tmp_path / "adapter", tmp_path / "out"

    def train(seed: int) -> None:
        ckpt = make_peft_adapter(base, tmp_path / f"ckpt-{seed}", target_modules=["q_proj", "v_proj"], seed=seed)
        export_adapter(ckpt, kind="lora", base=base, out=adapter, name="math", force=True)

    train(0)
    evaluate_gsm8k(str(base), str(adapter), out, limit=2, max_tokens=8)
    shutil.copytree(adapter, tmp_path / "copy")
    before = (out / "samples.jsonl").read_text()
    train(1)
    with pytest.raises(KvshareError, match="adapter_digest sha256:.* -> sha256:.*--overwrite"):
        evaluate_gsm8k(str(base), str(adapter), out, limit=2, max_tokens=8)
    evaluate_gsm8k(str(base), str(tmp_path / "copy"), out, limit=2, max_tokens=8)
    assert (out / "samples.jsonl").read_text() == before  # the old weights elsewhere: resumed


def test_f1_on_held_out_qa(tmp_path):
    from kvshare.testing import make_tiny_model

    assert len(load_items("hotpotqa")) == 500
    squad = load_items("squad")
    assert len(squad) == 623 and all(item["answers"] for item in squad)
    model = make_tiny_model(tmp_path / "long-context", max_position_embeddings=4096)
    result = evaluate_f1(str(model), None, tmp_path / "out", dataset="squad", limit=2, max_tokens=4)
    assert result["f1"]["n"] == 2 and (tmp_path / "out" / "results.md").read_text().startswith("| f1-squad |")


def test_a_named_fast_path_is_part_of_the_runs_settings(tmp_path):
    """`kvshare eval --kernels/--compile`: a run through a fast path asked for by name never
    resumes the default path's log (their outputs differ in rounding), and says what it ran."""
    from kvshare.testing import make_tiny_model

    model = make_tiny_model(tmp_path / "long-context", max_position_embeddings=4096)
    default = evaluate_f1(str(model), None, tmp_path / "default", dataset="squad", limit=2, max_tokens=4)
    assert not {"compile", "kernels", "device"} & set(default["settings"])  # old logs still match
    eager = evaluate_f1(str(model), None, tmp_path / "eager", dataset="squad", limit=2, max_tokens=4,
                        kernels="torch", compile="off")
    assert eager["settings"]["compile"] == "off" and eager["settings"]["kernels"] == "torch"
    with pytest.raises(KvshareError, match="compile"):
        evaluate_f1(str(model), None, tmp_path / "eager", dataset="squad", limit=2, max_tokens=4)


def test_samples_judged_by_an_older_rule_are_judged_again_on_resume(tmp_path):
    """A log from before HotpotQA's yes/no rule: resuming it keeps the outputs and judges them
    again, so one score never mixes two scoring rules; the log says which rule judged it."""
    from kvshare.testing import make_tiny_model

    model = make_tiny_model(tmp_path / "long-context", max_position_embeddings=8192)
    out = tmp_path / "out"
    first = evaluate_f1(str(model), None, out, dataset="hotpotqa", limit=2, max_tokens=4)
    lines = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert lines[0]["scoring"] == 2
    del lines[0]["scoring"]  # as written before the rule
    lines[1]["f1"] = 0.123
    (out / "samples.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    again = evaluate_f1(str(model), None, out, dataset="hotpotqa", limit=2, max_tokens=4)
    assert again["f1"] == first["f1"]
    rewritten = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert rewritten[0]["scoring"] == 2 and rewritten[1]["f1"] != 0.123
    assert [r["output"] for r in rewritten[1:]] == [r["output"] for r in lines[1:]]


def test_samples_a_smaller_run_skipped_are_judged_again_when_a_run_takes_them(tmp_path):
    """An old-rule log of two samples, resumed with --limit 1: the second keeps its old verdict
    marked with its rule, and the next run that takes it judges it again."""
    from kvshare.testing import make_tiny_model

    model = make_tiny_model(tmp_path / "long-context", max_position_embeddings=8192)
    out = tmp_path / "out"
    first = evaluate_f1(str(model), None, out, dataset="hotpotqa", limit=2, max_tokens=4)
    lines = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    del lines[0]["scoring"]  # as written before the rule
    lines[1]["f1"] = lines[2]["f1"] = 0.123
    (out / "samples.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    evaluate_f1(str(model), None, out, dataset="hotpotqa", limit=1, max_tokens=4)
    rewritten = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert rewritten[1]["f1"] != 0.123 and "scoring" not in rewritten[1]
    assert rewritten[2]["f1"] == 0.123 and rewritten[2]["scoring"] == 1
    again = evaluate_f1(str(model), None, out, dataset="hotpotqa", limit=2, max_tokens=4)
    assert again["f1"] == first["f1"] and again["scoring"] == 2


def test_the_suite_merges_no_result_scored_under_another_rule(tmp_path, monkeypatch):
    from kvshare.eval import suite
    from kvshare.eval.harness import EvalTask, run_settings, settings_hash
    from kvshare.serve import SamplingParams

    monkeypatch.setattr(suite, "resolve_model_dir", lambda model: tmp_path)
    monkeypatch.setattr(suite, "fingerprints", lambda folder: type("F", (), {"base": "sha256:fp"})())
    spec = suite.SuiteSpec(model="m", dtype="float32", systems={}, tasks=["f1-hotpotqa"])
    task = EvalTask("f1-hotpotqa", [{"id": "x"}], None, None, SamplingParams(max_tokens=32), None, None,
                    {"limit": spec.limits.hotpotqa}, scoring=2)
    settings = run_settings(task, "m", "sha256:fp", "base", None, "float32")
    folder = tmp_path / "out/samples/base/base/f1-hotpotqa"
    folder.mkdir(parents=True)
    for scoring, merged in ((1, False), (2, True)):
        (folder / "results.json").write_text(json.dumps({"limit": spec.limits.hotpotqa, "scoring": scoring, "f1": {},
                                                         "settings": settings, "settings_hash": settings_hash(settings)}))
        found, skipped = suite.finished_runs(spec, tmp_path / "out", {"f1-hotpotqa": task})
        assert (("base", "f1-hotpotqa") in found) == merged, skipped


def test_a_sharded_bases_log_from_before_shard_free_fingerprints_resumes(tmp_path):
    """Logs record the base fingerprint; a sharded base's changed when fingerprints stopped
    depending on sharding. A log under its old (shard-by-shard) digest still resumes, its
    samples kept; a log of another base is still refused."""
    from kvshare.eval.harness import settings_hash
    from kvshare.fingerprint import legacy_base_fingerprint
    from kvshare.testing import make_tiny_model

    from test_fingerprint import _sharded_copy

    model = _sharded_copy(make_tiny_model(tmp_path / "one-file", max_position_embeddings=8192), tmp_path / "sharded")
    out = tmp_path / "out"
    evaluate_f1(str(model), None, out, dataset="hotpotqa", limit=2, max_tokens=4)
    lines = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    legacy = legacy_base_fingerprint(model)
    assert legacy != lines[0]["settings"]["base_fingerprint"]
    lines[0]["settings"]["base_fingerprint"] = legacy  # as a kvshare before this one wrote it
    lines[0]["settings_hash"] = settings_hash(lines[0]["settings"])
    for record in lines[1:]:
        record["output"] += " (kept)"  # a resumed log is not generated again
    (out / "samples.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    evaluate_f1(str(model), None, out, dataset="hotpotqa", limit=2, max_tokens=4)
    assert all(s["output"].endswith(" (kept)") for s in logged_samples(out / "samples.jsonl"))
    lines[0]["settings"]["base_fingerprint"] = "sha256:" + "1" * 64  # another base
    lines[0]["settings_hash"] = settings_hash(lines[0]["settings"])
    (out / "samples.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    with pytest.raises(KvshareError, match="other settings"):
        evaluate_f1(str(model), None, out, dataset="hotpotqa", limit=2, max_tokens=4)


def test_alora_adapters_are_evaluated_with_their_invocation(tiny_models, tmp_path):
    """As trained: conversation, then the invocation, no assistant header (else PEFT's rule
    would never switch the adapter on)."""
    from kvshare.export import export_adapter
    from kvshare.serve import LLM
    from kvshare.testing import make_peft_adapter

    base = tiny_models("llama")
    engine = LLM(base, kv_cache_tokens=512).engine
    inv = engine.tokenizer.encode("<|invoke|>", add_special_tokens=False)
    ckpt = make_peft_adapter(base, tmp_path / "ckpt", target_modules=["q_proj"], invocation_tokens=inv)
    name = engine.load_adapter(export_adapter(ckpt, kind="alora", base=base, out=tmp_path / "judge",
                                              invocation="<|invoke|>"))
    messages = [{"role": "user", "content": "Is 2 + 2 = 4?"}]
    ids = engine.chat_prompt(messages, name)
    assert ids[-len(inv):] == inv
    assert engine.chat_prompt(messages)[-len(inv):] != inv


@pytest.mark.parametrize("argv,message", [
    (["eval", "gsm8k", "--limit", "0", "--out", "x"], "--limit must be at least 1"),
    (["eval", "f1", "--batch", "0", "--out", "x"], "--batch must be at least 1"),
    (["bench", "engine", "--new-tokens", "1"], "--new-tokens must be at least 2"),
    (["bench", "alora", "--threads", "0"], "--threads must be at least 1")])
def test_values_that_would_mean_all_or_nothing_are_one_line_errors(cli, argv, message):
    """--limit 0 read the whole data set; --new-tokens 1 ended the engine bench in a traceback."""
    assert_one_line_error(cli(*argv), message)
