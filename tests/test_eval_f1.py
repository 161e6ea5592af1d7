"""SQuAD-style F1 / exact match, on the official script's behaviour."""

import pytest

from kvshare.eval.f1 import HOTPOT_EXACT_ONLY, f1, normalize_answer, score


@pytest.mark.parametrize("text,normal", [
    ("The Denver Broncos!", "denver broncos"),
    ("  an   apple, a pear ", "apple pear"),
    ("Theatre", "theatre"),  # "the" only as a whole word
])
def test_normalization(text, normal):
    assert normalize_answer(text) == normal


def test_f1_and_exact_match_take_the_best_reference():
    result = score("the Denver Broncos", ["Broncos", "Denver Broncos", "Carolina Panthers"])
    assert result == {"exact_match": 1.0, "f1": 1.0}
    partial = score("Denver", ["Denver Broncos"])
    assert partial["exact_match"] == 0.0 and partial["f1"] == pytest.approx(2 / 3)
    assert f1("Kansas Song", "Chief of Protocol") == 0.0
    assert f1("", "anything") == 0.0


def test_repeated_tokens_count_once_per_occurrence():
    # precision 2/3 (two of three predicted tokens match), recall 1: F1 = 0.8
    assert f1("new new york", "new york") == pytest.approx(0.8)


def test_references_are_required():
    with pytest.raises(ValueError):
        score("x", [])


def test_hotpotqa_yes_no_answers_get_no_partial_credit():
    """hotpot_evaluate_v1.py's f1_score: a yes/no/noanswer on either side scores 0 unless equal."""
    assert score("yes it is", ["yes"], HOTPOT_EXACT_ONLY)["f1"] == 0.0
    assert score("yes it is", ["yes"])["f1"] == 0.5  # SQuAD's rule gives partial credit
    assert score("Yes.", ["yes"], HOTPOT_EXACT_ONLY)["f1"] == 1.0
    assert score("no", ["no way out"], HOTPOT_EXACT_ONLY)["f1"] == 0.0
    assert score("the red house", ["red house"], HOTPOT_EXACT_ONLY)["f1"] == 1.0
