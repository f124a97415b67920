"""Smoke test: the step-cost benchmark's FP-BMA table runs (tiny batch and images; no timing asserted)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import step_cost


@pytest.mark.slow
def test_fp_bma_transfer_bench_times_every_method():
    times = step_cost.bench_fp_bma_transfer(rounds=1, device="cpu", batch_size=2, image_size=32)
    assert times.pop("trainable") > 0
    assert {"sgd", "sam", "fp-bma (K=5, cg 1)", "fp-bma (K=5, cg 1, SWAG prior)"} <= set(times)
    assert all(t > 0 for t in times.values())
