#!/usr/bin/env bash
# First GPU call: install, then each kind trains 8 steps of the study's recipe on a random-weight
# model of SmolLM2's shape (LoRA with a curve evaluation at step 4), three at once as the study
# runs them, and each adapter is scored on 24 held-out questions on the GPU. Times every stage,
# so the study's call can be sized; no quality figure comes from random weights.
set -uo pipefail
source results/quality/squad-study/gpu/setup.sh
t0=$(date +%s)
python3 -c "from kvshare.testing import random_model_like; random_model_like('/tmp/parts/config', '/tmp/smollm2-random')"
echo "random model: $(( $(date +%s) - t0 )) s"
t0=$(date +%s)
for kind in lora icarus alora; do
  curve=(); if [ $kind = lora ]; then curve=(train.eval_every=2 train.eval_task=f1-squad train.eval_limit=16); fi
  OMP_NUM_THREADS=2 kvshare train recipes/squad-$kind.yaml base_model=/tmp/smollm2-random train.max_steps=4 \
      train.save_every=2 output_dir=/tmp/smoke/$kind "${curve[@]}" > "$OUT/train-$kind.log" 2>&1 &
done
wait
echo "train (3 at once, 4 steps each): $(( $(date +%s) - t0 )) s"
for kind in lora icarus alora; do tail -2 /tmp/smoke/$kind/metrics.jsonl; done
t0=$(date +%s)
for kind in lora icarus alora; do
  OMP_NUM_THREADS=2 kvshare eval f1 --dataset squad --dtype float32 --device cuda --limit 8 --model /tmp/smollm2-random \
      --adapter /tmp/smoke/$kind/adapter --out /tmp/smoke/eval-$kind > "$OUT/eval-$kind.log" 2>&1 &
done
wait
echo "eval (3 at once, 8 questions each): $(( $(date +%s) - t0 )) s"
for kind in lora icarus alora; do tail -3 "$OUT/train-$kind.log"; tail -2 "$OUT/eval-$kind.log"; done
python3 -c "import json; print(json.load(open('/tmp/smoke/eval-icarus/results.json'))['settings'])"
