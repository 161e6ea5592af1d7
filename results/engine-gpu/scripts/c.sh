# call C: kernel tests (split keys), engine tests that failed before, kernel bench, engine bench, pair profile
cd "$(dirname "$0")/.."; source .gpu/setup.sh
T0=$(date +%s)
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_triton_kernels.py tests/test_kernels.py tests/test_residual_attention.py > $OUT/kernel_tests.log 2>&1; echo "kernel tests rc=$? $(( $(date +%s)-T0 ))s"; tail -2 $OUT/kernel_tests.log
T0=$(date +%s)
KVSHARE_TEST_DEVICE=cuda KVSHARE_TEST_KERNELS=triton timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_engine.py tests/test_engine_sharing.py tests/test_swiftcache.py tests/test_kvflow.py -k "not benchmark" > $OUT/engine_tests_triton.log 2>&1; echo "engine tests (cuda, triton) rc=$? $(( $(date +%s)-T0 ))s"; grep -E "passed|failed|^FAILED|^ERROR" $OUT/engine_tests_triton.log | tail -12
timeout 80 python3 -m kvshare bench kernels --device cuda --dtype bfloat16 --out $OUT/kernels-bf16 2>&1 | grep -v "bench kernels" | tail -40
for dt in float32 bfloat16; do
  timeout 110 python3 -m kvshare bench engine --device cuda --model /tmp/smollm2-random --dtype $dt --hf-dtype $dt --kernels torch triton --out $OUT/engine-$dt 2>&1 | grep -v -E "bench engine|Loading weights|FutureWarn|warnings.warn" | tail -16
done
timeout 60 python3 .gpu/profile_pair.py /tmp/smollm2-random bfloat16 > $OUT/profile_pair.txt 2>&1; grep -E "^==|device time" $OUT/profile_pair.txt
