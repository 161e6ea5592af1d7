# CUDA graphs (serve/cuda_graphs.py; written in session 24 without a GPU): the kernel tests
# compiled, the graph tests and the engine exactness tests with every engine replaying graphs
# (against transformers / PEFT), then the engine bench: graphs (triton) beside eager (torch
# kernels) and transformers, and the triton engine eager, on the same warm machine; last, the
# graphs' BGMV LoRA kernels in `bench kernels` (8 adapters against 1, beside the segment kernels).
# Each step has its own timeout (about 560 s in all); the reports come back as a few files
# (the device tool returns at most 8) and one archive of everything.
cd "$(dirname "$0")/.."; source .gpu/setup.sh
R=/tmp/r; mkdir -p $R; trap 'tar -czf $OUT/all.tgz -C $R . 2>/dev/null' EXIT
clean() { grep -v -E "bench (engine|kernels)|Loading weights|FutureWarn|warnings.warn" | tail -${1:-16}; }
T0=$(date +%s)
timeout 80 python3 -m pytest -q -p no:cacheprovider tests/test_triton_kernels.py > $OUT/kernel_tests.log 2>&1; echo "kernel tests rc=$? $(( $(date +%s)-T0 ))s"; tail -1 $OUT/kernel_tests.log
T0=$(date +%s)
KVSHARE_TEST_DEVICE=cuda KVSHARE_TEST_KERNELS=triton KVSHARE_COMPILE=auto timeout 200 python3 -m pytest -q --maxfail=3 -p no:cacheprovider -o log_cli=true --log-cli-level=WARNING tests/test_cuda_graphs.py tests/test_engine.py tests/test_engine_sharing.py -k "not benchmark" > $OUT/graph_tests.log 2>&1; echo "graph + engine tests (cuda, triton, graphs) rc=$? $(( $(date +%s)-T0 ))s"; grep -E "passed|failed|^FAILED|^ERROR|^E |run eager from now on" $OUT/graph_tests.log | head -14
T0=$(date +%s)
timeout 120 python3 -m kvshare bench engine --device cuda --model /tmp/smollm2-random --dtype bfloat16 --hf-dtype bfloat16 --kernels torch triton --out $R/engine-graphs 2>&1 | clean; echo "bench graphs $(( $(date +%s)-T0 ))s"
cp $R/engine-graphs/engine_bench.md $OUT/engine-graphs.md 2>/dev/null
T0=$(date +%s)
timeout 100 python3 -m kvshare bench engine --device cuda --model /tmp/smollm2-random --dtype bfloat16 --hf-dtype bfloat16 --kernels triton --compile off --out $R/engine-eager 2>&1 | clean; echo "bench eager $(( $(date +%s)-T0 ))s"
cp $R/engine-eager/engine_bench.md $OUT/engine-eager.md 2>/dev/null
timeout 50 python3 -m kvshare bench kernels --device cuda --dtype bfloat16 --shapes smollm2-135m llama-8b --batches 1 --contexts 1024 --lora-rows 16 64 256 --out $R/kernels-bgmv 2>&1 | tail -3
cp $R/kernels-bgmv/kernel_bench.md $OUT/kernels-bgmv.md 2>/dev/null; grep -A12 "base linear" $OUT/kernels-bgmv.md | head -14
