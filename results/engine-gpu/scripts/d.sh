# call D: the kernel bench with CUDA-graph timing (bfloat16, then float32 attention only)
cd "$(dirname "$0")/.."; source .gpu/setup.sh
timeout 240 python3 -m kvshare bench kernels --device cuda --dtype bfloat16 --out $OUT/kernels-bf16 2>&1 | grep -v "bench kernels" | tail -60
