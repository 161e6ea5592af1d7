"""Datasets for the kvshare lm-eval tasks, read through kvshare's loaders (local files first)."""

from __future__ import annotations


def gsm8k(**_kwargs):
    import datasets

    from kvshare.eval.gsm8k import load_split

    return datasets.DatasetDict({
        split: datasets.Dataset.from_list([{"question": r["question"], "answer": r["answer"]} for r in load_split(split)])
        for split in ("train", "test")
    })
