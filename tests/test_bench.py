"""Smoke test: the step-cost benchmark's FP-BMA table runs (tiny batch and images; no timing asserted)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import step_cost


@pytest.mark.slow
def test_fp_bma_transfer_bench_times_every_method():
    times, trainable = step_cost.bench_fp_bma_transfer(rounds=2, device="cpu", batch_size=2, image_size=32)
    assert trainable > 0
    assert {"sgd", "sam", "fp-bma (K=5, cg 1)", "fp-bma (K=5, cg 1, SWAG prior)"} <= set(times)
    assert all(len(t) == 2 and min(t) > 0 for t in times.values())
    assert step_cost.paired_ratio(times, "sgd") == 1.0
    assert step_cost.paired_ratio({"a": [2.0, 9.0, 3.0], "sgd": [1.0, 3.0, 1.0]}, "a") == 3.0
