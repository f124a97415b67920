#!/usr/bin/env bash
# The built package works on its own: build flatbma's wheel, install it into a fresh virtual environment (the CPU
# torch first, as README's install says, with constraints-cpu.txt so nothing pulls a CUDA build), then run
# `flatbma --version` and one tiny run from a shipped config by name, outside the repository. CI runs it (.ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
.venv/bin/python -m pip wheel -q --disable-pip-version-check --no-deps --no-build-isolation -w "$WORK/dist" . 2>&1 \
  | grep -v "is ignored" || true
"$PYTHON" -m venv "$WORK/venv"
PIP=("$WORK/venv/bin/python" -m pip install -q --disable-pip-version-check)
"${PIP[@]}" "torch==$(grep -m1 '^torch==' constraints-cpu.txt | cut -d= -f3)" 2>&1 | grep -v "is ignored" || true
"${PIP[@]}" -c constraints-cpu.txt "$WORK"/dist/flatbma-*.whl 2>&1 | grep -v "is ignored" || true
cd "$WORK"  # away from the checkout: only the installed package is importable
"$WORK/venv/bin/flatbma" --version
# exit code 3: trained and written, but flagged by a health rule (one epoch of an 8-unit MLP may not learn)
"$WORK/venv/bin/flatbma" train --config digits-sam --quiet --set output_dir="$WORK/run" --set train.epochs=1 \
  --set eval.num_samples=1 --set data.test_limit=100 --set model.width=8 || [ $? -eq 3 ]
test -f "$WORK/run/metrics.json"
echo "[wheel-check] the wheel installs and runs: $(ls "$WORK"/dist)"
