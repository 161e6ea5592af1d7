"""Training data: loaders read the local copies, and no evaluation record gets through."""

from __future__ import annotations

import gzip
import json
import re
import shutil

import pytest

from kvshare.errors import KvshareError
from kvshare.splits import MBPP_SPLITS, SQUAD_EVAL_TITLES, eval_guard, eval_hub_splits, hotpotqa_eval_ids
from kvshare.paths import data_dir
from kvshare.train.data import LOADERS, load_file, load_hub, load_named


@pytest.fixture(scope="module")
def data():
    folder = data_dir()
    assert folder is not None and folder.is_dir(), "tests need ../shared/data or KVSHARE_DATA"
    return folder


@pytest.mark.filterwarnings("ignore:.*evaluation data")
@pytest.mark.parametrize("name", sorted(LOADERS))
def test_every_loader_reads_its_local_copy(data, name):
    examples = load_named(name, limit=50)
    assert len(examples) == 50
    assert all(e.prompt.strip() and e.response.strip() for e in examples)
    assert len({e.id for e in examples}) == 50


def test_gsm8k_training_never_sees_a_test_question(data):
    with open(data / "gsm8k/test.jsonl") as handle:
        test_questions = {json.loads(line)["question"].strip() for line in handle}
    train = load_named("gsm8k")
    assert len(train) == 7473
    assert not test_questions & {e.prompt for e in train}


def test_mbpp_training_uses_the_train_split_only(data):
    with pytest.warns(UserWarning, match="dropped 7 records"):
        examples = load_named("mbpp")
    ids = {int(e.id.split("/")[1]) for e in examples}
    assert ids < set(MBPP_SPLITS["train"])
    # the seven left out state, word for word, the task of a test or validation problem
    def words(text):
        return " " + " ".join(re.findall(r"\w+", text.lower())) + " "

    with open(data / "mbpp/mbpp.jsonl") as handle:
        rows = [json.loads(line) for line in handle]
    held_out = [words(r["text"]) for r in rows if r["task_id"] not in MBPP_SPLITS["train"]]
    dropped = [r for r in rows if r["task_id"] in MBPP_SPLITS["train"] and r["task_id"] not in ids]
    assert len(dropped) == 7
    assert all(any(h in words(r["text"]) for h in held_out) for r in dropped)


def test_math_cot_copies_of_gsm8k_test_questions_are_dropped(data):
    """math_data.json holds 1055 GSM8K test questions verbatim: they may not be trained on."""
    with open(data / "gsm8k/test.jsonl") as handle:
        test_questions = {json.loads(line)["question"].strip() for line in handle}
    with pytest.warns(UserWarning, match="dropped 1055 records .*gsm8k test"):
        examples = load_named("math_cot")
    assert len(examples) == 3260 - 1055
    assert not test_questions & {e.prompt for e in examples}


def test_hotpotqa_training_excludes_every_held_out_question(data):
    held_out = hotpotqa_eval_ids(str(data))
    assert len(held_out) == 500
    train = {e.id.split("/", 1)[1] for e in load_named("hotpotqa")}
    assert len(train) == 467 and not train & held_out  # 33 shared ids removed


def test_squad_training_excludes_the_held_out_articles(data):
    titles = {e.id.split("/")[1] for e in load_named("squad")}
    assert titles and not titles & set(SQUAD_EVAL_TITLES)


def test_no_training_prompt_is_a_humaneval_prompt(data):
    with gzip.open(data / "humanevalplus/HumanEvalPlus.jsonl.gz", "rt") as handle:
        prompts = {json.loads(line)["prompt"].strip() for line in handle}
    with pytest.warns(UserWarning, match="mbpp: dropped"):
        code = load_named("mbpp") + load_named("code_alpaca")
    assert not prompts & {e.prompt.strip() for e in code}


@pytest.mark.parametrize("relative", ["gsm8k/test.jsonl", "hotpotqa/dev_hard_500.jsonl"])
def test_evaluation_files_are_refused_by_path(data, relative):
    with pytest.raises(KvshareError, match="evaluation data"):
        load_file(data / relative, "question", "answer")


@pytest.mark.parametrize("dataset,split", [("openai/gsm8k", "test"), ("openai_humaneval", "test"),
                                           ("google-research-datasets/mbpp", "test")])
def test_evaluation_hub_splits_are_refused_before_any_download(dataset, split):
    with pytest.raises(KvshareError, match="evaluation data"):
        load_hub(dataset, split, "question", "answer")


def test_unknown_loader():
    with pytest.raises(KvshareError, match="unknown data set"):
        load_named("imagenet")


def test_a_renamed_copy_of_an_evaluation_file_is_refused(data, tmp_path):
    copy = tmp_path / "my_multihop_train.jsonl"
    shutil.copyfile(data / "hotpotqa/dev_hard_500.jsonl", copy)
    with pytest.raises(KvshareError, match="evaluation data .hotpotqa dev_hard_500"):
        load_file(copy, "question", "answer")


def test_evaluation_records_mixed_into_a_file_are_dropped(data, tmp_path):
    """Caught by question text inside a template, by id alone, in any field: whatever the name."""
    with open(data / "gsm8k/test.jsonl") as handle:
        gsm8k = [json.loads(line) for line in handle][:3]
    with open(data / "hotpotqa/dev_hard_500.jsonl") as handle:
        hotpot = [json.loads(line) for line in handle][:2]
    own = [{"q": f"What is {i} plus one?", "a": f"{i + 1}."} for i in range(4)]
    rows = ([{"q": f"Question: {r['question']}\nAnswer step by step.", "a": r["answer"]} for r in gsm8k]
            + [{"id": r["_id"], "q": "reworded beyond recognition", "a": r["answer"]} for r in hotpot]
            + [{"q": "Solve it.", "a": "42", "source": gsm8k[0]["question"].upper()}] + own)
    path = tmp_path / "mixed.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.warns(UserWarning, match="dropped 6 records .*4 from gsm8k test, 2 from hotpotqa"):
        examples = load_file(path, "q", "a")
    assert [e.prompt for e in examples] == [r["q"] for r in own]
    with pytest.warns(UserWarning):
        assert len(load_file(path, "q", "a", limit=2)) == 2  # the limit counts kept records


def test_short_evaluation_questions_inside_a_template_are_dropped(data, tmp_path):
    """HotpotQA and the held-out SQuAD articles have many questions under 13 words: wrapped in
    a context template, they are found whole; ordinary short phrases are not."""
    from kvshare.splits import MIN_CONTAINED, SHINGLE, _words

    with open(data / "hotpotqa/dev_hard_500.jsonl") as handle:
        short = [r for r in map(json.loads, handle) if MIN_CONTAINED <= len(_words(r["question"])) < SHINGLE][:3]
    assert len(short) == 3
    rows = [{"q": f"Paragraphs: some text.\n\nQuestion: {r['question']}\nAnswer briefly.", "a": r["answer"]}
            for r in short]
    own = [{"q": "Question: What is the answer?\nAnswer briefly.", "a": "Yes."}]  # too short to be anyone's
    path = tmp_path / "wrapped.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows + own))
    with pytest.warns(UserWarning, match="dropped 3 records .*3 from hotpotqa"):
        examples = load_file(path, "q", "a")
    assert [e.prompt for e in examples] == [own[0]["q"]]


@pytest.mark.parametrize("split", ["test[:50%]", "test[10:20]", "train+test", "train[:5%]+test[:5]"])
def test_split_expressions_reading_an_evaluation_split_are_refused(split):
    with pytest.raises(KvshareError, match="reads test, which is evaluation data"):
        load_hub("openai/gsm8k", split, "question", "answer")


def test_split_expressions_are_parsed_not_matched_as_text():
    assert eval_hub_splits("openai/gsm8k", "train[:10%]") == []
    assert eval_hub_splits("OpenAI/GSM8K", "train+test[:1%]") == ["test"]
    assert eval_hub_splits("google-research-datasets/mbpp", "validation+prompt") == ["validation", "prompt"]
    with pytest.raises(KvshareError, match="not a split expression"):
        eval_hub_splits("openai/gsm8k", "test[[")


def test_the_guard_ignores_a_shared_phrase(data):
    """Near-duplicate phrasing is no leak: only a whole question (or an id) matches."""
    guard = eval_guard(str(data))
    with open(data / "gsm8k/test.jsonl") as handle:
        question = json.loads(handle.readline())["question"]
    words = question.split()
    assert guard.match(texts=[question]) == "gsm8k test"
    assert guard.match(texts=[" ".join(words[:-3])]) is None
    assert guard.match(texts=["Intro. " + question + " Explain."]) == "gsm8k test"


@pytest.mark.parametrize("relative,line", [("gsm8k/test.jsonl", '{"question": "x"'),
                                           ("hotpotqa/dev_hard_500.jsonl", '{"question": "no id"}')])
def test_a_damaged_evaluation_file_is_one_clear_error(tmp_path, relative, line):
    """Every training run reads the evaluation files to guard its data: a damaged one names
    the data folder instead of a traceback."""
    (tmp_path / relative).parent.mkdir(parents=True)
    (tmp_path / relative).write_text(line + "\n")
    with pytest.raises(KvshareError, match="evaluation file .* is damaged"):
        eval_guard.__wrapped__(str(tmp_path))
    if relative.startswith("hotpotqa"):
        with pytest.raises(KvshareError, match="is damaged"):
            hotpotqa_eval_ids.__wrapped__(str(tmp_path))


def _write_lines(tmp_path, *lines: str):
    path = tmp_path / "mine.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.mark.parametrize("lines,fragment", [
    (['{"q": "a", "a": "b"}', "", "", '{"q": "c", "a": oops}'], r"mine.jsonl: line 4: malformed JSON"),
    (['{"q": "a", "a": "b"}', "", '{"q": "c"}'], r"mine.jsonl: line 3 lacks field"),
    (["", '{"q": "a", "a": "b"}', "[1, 2]"], r"mine.jsonl: line 3 lacks field"),
])
def test_a_bad_jsonl_record_names_its_line_counting_blank_lines(tmp_path, lines, fragment):
    with pytest.raises(KvshareError, match=fragment):
        load_file(_write_lines(tmp_path, *lines), "q", "a")


def test_a_named_loader_names_the_line_of_a_damaged_record(tmp_path, monkeypatch):
    (tmp_path / "gsm8k").mkdir()
    (tmp_path / "gsm8k" / "train.jsonl").write_text('{"question": "q", "answer": "a"}\n\n{"question": \n')
    monkeypatch.setenv("KVSHARE_DATA", str(tmp_path))
    with pytest.raises(KvshareError, match=r"train.jsonl: line 3: malformed JSON"):
        load_named("gsm8k")


@pytest.mark.parametrize("record,kind", [('{"q": null, "a": "b"}', "'q' is null"),
                                         ('{"q": "a", "a": null}', "'a' is null"),
                                         ('{"q": "a", "a": ["b"]}', "'a' is a list"),
                                         ('{"q": true, "a": "b"}', "'q' is a boolean")])
def test_a_null_prompt_or_response_is_refused_not_trained_as_none(tmp_path, record, kind):
    path = _write_lines(tmp_path, '{"q": "fine", "a": "fine"}', "", record)
    with pytest.raises(KvshareError, match=rf"mine.jsonl: line 3: field {kind}, not text"):
        load_file(path, "q", "a")


def test_a_number_response_reads_as_its_digits(tmp_path):
    examples = load_file(_write_lines(tmp_path, '{"q": "six times seven?", "a": 42}'), "q", "a")
    assert [(e.prompt, e.response) for e in examples] == [("six times seven?", "42")]
