# CUDA graphs (serve/cuda_graphs.py; written in session 24 without a GPU, not yet run): the kernel
# tests compiled, the graph tests and the engine exactness tests with every engine replaying
# graphs (against transformers / PEFT), then the engine bench: graphs (triton) beside eager
# (torch kernels) and transformers, and the triton engine eager, on the same warm machine; last,
# the graphs' BGMV LoRA kernels in `bench kernels` (8 adapters against 1, beside the segment kernels).
cd "$(dirname "$0")/.."; source .gpu/setup.sh
T0=$(date +%s)
timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_triton_kernels.py > $OUT/kernel_tests.log 2>&1; echo "kernel tests rc=$? $(( $(date +%s)-T0 ))s"; tail -1 $OUT/kernel_tests.log
T0=$(date +%s)
KVSHARE_TEST_DEVICE=cuda KVSHARE_TEST_KERNELS=triton KVSHARE_COMPILE=auto timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/test_cuda_graphs.py tests/test_engine.py tests/test_engine_sharing.py -k "not benchmark" > $OUT/graph_tests.log 2>&1; echo "graph + engine tests (cuda, triton, graphs) rc=$? $(( $(date +%s)-T0 ))s"; grep -E "passed|failed|^FAILED|^ERROR|^E " $OUT/graph_tests.log | head -12
timeout 120 python3 -m kvshare bench engine --device cuda --model /tmp/smollm2-random --dtype bfloat16 --hf-dtype bfloat16 --kernels torch triton --out $OUT/engine-graphs 2>&1 | grep -v -E "bench engine|Loading weights|FutureWarn|warnings.warn" | tail -16
timeout 100 python3 -m kvshare bench engine --device cuda --model /tmp/smollm2-random --dtype bfloat16 --hf-dtype bfloat16 --kernels triton --compile off --out $OUT/engine-eager 2>&1 | grep -v -E "bench engine|Loading weights|FutureWarn|warnings.warn" | tail -16
# the graph step's LoRA kernels (BGMV, session 25) beside the segment kernels: 8 adapters against 1
timeout 60 python3 -m kvshare bench kernels --device cuda --dtype bfloat16 --shapes smollm2-135m llama-8b --batches 1 --contexts 1024 --lora-rows 16 64 256 --out $OUT/kernels-bgmv 2>&1 | tail -3; cat $OUT/kernels-bgmv/kernel_bench.md 2>/dev/null | grep -A12 "base linear" | head -14
