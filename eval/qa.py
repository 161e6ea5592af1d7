"""Extractive QA F1 through the engine: HotpotQA (distractor) and held-out SQuAD articles.

Prompts use the same layout as the QA adapters' training data (paragraphs, then the
question; ``kvshare.train.data.qa_prompt``), as the chat user turn.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import KvshareError
from ..splits import SQUAD_EVAL_TITLES, require_data_dir
from ..serve import SamplingParams
from ..train.data import qa_prompt
from .f1 import HOTPOT_EXACT_ONLY, score
from .harness import EvalTask, ci_cell, evaluate, mean_ci95


def load_items(dataset: str) -> list[dict]:
    folder = require_data_dir()
    if dataset == "hotpotqa":
        items = []
        for line in (folder / "hotpotqa" / "dev_hard_500.jsonl").read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                paragraphs = [(title, "".join(sents)) for title, sents in row["context"]]
                items.append({"id": row["_id"], "prompt": qa_prompt(row["question"], paragraphs),
                              "answers": [row["answer"]]})
        return items
    if dataset == "squad":
        data = json.loads((folder / "squad" / "dev-v1.1-small.json").read_text())
        return [{"id": qa["id"], "prompt": qa_prompt(qa["question"], [("", p["context"])]),
                 "answers": [a["text"] for a in qa["answers"]]}
                for article in data["data"] if article["title"] in SQUAD_EVAL_TITLES
                for p in article["paragraphs"] for qa in p["qas"]]
    raise KvshareError(f"unknown F1 data set {dataset!r} (hotpotqa or squad)")


def f1_task(dataset: str = "hotpotqa", limit: int | None = None, max_tokens: int = 32) -> EvalTask:
    items = load_items(dataset)[:limit] if limit else load_items(dataset)

    def prompt(engine, item, adapter):
        return engine.chat_prompt([{"role": "user", "content": item["prompt"]}], adapter)

    def judge(item, text):
        answer = text.strip().split("\n")[0]
        exact_only = HOTPOT_EXACT_ONLY if dataset == "hotpotqa" else frozenset()
        return {"answers": item["answers"], "prediction": answer, **score(answer, item["answers"], exact_only)}

    def summarize(samples, _out_dir):
        return {"f1": mean_ci95([s["f1"] for s in samples]), "exact_match": mean_ci95([s["exact_match"] for s in samples])}

    def row(results):
        return f"{results['f1']['n']} | F1 {ci_cell(results['f1'])} | EM {ci_cell(results['exact_match'])}"

    # scoring 2: HotpotQA's yes/no rule (2026-11-26)
    return EvalTask(f"f1-{dataset}", items, prompt, judge, SamplingParams(max_tokens=max_tokens), summarize, row,
                    {"limit": limit}, scoring=2)


def evaluate_f1(model: str, adapter: str | None, out_dir: str | Path, dataset: str = "hotpotqa",
                limit: int | None = None, batch: int = 8, max_tokens: int = 32, dtype: str = "float32",
                overwrite: bool = False, kernels: str = "auto", compile: str = "auto", device: str = "cpu") -> dict:
    return evaluate(f1_task(dataset, limit, max_tokens), model, adapter, out_dir, batch, dtype, overwrite,
                    device=device, kernels=kernels, compile=compile)
