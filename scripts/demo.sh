#!/usr/bin/env bash
# The main job on the embedded default data (see README): SGD vs SAM on 10-shot transfer from
# ImageNet MobileNetV2 to animal-mnist, plus the seconds-long digits run.
set -euo pipefail
cd "$(dirname "$0")/.."
FLATBMA=${FLATBMA:-.venv/bin/flatbma}
"$FLATBMA" methods
"$FLATBMA" train --config configs/digits-sam.yaml
for method in sgd sam; do
  echo "== 10-shot animal-mnist, MobileNetV2 (ImageNet), $method"
  "$FLATBMA" train --config configs/animal-mnist-transfer.yaml \
    --set "method={name: $method}" --set "output_dir=runs/animal-mnist-transfer-$method"
done
"${PYTHON:-.venv/bin/python}" scripts/results_table.py runs/digits-sam runs/animal-mnist-transfer-sgd runs/animal-mnist-transfer-sam
