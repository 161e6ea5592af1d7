"""Which records are for evaluation only, stated once for training and evaluation alike.

Training loaders refuse every record listed here; the evaluation harnesses draw from it.
"""

from __future__ import annotations

import gzip
import json
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Iterable, Iterator

from .errors import KvshareError
from .paths import data_dir

# MBPP's standard task-id splits (Austin et al. 2021).
MBPP_SPLITS = {"prompt": range(1, 11), "test": range(11, 511), "validation": range(511, 601),
               "train": range(601, 975)}
# The local SQuAD copy holds four dev articles: two train the QA adapter, two are held out.
SQUAD_TRAIN_TITLES = ("Super_Bowl_50", "Warsaw")
SQUAD_EVAL_TITLES = ("Normans", "Nikola_Tesla")
# Files whose every record is evaluation data, relative to the data folder.
EVAL_FILES = ("gsm8k/test.jsonl", "hotpotqa/dev_hard_500.jsonl",
              "humanevalplus/HumanEvalPlus.jsonl.gz", "humanevalplus/HumanEvalPlus-Mini.jsonl.gz")
# Hugging Face splits that are evaluation data, by dataset id.
EVAL_HUB_SPLITS = {
    "openai/gsm8k": {"test"}, "gsm8k": {"test"},
    "openai/openai_humaneval": {"test"}, "openai_humaneval": {"test"},
    "evalplus/humanevalplus": {"test"},
    "google-research-datasets/mbpp": {"test", "prompt", "validation"}, "mbpp": {"test", "prompt", "validation"},
    "hotpotqa/hotpot_qa": {"validation"}, "hotpot_qa": {"validation"},
    "rajpurkar/squad": {"validation"}, "squad": {"validation"},
}


def require_data_dir() -> Path:
    folder = data_dir()
    if folder is None or not folder.is_dir():
        raise KvshareError(
            "no local data folder: set KVSHARE_DATA (or run from a folder beside shared/data), "
            "or name a Hugging Face dataset id with network access"
        )
    return folder


@lru_cache(maxsize=4)
def hotpotqa_eval_ids(folder: str | None = None) -> frozenset[str]:
    """Ids of the held-out HotpotQA questions (dev_hard_500), empty if the file is absent."""
    path = Path(folder) if folder else (data_dir() or Path("/nonexistent"))
    path = path / "hotpotqa" / "dev_hard_500.jsonl"
    if not path.is_file():
        return frozenset()
    try:
        with open(path, encoding="utf-8") as handle:
            return frozenset(json.loads(line)["_id"] for line in handle if line.strip())
    except _DAMAGED as err:
        raise damaged(path, err) from None


# what reading a damaged evaluation file raises (not JSON or UTF-8, a record without its fields)
_DAMAGED = (ValueError, KeyError, TypeError, IndexError, EOFError, OSError)


def damaged(where: Path, err: BaseException) -> KvshareError:
    """One clear error for a damaged evaluation file: every training run reads them to guard
    its data, so a traceback here would stop training on any data."""
    return KvshareError(f"an evaluation file under {where} is damaged ({type(err).__name__}: {err}); "
                        "restore it from the shared data")


def is_eval_record(source: str, record_id: str) -> bool:
    """True if ``record_id`` from loader ``source`` belongs to an evaluation set."""
    if source == "mbpp":
        return int(record_id) not in MBPP_SPLITS["train"]
    if source == "squad":
        return record_id.split("/", 1)[0] in SQUAD_EVAL_TITLES
    if source == "hotpotqa":
        return record_id in hotpotqa_eval_ids()
    if source in ("gsm8k-test", "humaneval"):
        return True
    return False


# --- content guard: catches evaluation records that arrive under another name ----------------

SHINGLE = 13  # words of a question's head used to find it inside longer texts
# shorter questions are found inside longer texts whole, from this length on (fewer words, e.g.
# "Who is he?", are ordinary phrases; such a question is caught only as a whole field)
MIN_CONTAINED = 5


def _words(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


def _eval_questions(folder: Path) -> Iterator[tuple[str, str | None, str]]:
    """(eval set, record id or None, question text) for every local evaluation record."""
    def jsonl(relative: str, opener=open):
        path = folder / relative
        if not path.is_file():
            return []
        with opener(path, "rt", encoding="utf-8") as handle:
            return [json.loads(line) for line in handle if line.strip()]

    for row in jsonl("gsm8k/test.jsonl"):
        yield "gsm8k test", None, row["question"]
    for row in jsonl("hotpotqa/dev_hard_500.jsonl"):
        yield "hotpotqa dev_hard_500", row["_id"], row["question"]
    for row in jsonl("humanevalplus/HumanEvalPlus.jsonl.gz", gzip.open):
        yield "humaneval", row["task_id"], row["prompt"]
    for row in jsonl("mbpp/mbpp.jsonl"):
        if int(row["task_id"]) not in MBPP_SPLITS["train"]:
            yield "mbpp test/validation", None, row["text"]
    squad = folder / "squad" / "dev-v1.1-small.json"
    if squad.is_file():
        data = json.loads(squad.read_text(encoding="utf-8"))
        for article in data["data"] if isinstance(data, dict) else data:
            if article["title"] in SQUAD_EVAL_TITLES:
                for paragraph in article["paragraphs"]:
                    for qa in paragraph["qas"]:
                        yield "squad held-out articles", qa["id"], qa["question"]


@dataclass(frozen=True)
class EvalGuard:
    """Index of evaluation records by id and by question text.

    A training record matches when one of its ids is an evaluation id, or one of its texts
    is or contains a whole evaluation question (case, punctuation and spacing ignored; inside
    a longer text, questions of at least ``MIN_CONTAINED`` words), so a question wrapped in a
    template or a longer prompt is caught too. Partial overlaps are not: near-duplicate
    phrasing is common in these sets and is not leakage.
    """

    ids: dict[str, str]
    texts: dict[str, str]  # normalised question -> evaluation set
    heads: dict[str, list[str]]  # first SHINGLE words -> the long questions starting so
    short: dict[tuple[str, ...], str]  # the words of questions of MIN_CONTAINED..SHINGLE-1 words -> set

    def match(self, ids: Iterable[str] = (), texts: Iterable[str] = ()) -> str | None:
        """The evaluation set a record belongs to, or None."""
        for record_id in ids:
            if record_id in self.ids:
                return self.ids[record_id]
        for text in texts:
            words = _words(text)
            joined = " ".join(words)
            if joined in self.texts:
                return self.texts[joined]
            padded = f" {joined} "
            for start in range(len(words) - SHINGLE + 1):
                for question in self.heads.get(" ".join(words[start:start + SHINGLE]), ()):
                    if f" {question} " in padded:
                        return self.texts[question]
            for start in range(len(words) if self.short else 0):
                for end in range(start + MIN_CONTAINED, min(start + SHINGLE, len(words) + 1)):
                    found = self.short.get(tuple(words[start:end]))
                    if found:
                        return found
        return None


@lru_cache(maxsize=4)
def eval_guard(folder: str | None = None) -> EvalGuard:
    """The guard built from the local evaluation files (empty where they are absent)."""
    root = Path(folder) if folder else data_dir()
    ids: dict[str, str] = {}
    texts: dict[str, str] = {}
    heads: dict[str, list[str]] = {}
    short: dict[tuple[str, ...], str] = {}
    if root is not None and root.is_dir():
        try:
            questions = list(_eval_questions(root))
        except _DAMAGED as err:
            raise damaged(root, err) from None
        for name, record_id, question in questions:
            if record_id:
                ids[str(record_id)] = name
            words = _words(question)
            if words:
                texts[" ".join(words)] = name
            if len(words) >= SHINGLE:
                heads.setdefault(" ".join(words[:SHINGLE]), []).append(" ".join(words))
            elif len(words) >= MIN_CONTAINED:
                short[tuple(words)] = name
    return EvalGuard(ids, texts, heads, short)


def eval_hub_splits(dataset: str, split: str) -> list[str]:
    """The evaluation splits a Hub split expression reads (``test[:50%]``, ``train+test``).

    The expression is parsed with ``datasets``' own grammar; one it cannot parse is an error,
    since loading would fail on it too.
    """
    from datasets import ReadInstruction

    try:
        names = [r.splitname for r in ReadInstruction.from_spec(split)._relative_instructions]
    except (ValueError, AssertionError, AttributeError) as err:
        raise KvshareError(f"{dataset}: split {split!r} is not a split expression ({err})") from None
    held_out = EVAL_HUB_SPLITS.get(dataset.lower(), set()) | EVAL_HUB_SPLITS.get(
        dataset.lower().rsplit("/", 1)[-1], set())
    return [name for name in names if name.lower() in held_out]
