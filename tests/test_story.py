"""The end-to-end story (make demo) on a tiny model: trains, serves, compares, reuses its runs."""

import pytest

from kvshare.errors import KvshareError
from kvshare.serve import LLMEngine
from kvshare.story import run_story


def test_story_runs_end_to_end_and_reuses_its_adapters(tiny_models, tmp_path, capsys, monkeypatch):
    kwargs = dict(model=str(tiny_models("llama")), workdir=tmp_path, steps=2, examples=24,
                  workflows=2, turns=2, max_tokens=4, context_tokens=64)
    events = []
    real_warm_up, real_step = LLMEngine.warm_up, LLMEngine.step
    monkeypatch.setattr(LLMEngine, "warm_up", lambda self, rows=(), adapters=False: (
        events.append(("warm_up", max(rows), adapters)), real_warm_up(self, rows, adapters))[1])
    monkeypatch.setattr(LLMEngine, "step", lambda self: (events.append("step"), real_step(self))[1])
    result = run_story(**kwargs)
    # every step the workflows run is compiled before the first one is timed: two workflows of
    # ICaRus pairs beside a checker row, with and without adapters
    assert events[:2] == [("warm_up", 5, False), ("warm_up", 5, True)] and "step" in events
    out = capsys.readouterr().out
    assert "| icarus |" in out and "| lora |" in out
    for kind in ("icarus", "alora", "lora"):
        assert (tmp_path / f"math-{kind}" / "adapter" / "kvshare.json").is_file()
    icarus, lora = result["workflows"]["icarus"], result["workflows"]["lora"]
    assert icarus["cached"] > lora["cached"]  # the ICaRus team reuses the shared history
    stamp = (tmp_path / "math-icarus" / "adapter" / "kvshare.json").stat().st_mtime_ns
    run_story(**kwargs)  # second run: no retraining
    assert (tmp_path / "math-icarus" / "adapter" / "kvshare.json").stat().st_mtime_ns == stamp
    # adapters of another base in the work folder: a clear error, not a refusal deep in the engine
    with pytest.raises(KvshareError, match="trained on another base"):
        run_story(**{**kwargs, "model": str(tiny_models("llama", seed=1))})


def test_a_workdir_with_yaml_characters_is_trained_into_as_named(tiny_models, tmp_path, monkeypatch):
    """The story's recipe overrides are YAML: a folder named "runs/my demo #2" stays whole."""
    import kvshare.story as story
    import kvshare.train.trainer as trainer

    trained = []

    def recorded(recipe, **kwargs):
        trained.append((recipe.output_dir, recipe.base_model))
        raise KvshareError("stop here")

    monkeypatch.setattr(trainer, "train", recorded)
    workdir = tmp_path / "my demo #2: x"
    with pytest.raises(KvshareError, match="stop here"):
        story.train_adapters(str(tiny_models("llama")), workdir, steps=2, examples=4)
    assert trained == [(str(workdir / "math-icarus"), str(tiny_models("llama")))]
