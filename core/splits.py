"""Which records are for evaluation only, stated once for training and evaluation alike.

Training loaders refuse every record listed here; the evaluation harnesses draw from it.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

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
    with open(path, encoding="utf-8") as handle:
        return frozenset(json.loads(line)["_id"] for line in handle if line.strip())


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
