"""GSM8K accuracy through the engine, scored exactly as lm-eval's ``gsm8k`` task scores it.

Answer extraction and matching are lm-eval's own code (its RegexFilter and exact_match),
configured from the gsm8k.yaml that ships inside the installed lm-eval, so "strict-match"
and "flexible-extract" mean what they mean there. Two prompt formats:

- ``chat`` (default): the question as the user turn (with ``shots`` > 0, the first K training
  problems as earlier turns), the way the chat model and its adapters were trained;
- ``plain``: lm-eval's gsm8k text prompt ("Question: ...\nAnswer:", shots separated by a
  blank line) and stop strings, the first K training problems as shots; the same prompts as
  the ``gsm8k_kvshare`` lm-eval task, so the two scores can be compared sample by sample.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import yaml

from ..errors import KvshareError
from ..paths import data_dir
from ..serve import SamplingParams
from .harness import EvalTask, ci_cell, evaluate, mean_ci95


def lm_eval_gsm8k_config() -> dict:
    try:
        path = resources.files("lm_eval") / "tasks" / "gsm8k" / "gsm8k.yaml"
    except ModuleNotFoundError:
        raise KvshareError("GSM8K scoring uses lm-eval: pip install 'kvshare[eval]'") from None
    return yaml.safe_load(path.read_text())


class Scorer:
    """lm-eval's gsm8k filters and exact_match, built from its task file."""

    def __init__(self):
        from lm_eval.filters.extraction import RegexFilter

        config = lm_eval_gsm8k_config()
        self.filters = {}
        for entry in config["filter_list"]:
            regex = next(f for f in entry["filter"] if f["function"] == "regex")
            self.filters[entry["name"]] = RegexFilter(regex_pattern=regex["regex_pattern"],
                                                      group_select=regex.get("group_select", 0))
        metric = next(m for m in config["metric_list"] if m["metric"] == "exact_match")
        self.match_args = {k: metric[k] for k in ("regexes_to_ignore", "ignore_case", "ignore_punctuation")
                           if k in metric}

    def __call__(self, completion: str, reference: str) -> dict:
        from lm_eval.api.metrics import exact_match_hf_evaluate

        verdict = {}
        for name, regex in self.filters.items():
            extracted = list(regex.apply([[completion]], [None]))[0][0]  # then take_first
            correct = exact_match_hf_evaluate([extracted], [reference], **self.match_args)["exact_match"]
            verdict[name] = {"extracted": extracted, "correct": float(correct)}
        return verdict


def load_split(split: str) -> list[dict]:
    folder = data_dir()
    path = folder / "gsm8k" / f"{split}.jsonl" if folder else None
    if path is not None and path.is_file():
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    else:
        import datasets

        try:
            rows = list(datasets.load_dataset("openai/gsm8k", "main", split=split))
        except Exception as err:
            raise KvshareError(f"GSM8K {split}: no local copy and the Hub failed ({err})") from None
    return [{"id": f"gsm8k-{split}-{i}", **row} for i, row in enumerate(rows)]


def gsm8k_task(limit: int | None = None, shots: int = 0, max_tokens: int = 256,
               prompt_format: str = "chat") -> EvalTask:
    if prompt_format not in ("chat", "plain"):
        raise KvshareError(f"unknown prompt format {prompt_format!r} (chat or plain)")
    scorer = Scorer()
    test = load_split("test")[:limit] if limit else load_split("test")
    examples = load_split("train")[:shots] if shots else []
    plain_shots = "".join(f"Question: {ex['question']}\nAnswer: {ex['answer']}\n\n" for ex in examples)

    def prompt(engine, item, adapter):
        if prompt_format == "plain":
            return engine.tokenizer.encode(f"{plain_shots}Question: {item['question']}\nAnswer:",
                                           add_special_tokens=False)
        messages = []
        for ex in examples:
            messages += [{"role": "user", "content": ex["question"]}, {"role": "assistant", "content": ex["answer"]}]
        messages.append({"role": "user", "content": item["question"]})
        return engine.chat_prompt(messages, adapter)

    def judge(item, text):
        return {"reference": item["answer"].split("####")[-1].strip(), **scorer(text, item["answer"])}

    def summarize(samples, _out_dir):
        return {f: mean_ci95([s[f]["correct"] for s in samples]) for f in scorer.filters}

    def row(results):
        return (f"{shots}-shot {prompt_format} | {results['strict-match']['n']} | strict {ci_cell(results['strict-match'])} "
                f"| flexible {ci_cell(results['flexible-extract'])}")

    stops = lm_eval_gsm8k_config()["generation_kwargs"]["until"]
    return EvalTask("gsm8k", test, prompt, judge, SamplingParams(max_tokens=max_tokens, stop=stops), summarize, row,
                    {"limit": limit, "shots": shots, "prompt_format": prompt_format})


def evaluate_gsm8k(model: str, adapter: str | None, out_dir: str | Path, limit: int | None = None,
                   shots: int = 0, batch: int = 8, max_tokens: int = 256, prompt_format: str = "chat",
                   dtype: str = "float32", overwrite: bool = False, kernels: str = "auto",
                   compile: str = "auto", device: str = "cpu") -> dict:
    return evaluate(gsm8k_task(limit, shots, max_tokens, prompt_format), model, adapter, out_dir, batch, dtype,
                    overwrite, device=device, kernels=kernels, compile=compile)
