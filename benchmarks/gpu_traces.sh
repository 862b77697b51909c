#!/usr/bin/env bash
# Record the shipped GPU traces on this machine's GPU (needs CUDA and torchvision):
#   benchmarks/gpu_traces.sh OUT_DIR LABEL    e.g. benchmarks/gpu_traces.sh traces h200
# torchvision's resnet50 and vgg16 at batch 32 and 64 (3x224x224, 1000 classes), and the zoo's
# BERT-base-sized encoder at sequence length 128, batch 32. docs/traces.md lists the results.
set -euo pipefail
out=${1:?OUT_DIR}
label=${2:?LABEL, e.g. h100}
python=${PYTHON:-python3}
mkdir -p "$out"
for model in resnet50 vgg16; do
  for batch in 32 64; do
    "$python" -m interlace trace --model "torchvision.models:$model" --input-shape 3,224,224 \
      --classes 1000 --batch-size "$batch" --iters 30 --warmup 10 --name "$model" \
      --out "$out/${model}_b${batch}_${label}.json"
  done
done
"$python" -m interlace trace --model interlace.zoo.transformer:bert_base --input-shape 128 \
  --classes 2 --batch-size 32 --iters 30 --warmup 10 --name bert-base \
  --out "$out/bert-base_b32_${label}.json"
