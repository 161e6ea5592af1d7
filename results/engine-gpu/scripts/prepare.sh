# Run HERE (registry access), from the repository root, before a GPU run: builds the two
# ignored folders the GPU machine needs, then the run is one call of the device tool:
#   run(command="bash .gpu/next.sh", carry=[".whl", ".gpu"], timeout_s=600)
# .whl/: the pinned wheels (fetch_wheels.sh); .gpu/: the scripts and SmolLM2-135M-Instruct's
# config and tokenizer files (the GPU machine builds a random-weight model of that shape).
set -euo pipefail
here="$(dirname "$0")"
model="$(kvshare models path smollm2-135m-instruct 2>/dev/null || true)"
[ -f "$model/config.json" ] || { echo "prepare.sh: pull the model first (kvshare models pull smollm2-135m-instruct)" >&2; exit 1; }
bash "$here/fetch_wheels.sh"
rm -rf .gpu && mkdir -p .gpu/smollm2-config
cp "$here"/*.sh "$here"/*.py .gpu/
for f in config.json generation_config.json tokenizer.json tokenizer_config.json chat_template.jinja; do
  cp "$model/$f" .gpu/smollm2-config/
done
du -sh .whl .gpu
# the kernels compile for the H100/H200 (sm_90) before any GPU time is spent on them
env -u TRITON_INTERPRET python3 -m kvshare.kernels.triton.offline_compile --arch 90 --dtype bfloat16 float32 > /dev/null
