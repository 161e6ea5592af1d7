# The next GPU session (written in session 27, extended in 28, not yet run): what sessions 27
# and 28 changed after 27's GPU time ran out, checked and timed. The kernel tests compiled (incl. the multi-part BGMV
# kernel, never compiled yet), the graph and engine exactness tests with every engine replaying
# graphs (incl. tables widened mid-decode: the memory-pool fix; KVFlow's host-tier copies and
# SwiftCache's lent blocks beside replays, never run together on a GPU), the BGMV sweep (tile and
# launches per fused projection, and session 28's projection + LoRA in one launch; pair / base
# step and graph replays), the projection sweep (cuBLAS, cuBLAS + BGMV and the one-launch
# kernel, kernel by kernel, for its tile choices), the attention sweep (keys
# per step, split size: replayed against SDPA), then `bench engine`: graphs (triton) beside eager
# (torch kernels) and transformers. At most about 9.5 minutes (each step has its own timeout):
#   bash results/engine-gpu/scripts/prepare.sh        (here), then one device call:
#   run(command="bash .gpu/next.sh", carry=[".whl", ".gpu"], timeout_s=600)
cd "$(dirname "$0")/.."; rm -rf /tmp/site /tmp/r; source .gpu/setup.sh
R=/tmp/r; mkdir -p $R; trap 'tar -czf $OUT/all.tgz -C $R . 2>/dev/null' EXIT
T0=$(date +%s)
timeout 80 python3 -m pytest -q -p no:cacheprovider tests/test_triton_kernels.py > $OUT/kernel_tests.log 2>&1; echo "kernel tests rc=$? $(( $(date +%s)-T0 ))s"; tail -1 $OUT/kernel_tests.log
T0=$(date +%s)
KVSHARE_TEST_DEVICE=cuda KVSHARE_TEST_KERNELS=triton KVSHARE_COMPILE=auto timeout 200 python3 -m pytest -q --maxfail=3 -p no:cacheprovider -o log_cli=true --log-cli-level=WARNING tests/test_cuda_graphs.py tests/test_engine.py tests/test_engine_sharing.py tests/test_kvflow.py tests/test_swiftcache.py -k "not benchmark" > $OUT/graph_tests.log 2>&1; echo "graph + engine tests rc=$? $(( $(date +%s)-T0 ))s"; grep -E "passed|failed|^FAILED|^ERROR|^E |run eager from now on|one by one" $OUT/graph_tests.log | head -14
T0=$(date +%s)
timeout 60 python3 .gpu/bgmv_sweep.py /tmp/smollm2-random 2>&1 | grep -E "^tile|^steps|Error|kvshare:" | tee $OUT/sweep.txt; echo "sweep $(( $(date +%s)-T0 ))s"
T0=$(date +%s)
timeout 45 python3 .gpu/projection_sweep.py 2>&1 | grep -E "^proj|Error" | tee $OUT/projection_sweep.txt | grep -E "cols  64, k-step  64|Error"; echo "projection sweep $(( $(date +%s)-T0 ))s"
T0=$(date +%s)
timeout 70 python3 .gpu/attention_sweep.py 2>&1 | grep -E "^keys|Error" | tee $OUT/attention_sweep.txt | grep -E "batch  1 "; echo "attention sweep $(( $(date +%s)-T0 ))s"
T0=$(date +%s)
timeout 100 python3 -m kvshare bench engine --device cuda --model /tmp/smollm2-random --dtype bfloat16 --hf-dtype bfloat16 --kernels torch triton --out $R/engine 2>&1 | grep -E "^\| (decode|prefill|ICaRus)|^Steps"; echo "bench $(( $(date +%s)-T0 ))s"
cp $R/engine/engine_bench.md $OUT/engine.md 2>/dev/null
