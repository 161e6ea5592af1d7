"""GSM8K and F1 harnesses: lm-eval's scoring, resumable runs through the engine."""

from __future__ import annotations

import json

import pytest

from kvshare.eval.gsm8k import Scorer, evaluate_gsm8k
from kvshare.errors import KvshareError
from kvshare.eval.harness import mean_ci95
from kvshare.eval.qa import evaluate_f1, load_items

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


def test_gsm8k_runs_through_the_engine_and_resumes(tiny_models, tmp_path):
    base = str(tiny_models("llama"))
    first = evaluate_gsm8k(base, None, tmp_path, limit=3, shots=1, max_tokens=8)
    assert first["strict-match"]["n"] == 3
    lines = (tmp_path / "samples.jsonl").read_text().splitlines()
    record = json.loads(lines[0])
    assert {"prompt", "output", "reference", "strict-match", "flexible-extract"} <= set(record)
    again = evaluate_gsm8k(base, None, tmp_path, limit=4, shots=1, max_tokens=8)
    assert again["strict-match"]["n"] == 4
    assert len((tmp_path / "samples.jsonl").read_text().splitlines()) == 4  # 3 reused, 1 new


def test_a_log_cut_short_resumes_and_a_damaged_one_is_refused(tiny_models, tmp_path):
    base = str(tiny_models("llama"))
    evaluate_gsm8k(base, None, tmp_path, limit=3, max_tokens=8)
    log = tmp_path / "samples.jsonl"
    whole = log.read_text()
    lines = [line + "\n" for line in whole.split("\n")[:-1]]  # outputs may hold other line breaks
    log.write_text("".join(lines[:2]) + lines[2][:25])  # killed while writing the third sample
    again = evaluate_gsm8k(base, None, tmp_path, limit=3, max_tokens=8)
    assert again["strict-match"]["n"] == 3
    assert log.read_text() == whole  # the third sample generated again (greedy: the same line)
    log.write_text(whole.rstrip("\n"))  # killed just before the last newline
    evaluate_gsm8k(base, None, tmp_path, limit=3, max_tokens=8)
    assert log.read_text() == whole
    first = json.loads(lines[0])
    first["output"] += "\u2028\x85"  # line separators JSON leaves unescaped
    log.write_text(json.dumps(first, ensure_ascii=False) + "\n" + "".join(lines[1:]))
    evaluate_gsm8k(base, None, tmp_path, limit=3, max_tokens=8)
    assert log.read_text().count("\n") == 3  # read as three records: nothing regenerated
    log.write_text(lines[0][:25] + "\n" + "".join(lines[1:]))  # damage in the middle
    with pytest.raises(KvshareError, match="line 1 is not a JSON record"):
        evaluate_gsm8k(base, None, tmp_path, limit=3, max_tokens=8)


def test_f1_on_held_out_qa(tmp_path):
    from kvshare.testing import make_tiny_model

    assert len(load_items("hotpotqa")) == 500
    squad = load_items("squad")
    assert len(squad) == 623 and all(item["answers"] for item in squad)
    model = make_tiny_model(tmp_path / "long-context", max_position_embeddings=4096)
    result = evaluate_f1(str(model), None, tmp_path / "out", dataset="squad", limit=2, max_tokens=4)
    assert result["f1"]["n"] == 2 and (tmp_path / "out" / "results.md").read_text().startswith("| f1-squad |")


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
