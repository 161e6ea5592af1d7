# session 25: the four workflow patterns at one point, each mode in the same run (repo root, venv active, alone)
set -e
for pattern in react skewed reflexion mapreduce; do
  kvshare bench workflow --pattern $pattern --agents 8 --turns 8 --context-tokens 1536 --max-tokens 32 \
    --modes icarus base lora --dtype bfloat16 --qps 1 --compile-max-rows 128 \
    --out results/workflow-e2e/session25/$pattern
done
