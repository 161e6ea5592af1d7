#!/usr/bin/env bash
# Train the nine quality-table adapters (math/qa/code x icarus/lora/alora) from the committed
# recipes, one after another, resuming any run that was interrupted. Run from the repo root:
#   KVSHARE_DATA=../shared/data bash results/quality/train-all.sh [key=value ...]
# TASKS / KINDS pick a subset; key=value overrides apply to every run (give the same ones when
# resuming), e.g. fewer steps:
#   TASKS=qa KINDS="icarus lora" bash results/quality/train-all.sh train.max_steps=40
# The recipes say mixed_precision: auto (bf16 only where the hardware has it, float32 elsewhere).
# Each run writes runs/<task>-<kind>/ (checkpoints, metrics.jsonl, adapter/).
set -euo pipefail
for task in ${TASKS:-math qa code}; do
  for kind in ${KINDS:-icarus lora alora}; do
    run=runs/$task-$kind
    if [ -f "$run/adapter/kvshare.json" ]; then echo "== $task-$kind: done"; continue; fi
    resume=()
    if [ -d "$run/checkpoints" ] && [ -n "$(ls -A "$run/checkpoints")" ]; then resume=(--resume); fi
    echo "== $task-$kind ${resume[*]:-}"
    kvshare train "recipes/$task-$kind.yaml" "$@" "${resume[@]}"
  done
done
