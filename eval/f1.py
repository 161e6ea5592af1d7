"""SQuAD-style answer scoring: exact match and token F1, maximum over reference answers.

Same normalisation as the official SQuAD v1.1 evaluation script (lower case, strip
punctuation and the articles a/an/the, collapse white space); HotpotQA's official script adds
one rule, kept here as ``exact_only``: yes/no answers get no partial credit. Written here rather than
taken from `evaluate`'s "squad" metric because that metric's code is downloaded from the
Hub when first used, which machines without hub access cannot do.
"""

from __future__ import annotations

import re
import string
from collections import Counter

_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)
_PUNCTUATION = set(string.punctuation)


def normalize_answer(text: str) -> str:
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def exact_match(prediction: str, reference: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(reference))


def f1(prediction: str, reference: str, exact_only: frozenset[str] = frozenset()) -> float:
    """Token F1; where either side normalises to one of ``exact_only`` (HotpotQA's yes / no /
    noanswer, as its official script), no partial credit: "yes it is" against "yes" scores 0."""
    if {normalize_answer(prediction), normalize_answer(reference)} & exact_only:
        return exact_match(prediction, reference)
    pred, ref = normalize_answer(prediction).split(), normalize_answer(reference).split()
    common = Counter(pred) & Counter(ref)
    overlap = sum(common.values())
    if overlap == 0:
        return 0.0
    precision, recall = overlap / len(pred), overlap / len(ref)
    return 2 * precision * recall / (precision + recall)


def score(prediction: str, references: list[str], exact_only: frozenset[str] = frozenset()) -> dict[str, float]:
    """Exact match and F1 of one prediction against its best-matching reference."""
    if not references:
        raise ValueError("at least one reference answer is needed")
    return {"exact_match": max(exact_match(prediction, r) for r in references),
            "f1": max(f1(prediction, r, exact_only) for r in references)}


HOTPOT_EXACT_ONLY = frozenset({"yes", "no", "noanswer"})  # hotpot_evaluate_v1.py's f1_score
