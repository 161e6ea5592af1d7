# sourced by the GPU scripts: install the carried wheels (our pinned transformers/peft/hub, jsonschema, kvshare)
export PYTHONUNBUFFERED=1 KVSHARE_HOME=/tmp/kvhome KVSHARE_SKIP_INTEGRATION=1
if [ ! -f /tmp/site/.done ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $(ls .whl/*.whl .whl/alt/*.whl .whl/kv/*.whl 2>/dev/null) || exit 1
  touch /tmp/site/.done
fi
export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv > $OUT/env.txt
python3 -c "import torch, triton, transformers, peft, kvshare.cli; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__, torch.cuda.get_device_name())" >> $OUT/env.txt 2>&1
nproc >> $OUT/env.txt; cat $OUT/env.txt
[ -d /tmp/smollm2-random ] || python3 -c "from kvshare.testing import random_model_like; random_model_like('.gpu/smollm2-config', '/tmp/smollm2-random')" 2>&1 | tail -1
