#!/usr/bin/env bash
# The main job on the embedded default data (see README): `flatbma compare` of SGD, SAM, SWAG and FP-BMA
# on 10-shot Bayesian transfer learning from ImageNet MobileNetV2 to animal-mnist, with BMA (M = 30),
# corrupted test sets and the flatness protocol. Extra arguments go to flatbma (e.g. --quick).
set -euo pipefail
cd "$(dirname "$0")/.."
FLATBMA=${FLATBMA:-.venv/bin/flatbma}
"$FLATBMA" compare --config configs/demo.yaml "$@"
