#!/usr/bin/env bash
# The paired SQuAD study (issue 47): ICaRus, aLoRA and LoRA adapters of rank 32, three seeds
# each, trained on SQuAD's two training articles and scored on all 623 questions of the two
# held-out ones, float32 throughout; then `kvshare eval compare` against LoRA at the margin
# pre-registered in README.md. Resumable: every finished piece is kept and skipped, an
# interrupted training resumes from its last checkpoint. Run from the repo root, alone:
#   KVSHARE_DATA=../shared/data bash results/quality/squad-study/run.sh
# STEPS=train,eval,compare picks parts; SEEDS / KINDS pick runs (default 0 1 2 / lora icarus alora).
set -euo pipefail
study=results/quality/squad-study
steps=${STEPS:-train,eval,compare}
evaluate() {  # NAME [--adapter DIR]: held-out SQuAD F1/EM; per-item scores kept as samples.jsonl.gz
  local out=$study/evals/$1; shift
  if [ -f "$out/results.json" ]; then return; fi
  if [ -f "$out/samples.jsonl.gz" ] && [ ! -f "$out/samples.jsonl" ]; then gunzip -k "$out/samples.jsonl.gz"; fi
  kvshare eval f1 --dataset squad --dtype float32 --out "$out" "$@"
  gzip -kf "$out/samples.jsonl"
  provenance "$out/provenance.json" kvshare eval f1 --dataset squad --dtype float32 --out "$out" "$@"
}
provenance() {  # FILE COMMAND...: the command, the commit, the machine and the versions of a result
  python - "$@" <<'PY'
import json, platform, subprocess, sys
import torch, transformers, kvshare
cpu = dict((k.strip(), v) for k, v in (line.split(":", 1) for line in open("/proc/cpuinfo") if line.startswith(("model name", "flags"))))
commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
json.dump({"command": " ".join(sys.argv[2:]), "commit": commit, "cpu": cpu.get("model name", "").strip(),
           "cpu_flags": cpu.get("flags", "").split(), "python": platform.python_version(),
           "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                        "kvshare": kvshare.__version__}}, open(sys.argv[1], "w"), indent=1)
PY
}
for seed in ${SEEDS:-0 1 2}; do
  for kind in ${KINDS:-lora icarus alora}; do
    run=runs/squad-$kind-s$seed
    scored=$study/evals/$kind-s$seed/results.json  # a scored run is not trained again (runs/ is not committed)
    if [[ $steps == *train* ]] && [ ! -f "$run/adapter/kvshare.json" ] && [ ! -f "$scored" ]; then
      curve=()  # LoRA's first seed is scored every 44 steps on 120 held-out questions: its learning curve
      if [ "$kind-$seed" = lora-0 ]; then curve=(train.eval_every=44 train.eval_task=f1-squad train.eval_limit=120); fi
      resume=()
      if [ -d "$run/checkpoints" ] && [ -n "$(ls -A "$run/checkpoints")" ]; then resume=(--resume); fi
      kvshare train "recipes/squad-$kind.yaml" "train.seed=$seed" "output_dir=$run" "${curve[@]}" "${resume[@]}"
      mkdir -p "$study/train/$kind-s$seed" && cp "$run/metrics.jsonl" "$study/train/$kind-s$seed/"
      provenance "$study/train/$kind-s$seed/provenance.json" kvshare train "recipes/squad-$kind.yaml" "train.seed=$seed" \
          "output_dir=$run" "${curve[@]}"
    fi
    if [[ $steps == *eval* ]] && [ -f "$run/adapter/kvshare.json" ]; then evaluate "$kind-s$seed" --adapter "$run/adapter"; fi
  done
done
if [[ $steps == *eval* ]]; then evaluate base; fi
if [[ $steps == *compare* ]]; then
  systems=()
  for kind in lora icarus alora; do
    runs=$(ls -d $study/evals/$kind-s* 2>/dev/null | while read -r d; do [ -f "$d/results.json" ] && echo "$d"; done | paste -sd, -)
    if [ -n "$runs" ]; then systems+=("$kind=$runs"); fi
  done
  kvshare eval compare "${systems[@]}" "base=$study/evals/base" --reference lora --base base --margin 3 \
      --out "$study/compare"
fi
