# Sourced on the GPU machine by smoke.sh and study.sh: installs the carried wheels once (the
# machine's own torch, numpy, tokenizers, safetensors, accelerate and huggingface_hub serve)
# and points kvshare at the carried data.
export PYTHONUNBUFFERED=1 KVSHARE_HOME=/tmp/kvhome KVSHARE_DATA=/tmp/parts/data KVSHARE_SKIP_INTEGRATION=1
# a call's carried folders do not outlive it: what the next calls need is gathered in /tmp/parts
mkdir -p /tmp/parts && for d in .gpu-a .gpu-b .gpu-c; do if [ -d $d ]; then cp -r $d/. /tmp/parts/; fi; done
if [ -d .whl ] && { [ ! -f /tmp/site/.done ] || [ -n "$(find .whl -newer /tmp/site/.done -name '*.whl')" ]; }; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      .whl/*.whl .whl/kv/*.whl $(ls .whl/more/*.whl 2>/dev/null) || exit 1
  touch /tmp/site/.done
fi
export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, transformers, peft, accelerate, kvshare.cli; print('torch', torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__, 'accelerate', accelerate.__version__, torch.cuda.get_device_name())"
  echo "cpus $(nproc)"; } > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
