"""Child processes of the HumanEval+ evaluation, each run by :mod:`kvshare.eval.code` in the
sandbox's jail, so that no dataset or generated code runs in the harness's process.

- ``python -m kvshare.eval.evalplus_check expected TASKS.json`` (with
  ``HUMANEVAL_OVERRIDE_PATH`` set) runs the canonical solutions through EvalPlus's
  ``get_groundtruth`` (its pickle cache pointed at a fresh folder on disk: over 64 MB at 20
  tasks, more than the jail's /tmp holds) and writes, for
  the i-th task of TASKS.json, ``task-i.pkl``: what judging a solution needs (inputs, entry
  point, tolerance, expected outputs and times).
- ``python -m kvshare.eval.evalplus_check check TASK.pkl SOLUTION.py VERDICT.json`` judges one
  solution as EvalPlus's ``check_correctness`` does (``untrusted_check`` on the base inputs,
  then on the plus inputs, fast check: 4x the canonical solution's time, at least 1 s per
  input, EvalPlus's memory limit), in a further process, and writes the two statuses.

One check jail per solution: a solution can touch nothing of another's run or verdict, and the
harness writes the verdict lines itself. Expected outputs travel as pickle because they are
Python values (tuples, sets, floats) that JSON would change; a pickle is written by the jail
that ran only canonical solutions and read only inside check jails: the harness copies its
bytes and never unpickles them.
"""

from __future__ import annotations

import json
import pickle
import sys
import tempfile


def write_expected(tasks_path: str) -> int:
    import evalplus.evaluate as evalplus_evaluate
    from evalplus.data import get_human_eval_plus

    task_ids = json.load(open(tasks_path, encoding="utf-8"))
    problems = get_human_eval_plus()
    needed = {task_id: problems[task_id] for task_id in task_ids}
    with tempfile.TemporaryDirectory(prefix="cache-", dir=".") as cache:  # not /tmp: a small tmpfs in the jail
        evalplus_evaluate.CACHE_DIR = cache
        expected = evalplus_evaluate.get_groundtruth(needed, "kvshare", [])
    for index, task_id in enumerate(task_ids):
        problem = needed[task_id]
        task = {key: problem[key] for key in ("task_id", "entry_point", "atol", "base_input", "plus_input")}
        with open(f"task-{index}.pkl", "wb") as handle:
            pickle.dump({**task, "expected": expected[task_id]}, handle)
    return 0


def check(task_path: str, solution_path: str, verdict_path: str) -> int:
    from evalplus.eval import untrusted_check

    with open(task_path, "rb") as handle:
        task = pickle.load(handle)
    solution = open(solution_path, encoding="utf-8").read()
    statuses = {}
    for part in ("base", "plus"):
        status, _ = untrusted_check("humaneval", solution, task[f"{part}_input"], task["entry_point"],
                                    expected=task["expected"][part], atol=task["atol"],
                                    ref_time=task["expected"][f"{part}_time"], fast_check=True)
        statuses[f"{part}_status"] = status
    with open(verdict_path, "w", encoding="utf-8") as handle:
        json.dump(statuses, handle)
    return 0


def main(argv: list[str]) -> int:
    command, *args = argv
    return {"expected": write_expected, "check": check}[command](*args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
