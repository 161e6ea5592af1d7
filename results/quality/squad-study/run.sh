#!/usr/bin/env bash
# The paired SQuAD study (issue 47): ICaRus, aLoRA and LoRA adapters of rank 32, three seeds
# each, trained on SQuAD's two training articles and scored on all 623 questions of the two
# held-out ones, float32 throughout; then `kvshare eval compare` against LoRA at the margin
# pre-registered in README.md. Resumable: every finished piece is kept and skipped, an
# interrupted training resumes from its last checkpoint. Run from the repo root, alone:
#   KVSHARE_DATA=../shared/data bash results/quality/squad-study/run.sh
# STEPS=train,eval,base,compare picks parts; SEEDS / KINDS pick runs (default 0 1 2 / lora icarus alora);
# DEVICE=cuda scores on a GPU (training takes one when torch sees it); BASE names the base's folder.
# Follow-ups, not part of the pre-registered comparison: STEPS=fastpath (seed 0's adapters through
# bfloat16, int8, int4 and the eager step, each against a float32 run of the same adapter on the
# same machine; a seed-0 adapter missing here, e.g. one trained on a lent GPU, is trained again) and STEPS=forkkv
# (kvshare bench forkkv-quality over the LoRA seeds; N=4 needs a fourth: SEEDS=3 KINDS=lora STEPS=train,eval).
set -euo pipefail
study=results/quality/squad-study
steps=${STEPS:-train,eval,base,compare}
base=${BASE:-base}
device=(${DEVICE:+--device "$DEVICE"})
evaluate() {  # FOLDER [--adapter DIR] [flags]: held-out SQuAD F1/EM; per-item scores kept as samples.jsonl.gz
  local out=$study/$1; shift  # float32 unless the flags say otherwise (argparse: the last --dtype wins)
  if [ -f "$out/results.json" ]; then return; fi
  if [ -f "$out/samples.jsonl.gz" ] && [ ! -f "$out/samples.jsonl" ]; then gunzip -k "$out/samples.jsonl.gz"; fi
  kvshare eval f1 --dataset squad --dtype float32 "${device[@]}" --out "$out" "$@"
  gzip -kf "$out/samples.jsonl"
  provenance "$out/provenance.json" kvshare eval f1 --dataset squad --dtype float32 "${device[@]}" --out "$out" "$@"
}
provenance() {  # FILE COMMAND...: the command, the commit, the machine and the versions of a result
  python -m kvshare.provenance "$@"
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
    if [[ $steps == *eval* ]] && [ -f "$run/adapter/kvshare.json" ]; then evaluate "evals/$kind-s$seed" --adapter "$run/adapter"; fi
  done
done
if [[ $steps == *base* ]]; then evaluate "evals/$base"; fi
if [[ $steps == *compare* ]]; then
  systems=()
  for kind in lora icarus alora; do
    runs=""
    for d in "$study/evals/$kind"-s*; do if [ -f "$d/results.json" ]; then runs+="${runs:+,}$d"; fi; done
    if [ -n "$runs" ]; then systems+=("$kind=$runs"); fi
  done
  kvshare eval compare "${systems[@]}" "base=$study/evals/$base" --reference lora --base base --margin 3 \
      --out "$study/compare"
  for seed in 0 1 2; do  # McNemar on exact match takes one run a system: seed by seed
    pairs=()
    for kind in lora icarus alora; do
      if [ -f "$study/evals/$kind-s$seed/results.json" ]; then pairs+=("$kind=$study/evals/$kind-s$seed"); fi
    done
    if [ ${#pairs[@]} -gt 1 ]; then
      kvshare eval compare "${pairs[@]}" --reference lora --metric exact_match --margin 3 --out "$study/compare-em/s$seed"
    fi
  done
fi
if [[ $steps == *fastpath* ]]; then  # the fast paths' quality cost on the same items, paired to float32
  for kind in ${KINDS:-alora lora icarus}; do  # seed 0's adapter; trained here (resumable) where absent
    run=runs/squad-$kind-s0
    if [ ! -f "$run/adapter/kvshare.json" ]; then
      resume=()
      if [ -d "$run/checkpoints" ] && [ -n "$(ls -A "$run/checkpoints")" ]; then resume=(--resume); fi
      kvshare train "recipes/squad-$kind.yaml" train.seed=0 "output_dir=$run" "${resume[@]}"
      mkdir -p "$study/fastpath/train-$kind-s0" && cp "$run/metrics.jsonl" "$study/fastpath/train-$kind-s0/"
      provenance "$study/fastpath/train-$kind-s0/provenance.json" kvshare train "recipes/squad-$kind.yaml" \
          train.seed=0 "output_dir=$run"
    fi
    export KVSHARE_COMPILE_BACKGROUND=0  # every compiled step runs compiled, none eager while it builds
    evaluate "fastpath/$kind-s0-float32" --adapter "$run/adapter"  # the reference: this adapter, this machine
    evaluate "fastpath/$kind-s0-bfloat16" --adapter "$run/adapter" --dtype bfloat16
    evaluate "fastpath/$kind-s0-int8" --adapter "$run/adapter" --dtype bfloat16 --kernels int8,cpu
    evaluate "fastpath/$kind-s0-int4" --adapter "$run/adapter" --dtype bfloat16 --kernels int4,cpu
    evaluate "fastpath/$kind-s0-eager" --adapter "$run/adapter" --compile off
    kvshare eval compare "float32=$study/fastpath/$kind-s0-float32" "bfloat16=$study/fastpath/$kind-s0-bfloat16" \
        "int8=$study/fastpath/$kind-s0-int8" "int4=$study/fastpath/$kind-s0-int4" \
        "eager=$study/fastpath/$kind-s0-eager" --reference float32 --margin 3 --out "$study/fastpath/compare-$kind"
    unset KVSHARE_COMPILE_BACKGROUND
  done
fi
if [[ $steps == *forkkv* ]]; then  # ForkKV and full reuse against exact caching, all 623 questions
  adapters=$(ls -d runs/squad-lora-s*/adapter 2>/dev/null | head -4)
  kvshare bench forkkv-quality --adapters $adapters --tasks squad --agents 2 4 --limit 623 --out "$study/forkkv"
fi
