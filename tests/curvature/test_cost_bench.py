"""Smoke test: bench/laplace_cost.py runs its rows on the transfer model (tiny images; no timing asserted)."""

import sys
from argparse import Namespace
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import laplace_cost


@pytest.mark.slow
def test_cost_bench_times_the_chosen_structures():
    args = Namespace(n=2, batch_size=2, image_size=32, rounds=1, rows=["kfac ggn", "full ggn (dual)"])
    results = laplace_cost.bench(args)
    assert list(results) == ["kfac ggn", "full ggn (dual)"]
    assert results["kfac ggn"]["d"] == results["full ggn (dual)"]["d"] == 46922
    for r in results.values():
        assert len(r["pass"]) == 1 and r["pass"][0] > 0 and r["ratio"][0] > 0 and r["prior"] > 0
    assert "Kronecker" in results["kfac ggn"]["describe"] and "dual" in results["full ggn (dual)"]["describe"]
