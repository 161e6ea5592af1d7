#!/usr/bin/env bash
# Before/after bench of the engine-architecture change (issue 13): the old engine (main at
# 2b341ba, imported from a git worktree) and the new one (torch references, and in float32
# also the oneDNN packed linear), each beside transformers in its own run, one after another. Usage (repo root, venv active):
#   bash results/engine-arch/run.sh [float32|bfloat16] [--quick]
set -euo pipefail
DTYPE=${1:-float32}; QUICK=${2:-}
OUT=results/engine-arch
OLD=/tmp/kvshare-before
if [ ! -d "$OLD/kvshare" ]; then  # the old package layout (kvshare = core/ + subsystem folders)
  git worktree add -f /tmp/kvshare-before-src 2b341ba >/dev/null 2>&1 || true
  mkdir -p "$OLD" && cp -r /tmp/kvshare-before-src/core "$OLD/kvshare"
  for d in serve train kernels eval; do ln -sfn /tmp/kvshare-before-src/$d "$OLD/kvshare/$d"; done
fi
run() {  # $1 = label, $2 = module, $3 = PYTHONPATH, $4 = kernel backend (after only)
  PYTHONPATH=$3 python - "$1" "$2" "$DTYPE" "$QUICK" "$OUT" "${4:-}" <<'PY'
import importlib, json, sys
label, module, dtype, quick, out, kernels = sys.argv[1:7]
bench = importlib.import_module(module)
import kvshare
assert (label == "before") == ("kvshare-before" in kvshare.__file__), kvshare.__file__
extra = {"kernels": kernels} if kernels else {}
results = bench.run_engine_bench(dtype=dtype, quick=quick == "--quick", **extra)
tag = f"{label}{'-' + kernels if kernels else ''}-{dtype}{'-quick' if quick else ''}"
open(f"{out}/{tag}.json", "w").write(json.dumps(results, indent=1))
open(f"{out}/{tag}.md", "w").write(bench.markdown(results))
print(tag); print(bench.markdown(results))
PY
}
run before kvshare.serve.bench "$OLD"
run after kvshare.eval.perf.engine ""
[ "$DTYPE" = float32 ] && run after kvshare.eval.perf.engine "" onednn  # the packed CPU linear
