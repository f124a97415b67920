"""Every shipped config parses (compare configs with their compare section)."""

from pathlib import Path

import pytest

from flatbma.experiment.compare import load_plan
from flatbma.experiment.config import load_config

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_config_parses(path):
    cfg = load_config(path)
    assert cfg.method.name
    if "compare:" in path.read_text():
        plan = load_plan(path)
        # one row per (entry, seed); an entry with candidate lists trains several runs for its row
        assert len(plan.jobs()) == len(plan.compare.methods) * len(plan.compare.seeds)
        assert len(plan.runs()) == sum(len(job.candidates) for job in plan.jobs())
        assert load_plan(path, quick=True).compare.methods
