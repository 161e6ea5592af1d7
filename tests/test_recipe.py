"""Recipes: every shipped recipe validates; mistakes are one clear error."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvshare.errors import KvshareError
from kvshare.kinds import kind_spec
from kvshare.train.recipe import load_recipe

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = sorted((ROOT / "recipes").glob("*.yaml"))

BASE = """\
name: r
base_model: smollm2-135m-instruct
adapter: {kind: icarus, rank: 8, alpha: 16}
data:
  sources: [{name: gsm8k}]
train: {max_steps: 10}
output_dir: runs/r
"""


def write(tmp_path, text: str) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    return path


def test_shipped_recipes_cover_every_task_and_kind():
    names = {p.stem for p in SHIPPED}
    assert {f"{task}-{kind}" for task in ("math", "code", "qa")
            for kind in ("icarus", "alora", "lora")} <= names


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_shipped_recipe_is_valid(path):
    recipe = load_recipe(path)
    assert recipe.name == path.stem
    assert recipe.notes and "measured" in recipe.notes


def test_defaults_and_overrides(tmp_path):
    recipe = load_recipe(write(tmp_path, BASE), ["train.lr=1e-4", "adapter.rank=4", "train.seed=3"])
    assert recipe.train.lr == 1e-4 and recipe.adapter.rank == 4 and recipe.train.seed == 3
    assert recipe.adapter.target_modules == list(kind_spec(recipe.adapter.kind).default_targets)
    assert recipe.train.schedule == "cosine"


@pytest.mark.parametrize("text,overrides,message", [
    (BASE + "extra: 1\n", [], "extra: unknown key"),
    (BASE, ["train.lr=fast"], "train.lr"),
    (BASE, ["adapter.kind=prefix"], "adapter.kind"),
    (BASE, ["adapter.target_modules=[q_proj, k_proj]"], "may not target k_proj"),
    (BASE, ["adapter.kind=alora"], "invocation"),
    (BASE, ["train.epochs=1"], "exactly one of max_steps or epochs"),
    (BASE.replace("{name: gsm8k}", "{path: nowhere.jsonl, prompt_field: q, response_field: a}"), [],
     "nowhere.jsonl does not exist"),
    (BASE.replace("{name: gsm8k}", "{path: x.jsonl}"), [], "prompt_field"),
    (BASE, ["train.lr"], "key=value"),
    (BASE, ["adapter.target_modules=[]"], "adapter.target_modules"),
    (BASE, ["train.seed=-1"], "train.seed"),
    (BASE.replace("{name: gsm8k}", "{name: gsm8k, split: test}"), [], "split only apply to hub sources"),
    (BASE.replace("{name: gsm8k}", "{name: gsm8k, config: socratic}"), [], "config only apply to hub sources"),
    (BASE.replace("{name: gsm8k}", "{name: gsm8k, prompt_field: q}"), [], "only apply to path and hub"),
    ("- just\n- a list\n", [], "mapping"),
    ("name: [unclosed\n", [], "malformed YAML"),
])
def test_bad_recipes(tmp_path, text, overrides, message):
    with pytest.raises(KvshareError, match=message):
        load_recipe(write(tmp_path, text), overrides)


@pytest.mark.parametrize("text,overrides,key", [
    (BASE, ["adapter.rank=yes"], "adapter.rank"),
    (BASE, ["adapter.rank=true"], "adapter.rank"),
    (BASE.replace("rank: 8", "rank: on"), [], "adapter.rank"),
    (BASE, ["adapter.alpha=true"], "adapter.alpha"),
    (BASE, ["train.max_steps=null", "train.epochs=.inf"], "train.epochs"),
    (BASE, ["train.max_steps=null", "train.epochs=inf"], "train.epochs"),
    (BASE, ["train.max_steps=null", "train.epochs=.nan"], "train.epochs"),
    (BASE, ["train.lr=.inf"], "train.lr"),
    (BASE, ["train.max_steps=2.5"], "train.max_steps"),
    (BASE, ["train.batch_size=0"], "train.batch_size"),
    (BASE.replace("{name: gsm8k}", "{name: gsm8k, limit: yes}"), [], "data.sources.0.limit"),
])
def test_a_boolean_or_infinity_is_not_a_number(tmp_path, text, overrides, key):
    """YAML's yes/true would otherwise train rank 1, and .inf epochs crash the trainer."""
    with pytest.raises(KvshareError, match=rf"recipe.yaml: {key}: "):
        load_recipe(write(tmp_path, text), overrides)


def test_whole_numbers_and_yaml_no_still_read(tmp_path):
    recipe = load_recipe(write(tmp_path, BASE), ["adapter.rank=4.0", "train.mixed_precision=no",
                                                   "train.gradient_checkpointing=yes"])
    assert recipe.adapter.rank == 4 and type(recipe.adapter.rank) is int
    assert recipe.train.mixed_precision == "no" and recipe.train.gradient_checkpointing is True


def test_a_boolean_rank_is_one_error_line_via_cli(cli, tmp_path):
    from conftest import assert_one_line_error

    assert_one_line_error(cli("train", write(tmp_path, BASE), "adapter.rank=yes"), "adapter.rank: expected a number")


def test_missing_recipe_file_via_cli(cli, tmp_path):
    from conftest import assert_one_line_error

    assert_one_line_error(cli("train", tmp_path / "none.yaml"), "no such recipe file")


def test_recipe_drift_names_the_keys_that_change_training(tmp_path):
    from kvshare.train.recipe import recipe_drift

    saved = load_recipe(write(tmp_path, BASE)).model_dump(mode="json")
    same = load_recipe(write(tmp_path, BASE), ["train.log_every=1", "notes=moved", "output_dir=elsewhere"])
    assert recipe_drift(saved, same) == []
    changed = load_recipe(write(tmp_path, BASE), ["train.lr=1e-4", "adapter.rank=4",
                                                  "data.sources=[{name: mbpp}]"])
    assert recipe_drift(saved, changed) == ["adapter.rank", "data.sources.0.name", "train.lr"]
