"""ForkKV's quality harness (eval/perf/forkkv_quality) on the tiny model with random lora agents.

The properties the real table rests on: exact-mode turns are what each agent gives alone (so
one exact run serves every N), the sharing modes really read another agent's K/V, ForkKV's
layer-0 hidden state is exact, and full reuse drifts further than ForkKV by the last layer.
"""

from __future__ import annotations

import json

import pytest

from kvshare.errors import KvshareError
from kvshare.eval.perf.forkkv_quality import run_forkkv_quality, turn_order
from kvshare.eval.qa import f1_task
from kvshare.serve import LLM

from test_engine import adapters, base, invocation, tokenizer  # noqa: F401

BS = 4
SETTINGS = {"limit": 3, "cosine_examples": 3, "max_tokens": 6, "block_size": BS, "kv_cache_tokens": 4096}


@pytest.fixture
def qa_data(tmp_path, monkeypatch):
    """Three HotpotQA-shaped and three held-out SQuAD questions, local (no network)."""
    folder = tmp_path / "data"
    (folder / "hotpotqa").mkdir(parents=True)
    (folder / "squad").mkdir()
    rows = [{"_id": f"h{i}", "question": f"Which city is number {i}?", "answer": f"city {i}",
             "context": [[f"Title {i}", [f"City {i} lies on a river. ", "It has a bridge."]],
                         ["Other", [f"Town {i + 1} is far away from it."]]]} for i in range(3)]
    (folder / "hotpotqa" / "dev_hard_500.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    squad = {"data": [{"title": "Normans", "paragraphs": [{
        "context": "The Normans were the people who gave their name to Normandy, a region in France.",
        "qas": [{"id": f"s{i}", "question": q, "answers": [{"text": a}]} for i, (q, a) in enumerate(
            [("Who gave their name to Normandy?", "The Normans"), ("Where is Normandy?", "France"),
             ("What is Normandy?", "a region")])]}]}]}
    (folder / "squad" / "dev-v1.1-small.json").write_text(json.dumps(squad))
    monkeypatch.setenv("KVSHARE_DATA", str(folder))
    return folder


@pytest.fixture
def results(base, adapters, qa_data, tmp_path):
    agents = [adapters["lora-a"], adapters["lora-b"]]
    return run_forkkv_quality(agents, model=str(base), tasks=("hotpotqa", "squad"), agent_counts=(2,),
                              out_dir=tmp_path / "out", **SETTINGS)


def test_turns_rotate_so_every_agent_goes_first():
    assert [turn_order(["a", "b", "c"], i) for i in range(4)] == [
        ["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]


def test_exact_turns_equal_each_agent_alone(results, base, adapters):
    """Exact K/V is private, so an agent's answer does not depend on who spoke before it."""
    task = f1_task("hotpotqa", 3, SETTINGS["max_tokens"])
    exact = [s for s in results["samples"] if s["mode"] == "exact" and s["task"] == "hotpotqa"]
    assert len(exact) == 3 * 2 and {s["turn"] for s in exact} == {0, 1}
    for source, name in ((adapters["lora-a"], "agent0-lora-a"), (adapters["lora-b"], "agent1-lora-b")):
        alone = LLM(base, [], kv_cache_tokens=4096, block_size=BS)
        alone.engine.load_adapter(source, name)
        for item in task.items:
            out = alone.generate([task.prompt(alone.engine, item, name)], task.params, adapter=name)[0]
            [record] = [s for s in exact if s["id"] == item["id"] and s["agent"] == name]
            assert record["output"] == out.text


def test_sharing_modes_read_the_first_agents_kv(results):
    """Full reuse hits the first agent's whole K/V; a later ForkKV agent recomputes its own
    residual (nothing counted as cached) over the first agent's base part, so its hidden
    states are no longer its exact ones."""
    for task in ("hotpotqa", "squad"):
        stats = results["stats"]
        assert stats[f"{task}/exact"]["prefix_hit_tokens_forkkv_base"] == 0
        assert stats[f"{task}/exact"]["prefix_hit_tokens_lora_full_reuse"] == 0
        assert stats[f"{task}/full_reuse/N=2"]["prefix_hit_tokens_lora_full_reuse"] > 0
        assert results["cosine"][task]["forkkv"]["mean"][-1] < 1 - 1e-6
    later = [s for s in results["samples"] if s["mode"] == "full_reuse" and s["turn"] == 1]
    assert later and all(s["cached_tokens"] >= s["prompt_tokens"] // BS * BS - BS for s in later)


def test_forkkv_is_exact_at_layer_zero_and_closer_than_full_reuse_at_the_last(results):
    for task, cosine in results["cosine"].items():
        assert cosine["examples"] == 3
        assert cosine["forkkv"]["min"][0] == pytest.approx(1.0, abs=1e-5), task
        assert cosine["full_reuse"]["mean"][0] < 1 - 1e-4, task  # lora-a's own K/V at layer 0
        assert cosine["full_reuse"]["mean"][-1] < cosine["forkkv"]["mean"][-1], task


def test_table_scores_every_agent_and_mode(results, tmp_path):
    [hotpot, squad] = results["quality"]
    for row in (hotpot, squad):
        assert row["agents"] == 2 and set(row["modes"]) == {"exact", "forkkv", "full_reuse"}
        assert row["modes"]["exact"]["drop_vs_exact"] == 0
        for mode in row["modes"].values():
            assert mode["answers"] == 3 * 2 and 0 <= mode["f1"] <= 1
            expected = [s["f1"] for s in results["samples"] if s["task"] == row["task"]
                        and s["mode"] == next(k for k, v in row["modes"].items() if v is mode)]
            assert mode["f1"] == pytest.approx(sum(expected) / len(expected))
    out = tmp_path / "out"
    table = (out / "quality.md").read_text()
    assert "| hotpotqa | 2 | 3 |" in table and "| squad | 2 | 3 |" in table and "full reuse" in table
    saved = json.loads((out / "quality.json").read_text())
    assert "samples" not in saved and saved["average"] == pytest.approx(results["average"])
    assert len((out / "quality_samples.jsonl").read_text().splitlines()) == len(results["samples"])
    assert (out / "cosine.png").stat().st_size > 0


def test_bad_requests_are_refused(base, adapters, qa_data, cli):
    with pytest.raises(KvshareError, match="--agents"):
        run_forkkv_quality([adapters["lora-a"], adapters["lora-b"]], model=str(base), agent_counts=(3,))
    with pytest.raises(KvshareError, match="compares lora adapters"):
        run_forkkv_quality([adapters["lora-a"], adapters["icarus-a"]], model=str(base), agent_counts=(2,),
                           tasks=("squad",), **SETTINGS)
    result = cli("bench", "forkkv-quality", "--model", base, "--adapters", adapters["lora-a"], "--agents", "2")
    assert result.code == 1 and "kvshare: error:" in result.err
