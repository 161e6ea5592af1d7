# Run HERE (registry access), from the repository root, before a GPU run: the wheels setup.sh
# installs on the GPU machine (it has torch, triton and CUDA, and no registry). Versions are
# constraints.txt's; --no-deps, as in session 19 (the machine's own numpy, tqdm, pyyaml, regex,
# safetensors, tokenizers and huggingface_hub 1.33 serve: our pinned hub 2.4 needs httpx2, which
# the machine lacks; jsonschema's own needs are carried, the machine has none of them). Then copy setup.sh, graphs.sh and SmolLM2's config and
# tokenizer files into .gpu/ (see ../README.md, Reproduce).
set -euo pipefail
pin() { grep -i -E "^$1==" constraints.txt; }
mkdir -p .whl/kv
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
  --platform any -d .whl "$(pin transformers)" "$(pin peft)" "$(pin jsonschema)" "$(pin referencing)" \
  "$(pin jsonschema-specifications)" "$(pin rpds-py)"
python3 -m pip wheel --no-deps . -w .whl/kv
ls -la .whl .whl/kv
