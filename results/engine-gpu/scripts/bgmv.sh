# Session 27, after graphs.sh: the BGMV kernels' wider tile, checked and timed on the GPU. The
# kernel tests compiled (BGMV and the segment LoRA), the graph tests (graph = eager tokens), the
# tile sweep (bgmv_sweep.py: engine pair/base step and graph replays per variant), then
# `bench engine` with the Triton engine on graphs beside transformers. About 270 s.
cd "$(dirname "$0")/.."; rm -rf /tmp/site; source .gpu/setup.sh
T0=$(date +%s)
timeout 45 python3 -m pytest -q -p no:cacheprovider tests/test_triton_kernels.py -k "bgmv or lora" > $OUT/kernel_tests.log 2>&1; echo "kernel tests rc=$? $(( $(date +%s)-T0 ))s"; tail -1 $OUT/kernel_tests.log
T0=$(date +%s)
timeout 80 python3 .gpu/bgmv_sweep.py /tmp/smollm2-random 2>&1 | grep -E "^tile|^steps|Error" | tee $OUT/sweep.txt; echo "sweep $(( $(date +%s)-T0 ))s"
T0=$(date +%s)
KVSHARE_TEST_DEVICE=cuda KVSHARE_TEST_KERNELS=triton KVSHARE_COMPILE=auto timeout 50 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_graphs.py > $OUT/graph_tests.log 2>&1; echo "graph tests rc=$? $(( $(date +%s)-T0 ))s"; tail -1 $OUT/graph_tests.log
T0=$(date +%s)
timeout 80 python3 -m kvshare bench engine --device cuda --model /tmp/smollm2-random --dtype bfloat16 --hf-dtype bfloat16 --kernels triton --out $OUT/engine 2>&1 | grep -E "^\| (decode|prefill|ICaRus)|^Steps"; echo "bench $(( $(date +%s)-T0 ))s"
