"""Training recipes: YAML files validated into one typed object, with command-line overrides.

A recipe names the base, the adapter kind and its LoRA shape, the data, and the schedule, so
that ICaRus, aLoRA and conventional LoRA runs differ only where their kind requires.
Overrides use dotted keys: ``train.lr=1e-4 adapter.rank=8``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from ..yamlspec import StrictSpec, load_spec
from ..kinds import AdapterKind, kind_spec
from .evaluation import EVAL_TASKS


class AdapterSpec(StrictSpec):
    kind: AdapterKind
    rank: int = Field(16, ge=1)
    alpha: float = Field(32.0, gt=0)
    dropout: float = Field(0.05, ge=0, lt=1)
    target_modules: list[str] | None = Field(None, min_length=1)
    invocation: str | None = None  # aLoRA only: the text that activates the adapter

    @model_validator(mode="after")
    def _kind_rules(self):
        if self.target_modules is None:
            self.target_modules = list(kind_spec(self.kind).default_targets)
        forbidden = sorted(set(self.target_modules) & set(kind_spec(self.kind).forbidden_targets))
        if forbidden:
            raise ValueError(
                f"an {self.kind.value} adapter may not target {', '.join(forbidden)}: keys and values "
                "always come from the frozen base, so LoRA there would be dead weight and would "
                "break KV sharing"
            )
        if kind_spec(self.kind).needs_invocation and not self.invocation:
            raise ValueError("an alora adapter needs an invocation string")
        if not kind_spec(self.kind).needs_invocation and self.invocation:
            raise ValueError(f"invocation is only for alora adapters, not {self.kind.value}")
        return self


class DataSource(StrictSpec):
    """One of: a named loader (``name``), a local file (``path``) or a Hub dataset (``hub``)."""

    name: str | None = None
    path: str | None = None
    hub: str | None = None
    config: str | None = None
    split: str = "train"
    prompt_field: str | None = None
    response_field: str | None = None
    limit: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _one_origin(self):
        origins = [o for o in (self.name, self.path, self.hub) if o]
        if len(origins) != 1:
            raise ValueError("give exactly one of name, path or hub")
        if (self.path or self.hub) and not (self.prompt_field and self.response_field):
            raise ValueError("path and hub sources need prompt_field and response_field")
        if self.path and not Path(self.path).is_file():
            raise ValueError(f"data file {self.path} does not exist")
        # a named loader has its own split and fields, a file its one split: else ignored without a word
        hub_only = [key for key in ("config", "split") if getattr(self, key) not in (None, "train")]
        if hub_only and not self.hub:
            raise ValueError(f"{', '.join(hub_only)} only apply to hub sources")
        if self.name and (self.prompt_field or self.response_field):
            raise ValueError("prompt_field and response_field only apply to path and hub sources")
        return self

    @property
    def label(self) -> str:
        return self.name or self.path or f"{self.hub}:{self.split}"


class DataSpec(StrictSpec):
    sources: list[DataSource] = Field(min_length=1)
    max_length: int = Field(512, ge=8)
    system_prompt: str | None = None
    shuffle_seed: int | None = Field(None, ge=0, lt=2 ** 32)  # the data order's seed (as HF's data_seed); None: train.seed


class TrainSpec(StrictSpec):
    batch_size: int = Field(4, ge=1)
    grad_accum: int = Field(1, ge=1)
    lr: float = Field(2e-4, gt=0)
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    warmup_ratio: float = Field(0.03, ge=0, lt=1)
    weight_decay: float = Field(0.0, ge=0)
    max_grad_norm: float | None = Field(1.0, gt=0)
    max_steps: int | None = Field(None, ge=1)
    epochs: float | None = Field(None, gt=0)
    seed: int = Field(0, ge=0, lt=2 ** 32)  # numpy's range (accelerate seeds it too)
    mixed_precision: Literal["no", "bf16", "auto"] = "no"  # auto: bf16 only where it is fast
    log_every: int = Field(10, ge=1)
    save_every: int = Field(100, ge=1)
    # recompute activations in the backward pass instead of keeping them (less memory, ~30% slower)
    gradient_checkpointing: bool = False
    # experiment trackers that receive every metrics.jsonl record (which stays the source of truth)
    report_to: list[Literal["tensorboard", "trackio"]] = Field(default_factory=list)
    # score the adapter through the serving engine every N steps on the first eval_limit items
    eval_every: int | None = Field(None, ge=1)
    eval_task: str | None = None
    eval_limit: int = Field(20, ge=1)
    eval_max_tokens: int | None = Field(None, ge=1)
    # seconds a process may wait for the others (e.g. while the main one evaluates), as HF's
    # TrainingArguments.ddp_timeout
    ddp_timeout: int = Field(1800, ge=1)

    @field_validator("mixed_precision", mode="before")
    @classmethod
    def _yaml_no(cls, value):
        return "no" if value is False else value  # YAML 1.1 reads a bare `no` as false

    @field_validator("report_to", mode="before")
    @classmethod
    def _one_tracker(cls, value):
        return [value] if isinstance(value, str) else value  # report_to: tensorboard

    @model_validator(mode="after")
    def _length(self):
        if (self.max_steps is None) == (self.epochs is None):
            raise ValueError("give exactly one of max_steps or epochs")
        if (self.eval_every is None) != (self.eval_task is None):
            raise ValueError("eval_every and eval_task go together")
        if self.eval_task is not None and self.eval_task not in EVAL_TASKS:
            raise ValueError(f"unknown eval_task {self.eval_task!r} (known: {', '.join(EVAL_TASKS)})")
        return self


class Recipe(StrictSpec):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    base_model: str
    adapter: AdapterSpec
    data: DataSpec
    train: TrainSpec
    output_dir: str
    notes: str | None = None  # e.g. the measured time per run on the reference machine


def load_recipe(path: str | Path, overrides: list[str] | None = None) -> Recipe:
    """Read, override and validate a recipe; every problem is one clear KvshareError."""
    return load_spec(path, Recipe, "recipe", overrides)


# Keys that may change between a run and its resumption: they do not alter what is trained.
RESUME_FREE_KEYS = ("notes", "output_dir", "train.log_every", "train.save_every", "train.report_to",
                    "train.eval_", "train.gradient_checkpointing", "train.ddp_timeout")


def recipe_drift(saved: dict, recipe: Recipe) -> list[str]:
    """Dotted keys whose values differ between a run's stored recipe and ``recipe``."""
    old, new = flatten(saved), flatten(recipe.model_dump(mode="json"))
    return sorted(k for k in old.keys() | new.keys()
                  if old.get(k) != new.get(k) and not k.startswith(RESUME_FREE_KEYS))


def flatten(value, prefix: str = "") -> dict:
    """Nested dicts (and lists holding them) as ``{"dotted.key": leaf}``."""
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list) and any(isinstance(v, (dict, list)) for v in value):
        items = ((str(i), v) for i, v in enumerate(value))
    else:
        return {prefix: value}
    out: dict = {}
    for key, inner in items:
        out.update(flatten(inner, f"{prefix}.{key}" if prefix else str(key)))
    return out
