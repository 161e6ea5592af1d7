"""Where the workflow benchmark's engine time goes: steps run compiled vs eager, per mode.

``python results/workflow-e2e/step_composition.py base,icarus`` runs issue 17's workload
(8 agents, 8 turns, 1536-token contexts, 32 tokens, QPS 1, bfloat16) one mode at a time, with
a timer around ``ModelRunner.run`` (one forward each), and prints per mode the makespan and, for
steps run compiled and eager (``+prompt``: with a prompt chunk), their count, total and mean
time, mean rows and the rows of prompt chunks among them.
"""

import collections
import sys
import time

from kvshare.eval.perf import workflow
from kvshare.serve.exec import runner as runner_module

steps: list[dict] = []
_run = runner_module.ModelRunner.run


def timed_run(self, plans, adapters):
    before = self.compiled.steps if self.compiled is not None else 0
    start = time.perf_counter()
    out = _run(self, plans, adapters)
    steps.append({"seconds": time.perf_counter() - start, "rows": sum(p.num_rows for p in plans),
                  "prompt_rows": sum(p.num_rows for p in plans if p.n_compute > 1),
                  "prompt": any(p.n_compute > 1 for p in plans),
                  "compiled": self.compiled is not None and self.compiled.steps > before})
    return out


if __name__ == "__main__":
    runner_module.ModelRunner.run = timed_run
    for mode in sys.argv[1].split(","):
        steps.clear()
        point = workflow.run_workflow_bench(agents=(8,), qps=(1.0,), modes=(mode,), turns=8, context_tokens=1536,
                                            max_tokens=32, dtype="bfloat16")["points"][0]
        print(f"{mode}: makespan {point['makespan_s']:.1f} s, {point['tokens_per_s']:.1f} tok/s, "
              f"P95 {point['p95_latency_s']:.2f} s")
        groups = collections.defaultdict(list)
        for step in steps:
            groups[("compiled" if step["compiled"] else "eager") + ("+prompt" if step["prompt"] else "")].append(step)
        for name, group in sorted(groups.items()):
            total = sum(s["seconds"] for s in group)
            print(f"  {name:16s} {len(group):5d} steps  {total:7.1f} s  {1000 * total / len(group):7.1f} ms each  "
                  f"{sum(s['rows'] for s in group) / len(group):6.1f} rows each  "
                  f"{sum(s['prompt_rows'] for s in group):6d} prompt rows")
