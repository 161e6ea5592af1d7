# session 29: the react workload before and after the scheduler change (4f36eeb), back to back,
# alone, on this 2-vCPU AMD EPYC (avx512_bf16); "before" = serve/scheduler.py, serve/admission.py
# and serve/cache/block_manager.py checked out at 8f86451, everything else the same
set -e
run() { kvshare bench workflow --pattern react --agents 8 --turns 8 --context-tokens 1536 --max-tokens 32 \
    --modes icarus base lora --dtype bfloat16 --qps 1 --compile-max-rows 128 --out $1; }
git checkout 8f86451 -- serve/scheduler.py serve/admission.py serve/cache/block_manager.py
run results/workflow-e2e/session29/scheduler-before
git checkout HEAD -- serve/scheduler.py serve/admission.py serve/cache/block_manager.py
run results/workflow-e2e/session29/scheduler-after
