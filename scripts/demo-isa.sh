#!/usr/bin/env bash
# The demo twice on this machine: with the kernels its CPU selects, then with torch's vectorized kernels
# (ATEN_CPU_CAPABILITY) and oneDNN's (ONEDNN_MAX_CPU_ISA) capped at AVX2, MKL asked for AVX2 too
# (MKL_ENABLE_INSTRUCTIONS) — what an AVX2 machine would run where this one runs AVX-512. Each writes a
# comparison of its own (runs/demo-isa/native, runs/demo-isa/avx2); their metrics.json record the kernels
# (environment: cpu, cpu_capability, cpu_flags, kernel_variables). docs/studies/demo.md compares the two.
# Extra arguments go to both runs (e.g. --quick).
set -euo pipefail
cd "$(dirname "$0")/.."
FLATBMA=${FLATBMA:-.venv/bin/flatbma}
OUT=${OUT:-runs/demo-isa}
"$FLATBMA" compare --config configs/demo.yaml --set "output_dir=$OUT/native" "$@"
ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \
  "$FLATBMA" compare --config configs/demo.yaml --set "output_dir=$OUT/avx2" "$@"
