"""Training data: loaders read the local copies, and no evaluation record gets through."""

from __future__ import annotations

import gzip
import json

import pytest

from kvshare.errors import KvshareError
from kvshare.splits import MBPP_SPLITS, SQUAD_EVAL_TITLES, hotpotqa_eval_ids
from kvshare.paths import data_dir
from kvshare.train.data import LOADERS, load_file, load_hub, load_named


@pytest.fixture(scope="module")
def data():
    folder = data_dir()
    assert folder is not None and folder.is_dir(), "tests need ../shared/data or KVSHARE_DATA"
    return folder


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
    ids = {int(e.id.split("/")[1]) for e in load_named("mbpp")}
    assert ids == set(MBPP_SPLITS["train"])


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
