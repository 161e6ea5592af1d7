"""From examples to token batches: chat-formatted prompts, response-only loss.

ICaRus and LoRA examples are ``chat(prompt) + assistant header + response + <eos>``. aLoRA
examples put the invocation sequence between the chat-formatted prompt and the response,
so the base's KV for the prompt is shared and the adapter switches on at the invocation.
Loss covers the response tokens (and the closing eos) only. Examples longer than
``max_length`` are dropped and counted, never cut: a cut response teaches a wrong ending.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch

from .data import Example

IGNORE = -100


@dataclass
class Tokenized:
    input_ids: list[int]
    labels: list[int]
    invocation_start: int | None = None  # aLoRA: where the prompt's invocation starts


@dataclass
class TokenizeStats:
    kept: int = 0
    dropped_too_long: int = 0
    dropped_ids: list[str] = field(default_factory=list)


def invocation_ids(tokenizer, invocation: str) -> list[int]:
    """Token ids of an aLoRA invocation string (no special tokens added), with PEFT's rule."""
    ids = tokenizer.encode(invocation, add_special_tokens=False)
    special = set(tokenizer.all_special_ids)
    if not ids or ids[0] not in special or ids[-1] not in special:
        warnings.warn(
            f"aLoRA invocation {invocation!r} does not start and end with special tokens; its "
            "tokenization may change with the neighbouring text and then never match",
            stacklevel=2,
        )
    return ids


def tokenize_example(example: Example, tokenizer, *, invocation: list[int] | None = None,
                     system_prompt: str | None = None) -> Tokenized:
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": example.prompt})
    prompt = list(tokenizer.apply_chat_template(
        messages, add_generation_prompt=invocation is None, tokenize=True, return_dict=True
    )["input_ids"])
    if invocation is not None:
        prompt += invocation
    response = tokenizer.encode(example.response, add_special_tokens=False) + [tokenizer.eos_token_id]
    start = len(prompt) - len(invocation) if invocation is not None else None
    return Tokenized(prompt + response, [IGNORE] * len(prompt) + response, start)


def tokenize_all(examples: list[Example], tokenizer, max_length: int, **kwargs) -> tuple[list[Tokenized], TokenizeStats]:
    stats = TokenizeStats()
    kept = []
    for example in examples:
        item = tokenize_example(example, tokenizer, **kwargs)
        if len(item.input_ids) > max_length:
            stats.dropped_too_long += 1
            stats.dropped_ids.append(example.id)
            continue
        kept.append(item)
    stats.kept = len(kept)
    return kept, stats


def collate(items: list[Tokenized], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad to the longest item; padding is masked out of attention and loss. aLoRA
    items also get PEFT's ``alora_offsets`` (positions from the row's end to its invocation)
    from the invocation the prompt ends with: left to itself, PEFT takes the invocation's
    last occurrence, which a response may hold too, while serving looks in the prompt."""
    width = max(len(item.input_ids) for item in items)
    ids = torch.full((len(items), width), pad_id, dtype=torch.long)
    labels = torch.full((len(items), width), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(items), width), dtype=torch.long)
    for row, item in enumerate(items):
        n = len(item.input_ids)
        ids[row, :n] = torch.tensor(item.input_ids)
        labels[row, :n] = torch.tensor(item.labels)
        mask[row, :n] = 1
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    if items[0].invocation_start is not None:
        batch["alora_offsets"] = torch.tensor([width - item.invocation_start for item in items])
    return batch
