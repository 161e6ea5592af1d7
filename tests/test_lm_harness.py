"""lm-eval integration: the registered ``kvshare`` model scores like lm-eval's own HF model,
and our GSM8K harness gives lm-eval's GSM8K score on the same examples."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402

from kvshare.errors import KvshareError  # noqa: E402
from kvshare.eval.harness import logged_samples  # noqa: E402
from kvshare.eval.lm_harness import TASKS_DIR, KvshareLM  # noqa: E402
from kvshare.export import export_adapter  # noqa: E402
from kvshare.testing import make_peft_adapter  # noqa: E402

PAIRS = [("The capital of France is", " Paris"), ("def add(a, b):\n    return", " a + b"),
         ("Question: what is 2 + 2?\nAnswer:", " 4"), ("x", " y z w")]


def requests(kind, args_list):
    return [Instance(request_type=kind, doc={}, arguments=args, idx=i) for i, args in enumerate(args_list)]


@pytest.fixture(scope="module")
def lora(tiny_models, tmp_path_factory):
    base = tiny_models("llama")
    root = tmp_path_factory.mktemp("lm-harness")
    ckpt = make_peft_adapter(base, root / "ckpt", target_modules=["q_proj", "v_proj", "down_proj"], seed=7)
    return base, export_adapter(ckpt, kind="lora", base=base, out=root / "lora")


@pytest.mark.parametrize("with_adapter", [False, True], ids=["base", "lora"])
def test_loglikelihood_equals_lm_evals_hf_model(lora, with_adapter):
    from lm_eval.models.huggingface import HFLM

    base, adapter = lora
    ours = KvshareLM(pretrained=str(base), adapter=str(adapter) if with_adapter else None, batch_size=3)
    theirs = HFLM(pretrained=str(base), peft=str(adapter) if with_adapter else None, device="cpu",
                  batch_size=3, dtype="float32")
    got = ours.loglikelihood(requests("loglikelihood", PAIRS), disable_tqdm=True)
    want = theirs.loglikelihood(requests("loglikelihood", PAIRS), disable_tqdm=True)
    torch.testing.assert_close(torch.tensor([g[0] for g in got]), torch.tensor([w[0] for w in want]),
                               atol=1e-4, rtol=0)
    assert [g[1] for g in got] == [w[1] for w in want]
    texts = [("Paris is the capital of France. " * 3,), ("def f(x):\n    return x * 2\n",)]
    rolled = ours.loglikelihood_rolling(requests("loglikelihood_rolling", texts), disable_tqdm=True)
    reference = theirs.loglikelihood_rolling(requests("loglikelihood_rolling", texts), disable_tqdm=True)
    torch.testing.assert_close(torch.tensor(rolled), torch.tensor(reference), atol=1e-3, rtol=0)


def test_generate_until_stops_like_lm_eval(lora):
    from lm_eval.models.huggingface import HFLM

    base, _ = lora
    ours = KvshareLM(pretrained=str(base))
    theirs = HFLM(pretrained=str(base), device="cpu", batch_size=2, dtype="float32")
    args = [("Question: what is 2 + 2?\nAnswer:", {"until": ["Question:", "\n\n"], "max_gen_toks": 24, "do_sample": False}),
            ("def add(a, b):", {"until": ["\n"], "max_gen_toks": 16})]
    assert ours.generate_until(requests("generate_until", args), disable_tqdm=True) == \
        theirs.generate_until(requests("generate_until", args), disable_tqdm=True)


def test_generate_until_reads_gen_kwargs_as_lm_evals_models_do(lora, monkeypatch):
    base, _ = lora
    ours = KvshareLM(pretrained=str(base), max_gen_toks=32)
    seen = []
    monkeypatch.setattr(ours, "_run", lambda prompts, params, *a: seen.extend(params) or
                        [type("Out", (), {"text": ""})()] * len(prompts))
    args = [("a", {"until": "\n", "temperature": 0.7, "seed": 3}),  # a temperature alone samples
            ("b", {"do_sample": False, "temperature": 0.7}),  # unless do_sample says no
            ("c", {"max_new_tokens": 5}), ("d", {"max_tokens": 6}), ("e", {})]
    ours.generate_until(requests("generate_until", args), disable_tqdm=True)
    assert [p.temperature for p in seen] == [0.7, 0, 0, 0, 0]
    assert [p.max_tokens for p in seen] == [32, 32, 5, 6, 32] and seen[0].stop == ["\n"] and seen[0].seed == 3
    with pytest.raises(KvshareError, match="no room for the prompt"):
        ours.generate_until(requests("generate_until", [("a", {"max_gen_toks": ours.max_length})]), disable_tqdm=True)


def test_an_empty_continuation_scores_log_one(lora):
    base, _ = lora
    ours = KvshareLM(pretrained=str(base))
    got = ours._loglikelihood_tokens([(None, [5, 6, 7], []), (None, [5, 6], [7])], disable_tqdm=True)
    assert got[0] == (0.0, True) and got[1][0] < 0


@pytest.mark.integration
def test_our_gsm8k_score_equals_lm_evals_through_the_kvshare_model(smollm2_dir, tmp_path):
    """Same examples, same prompts, same engine: lm-eval (simple_evaluate on the local
    gsm8k_kvshare task) and ``kvshare eval gsm8k --prompt-format plain`` agree sample by sample."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    from kvshare.eval.gsm8k import evaluate_gsm8k

    limit, shots = 4, 1
    ours = evaluate_gsm8k(str(smollm2_dir), None, tmp_path / "ours", limit=limit, shots=shots,
                          prompt_format="plain", max_tokens=96)
    theirs = lm_eval.simple_evaluate(model="kvshare", model_args=f"pretrained={smollm2_dir},max_gen_toks=96",
                                     tasks=["gsm8k_kvshare"], num_fewshot=shots, limit=limit, log_samples=True,
                                     task_manager=TaskManager(include_path=str(TASKS_DIR)))
    samples = logged_samples(tmp_path / "ours" / "samples.jsonl")
    logged = sorted((s for s in theirs["samples"]["gsm8k_kvshare"] if s["filter"] == "strict-match"),
                    key=lambda s: s["doc_id"])  # lm-eval logs each sample once per filter
    assert len(logged) == len(samples) == limit
    for mine, their in zip(samples, logged):
        assert mine["prompt"] == their["arguments"][0][0]
        assert mine["output"] == their["resps"][0][0]
        by_filter = {s["filter"]: s["filtered_resps"][0] for s in theirs["samples"]["gsm8k_kvshare"]
                     if s["doc_id"] == their["doc_id"]}
        assert by_filter == {name: mine[name]["extracted"] for name in ("strict-match", "flexible-extract")}
    scores = theirs["results"]["gsm8k_kvshare"]
    for name in ("strict-match", "flexible-extract"):
        assert ours[name]["mean"] == pytest.approx(scores[f"exact_match,{name}"])
        assert ours[name]["stderr"] == pytest.approx(scores[f"exact_match_stderr,{name}"])
    # something was actually extracted, so the comparison is not between two empty columns
    assert any(s["flexible-extract"]["extracted"] != "[invalid]" for s in samples)


def test_kvshare_lm_eval_command_runs_lm_evals_cli_with_our_model_and_tasks(tiny_models, tmp_path, cli):
    listing = cli("lm-eval", "ls", "tasks")
    assert listing.code == 0 and "gsm8k_kvshare" in listing.out
    assert cli("lm-eval", "--help").code == 0
    base = tiny_models("llama")
    run = cli("lm-eval", "--model", "kvshare", "--model_args", f"pretrained={base}", "--tasks", "gsm8k_kvshare",
              "--num_fewshot", "1", "--limit", "2", "--gen_kwargs", "max_gen_toks=4", "--output_path", str(tmp_path))
    assert run.code == 0, run.err
    [results] = list(tmp_path.rglob("results_*.json"))
    assert json.loads(results.read_text())["results"]["gsm8k_kvshare"]["sample_len"] == 2


def test_text_is_encoded_as_lm_evals_hf_model_encodes_it():
    """A tokenizer that adds BOS (Llama's) gets it, as in lm-eval's HFLM; a text that starts
    with BOS (a chat template's) gets no second one; an explicit choice is kept."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({"<s>": 0, "</s>": 1, "hi": 2, "there": 3, "[UNK]": 4}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    words.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    lm = KvshareLM.__new__(KvshareLM)
    lm.tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, bos_token="<s>", eos_token="</s>")
    assert lm.tok_encode("hi there") == [0, 2, 3]
    assert lm.tok_encode("<s> hi") == [0, 2]
    assert lm.tok_encode("hi there", add_special_tokens=False) == [2, 3]
    assert lm.tok_encode("hi there hi", left_truncate_len=2) == [3, 2]
