"""Child process of the HumanEval+ evaluation: EvalPlus's checker over a file of solutions.

Run by :func:`kvshare.eval.code.run_evalplus` as ``python -m kvshare.eval.evalplus_check
REQUESTS.jsonl RESULTS.jsonl`` with ``HUMANEVAL_OVERRIDE_PATH`` set, so that no generated code
runs in the harness's process. Expected outputs come from EvalPlus's ``get_groundtruth``
(the canonical solutions, run here); its pickle cache is pointed at a fresh temporary folder,
so nothing persisted is ever unpickled. Each solution is judged by EvalPlus's
``check_correctness``, which runs it in a further process under EvalPlus's time limits
(4x the canonical solution's time, at least 1 s per input) and memory limit. Results are
appended line by line, so an interrupted check keeps what it finished.
"""

from __future__ import annotations

import json
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor


def main(argv: list[str]) -> int:
    requests_path, results_path = argv
    import evalplus.evaluate as evalplus_evaluate
    from evalplus.data import get_human_eval_plus
    from tqdm import tqdm

    requests = [json.loads(line) for line in open(requests_path, encoding="utf-8") if line.strip()]
    problems = get_human_eval_plus()
    needed = {r["task_id"]: problems[r["task_id"]] for r in requests}
    with tempfile.TemporaryDirectory(prefix="kvshare-evalplus-") as cache:
        evalplus_evaluate.CACHE_DIR = cache
        expected = evalplus_evaluate.get_groundtruth(needed, "kvshare", [])

    def check(index_request):
        index, request = index_request
        result = evalplus_evaluate.check_correctness(
            "humaneval", index, needed[request["task_id"]], request["solution"], expected[request["task_id"]],
            fast_check=True, identifier=request["id"])
        return {"id": request["id"], "task_id": request["task_id"], "digest": request["digest"],
                "base_status": result["base"][0], "plus_status": result["plus"][0]}

    with open(results_path, "a", encoding="utf-8") as out, ThreadPoolExecutor(max_workers=2) as pool:
        for verdict in tqdm(pool.map(check, enumerate(requests)), total=len(requests), desc="evalplus"):
            out.write(json.dumps(verdict) + "\n")
            out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
