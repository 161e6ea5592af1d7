"""Random, non-zero adapters of any kind: for tests, and for benchmarks whose speed does not
depend on the adapter's values.

PEFT initialises B to zero (an adapter equal to the base); measuring sharing needs adapters
that really change the output, so both factors are randomised here.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .kinds import kind_spec

ICARUS_TARGETS = kind_spec("icarus").default_targets


def make_peft_adapter(
    base_dir: Path | str,
    out_dir: Path | str,
    *,
    target_modules: tuple[str, ...] | list[str] = ICARUS_TARGETS,
    rank: int = 4,
    alpha: float = 8.0,
    invocation_tokens: list[int] | None = None,
    task_type: str | None = "CAUSAL_LM",
    seed: int = 0,
    b_std: float = 0.2,
) -> Path:
    """Save a PEFT LoRA checkpoint for ``base_dir`` with random, non-zero A and B (B's spread
    ``b_std``: a smaller one changes a real model without drowning it)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(base_dir))
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=list(target_modules),
        task_type=task_type,
        alora_invocation_tokens=invocation_tokens,
    )
    model = get_peft_model(base, config)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_A" in name or "lora_B" in name:
                    param.normal_(0.0, b_std if "lora_B" in name else 0.2)
    model.save_pretrained(str(out_dir))
    return Path(out_dir)


def random_adapter(kind: str, base_dir: Path | str, folder: Path | str, name: str, *, seed: int = 0,
                   rank: int = 8, targets: tuple[str, ...] | None = None, invocation: str | None = None,
                   tokenizer=None) -> Path:
    """Export a random adapter of ``kind`` (its kind's default targets unless given) to
    ``folder/name``; an aLoRA needs ``invocation`` and the base's ``tokenizer``."""
    from .export import export_adapter

    folder = Path(folder)
    spec = kind_spec(kind)
    ids = tokenizer.encode(invocation, add_special_tokens=False) if spec.needs_invocation else None
    ckpt = make_peft_adapter(base_dir, folder / f"{name}-ckpt", target_modules=targets or spec.default_targets,
                             rank=rank, seed=seed, invocation_tokens=ids)
    return export_adapter(ckpt, kind=kind, base=base_dir, out=folder / name, name=name,
                          invocation=invocation if spec.needs_invocation else None)
