"""The manifest schema is enforced on read and write, and agrees with the sharing rules."""

from __future__ import annotations

import copy
import json

import pytest

from kvshare import manifest
from kvshare.errors import KvshareError
from kvshare.kinds import KINDS as SHARING_RULES, AdapterKind

FP = "sha256:" + "ab" * 32


def make(kind="icarus", **over):
    args = dict(name="math-icarus", kind=kind, base_name="tiny", base_family="llama",
                base_fingerprint=FP, tokenizer_fingerprint=FP, rank=8, alpha=16.0,
                target_modules=["q_proj", "o_proj"],
                provenance={"recipe": "recipes/math-icarus.yaml", "steps": 10, "seed": 0,
                            "final_loss": 1.25, "data": ["gsm8k/train.jsonl"]})
    if kind == "alora":
        args.update(invocation_string="<|invoke|>", invocation_token_ids=[3])
    args.update(over)
    return manifest.build(**args)


@pytest.mark.parametrize("kind", [k.value for k in AdapterKind])
def test_build_write_read_roundtrip(tmp_path, kind):
    data = make(kind)
    path = manifest.write(data, tmp_path)
    assert path.name == "kvshare.json"
    assert manifest.read(tmp_path) == data
    assert data["kv_sharing"]["scope"] == SHARING_RULES[AdapterKind(kind)].scope.value
    assert list(tmp_path.iterdir()) == [path]  # no temporary file left behind


def test_schema_constants_agree_with_sharing_rules():
    """The schema restates each kind's scope; it must say what kinds.py says."""
    conditions = manifest.schema()["allOf"]
    stated = {c["if"]["properties"]["kind"]["const"]:
              c["then"]["properties"]["kv_sharing"]["properties"]["scope"]["const"]
              for c in conditions}
    assert stated == {k.value: r.scope.value for k, r in SHARING_RULES.items()}
    icarus = next(c for c in conditions if c["if"]["properties"]["kind"]["const"] == "icarus")
    forbidden = icarus["then"]["properties"]["lora"]["properties"]["target_modules"]["items"]
    assert tuple(forbidden["not"]["enum"]) == SHARING_RULES[AdapterKind.ICARUS].forbidden_targets


def test_write_refuses_invalid_and_writes_nothing(tmp_path):
    data = make()
    data["lora"]["rank"] = 0
    with pytest.raises(KvshareError, match="lora/rank"):
        manifest.write(data, tmp_path)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("mutate,message", [
    (lambda d: d.update(kind="prefix"), "unknown adapter kind 'prefix'"),
    (lambda d: d.pop("base_model"), "base_model"),
    (lambda d: d["base_model"].update(fingerprint="md5:1234"), "base_model/fingerprint"),
    (lambda d: d.update(format_version=2), "format_version"),
    (lambda d: d["kv_sharing"].update(scope="all"), "kv_sharing/scope"),  # lora claiming to share
    (lambda d: d["lora"].update(target_modules=["q_proj", "q_proj"]), "target_modules"),
    (lambda d: d.update(unexpected=1), "unexpected"),
    (lambda d: d["provenance"].update(steps="ten"), "provenance/steps"),
    (lambda d: d.update(alora={"invocation_string": "x", "invocation_token_ids": [1]}), "alora"),
])
def test_read_enforces_the_schema(tmp_path, mutate, message):
    data = copy.deepcopy(make("lora"))
    mutate(data)
    (tmp_path / "kvshare.json").write_text(json.dumps(data))
    with pytest.raises(KvshareError, match=message):
        manifest.read(tmp_path)


def test_icarus_manifest_may_not_name_k_or_v(tmp_path):
    with pytest.raises(KvshareError, match="target_modules"):
        make("icarus", target_modules=["q_proj", "v_proj"])


def test_alora_manifest_needs_its_invocation():
    with pytest.raises(KvshareError, match="alora"):
        make("alora", invocation_string=None, invocation_token_ids=None)
    data = make("alora")
    assert data["alora"] == {"invocation_string": "<|invoke|>", "invocation_token_ids": [3]}


def test_eval_scores_are_optional_numbers():
    data = make(eval_scores={"gsm8k": {"accuracy": 0.12, "n": 200}})
    assert data["eval"]["gsm8k"]["accuracy"] == 0.12
    with pytest.raises(KvshareError, match="eval"):
        make(eval_scores={"gsm8k": {"accuracy": "high"}})


def test_malformed_json_is_a_clear_error(tmp_path):
    (tmp_path / "kvshare.json").write_text('{"kind": ')
    with pytest.raises(KvshareError, match="malformed JSON"):
        manifest.read(tmp_path)


def test_read_compares_the_sharing_scope_not_its_prose(tmp_path):
    """A manifest written by a version whose description was worded differently still reads;
    one whose scope contradicts its kind does not."""
    data = make("icarus")
    manifest.write(data, tmp_path)
    stored = json.loads((tmp_path / "kvshare.json").read_text())
    stored["kv_sharing"]["description"] = "Reworded by an older kvshare."
    (tmp_path / "kvshare.json").write_text(json.dumps(stored))
    assert manifest.read(tmp_path)["kv_sharing"]["scope"] == "all"
