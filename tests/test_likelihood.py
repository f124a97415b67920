"""flatbma.likelihood: the one dispatch between a classifier and a regression, and the tables keyed by it."""

import math
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import flatbma
from flatbma import likelihood as likelihoods
from flatbma.errors import FlatbmaError, FlatbmaTypeError
from flatbma.experiment.report import rows
from flatbma.experiment.run import build, evaluate
from flatbma.likelihood import Likelihood
from flatbma.predictor import TASKS
from flatbma.regression import Gaussian

SRC = Path(flatbma.__file__).parent


def test_a_name_builds_its_likelihood_and_kind_reads_it_back():
    assert likelihoods.build("categorical") is None and likelihoods.build(Likelihood.CATEGORICAL) is None
    assert likelihoods.build("gaussian") == Gaussian() and likelihoods.build("gaussian", 0.5) == Gaussian(noise_std=0.5)
    assert likelihoods.kind(None) is Likelihood.CATEGORICAL
    assert likelihoods.kind(Gaussian(noise_std=2.0)) is Likelihood.GAUSSIAN
    assert Likelihood.CATEGORICAL.has_classes and not Likelihood.GAUSSIAN.has_classes
    with pytest.raises(FlatbmaError, match="likelihood must be one of 'categorical', 'gaussian', got 'poisson'"):
        likelihoods.build("poisson")
    with pytest.raises(FlatbmaError, match="noise_std is the Gaussian likelihood's"):
        likelihoods.build("categorical", 0.1)
    with pytest.raises(FlatbmaTypeError, match="got a str"):
        likelihoods.kind("gaussian")


def test_the_data_and_a_record_name_their_likelihood():
    assert likelihoods.of_data("diabetes") is Likelihood.GAUSSIAN
    assert likelihoods.of_data("digits") is likelihoods.of_data("animal-mnist") is Likelihood.CATEGORICAL
    assert likelihoods.recorded("gaussian") is Likelihood.GAUSSIAN
    for other in (None, "categorical", 3, "poisson", ["gaussian"]):
        assert likelihoods.recorded(other) is Likelihood.CATEGORICAL
    assert evaluate.metric_keys({"likelihood": "gaussian"}) == evaluate.REGRESSION_KEYS
    assert evaluate.metric_keys({"accuracy": 0.5}) == evaluate.metric_keys(None) == evaluate.CLEAN_KEYS


def test_the_loss_is_the_mean_cross_entropy_or_the_mean_gaussian_nll():
    assert likelihoods.loss(None) is F.cross_entropy  # the Objective's default: a classifier's numbers unchanged
    g = Gaussian(noise_std=0.5)
    outputs, y = torch.tensor([[1.0], [-2.0]], dtype=torch.float64), torch.tensor([0.0, -1.0], dtype=torch.float64)
    pairs = ((1.0, 0.0), (-2.0, -1.0))  # (mean, target), sigma^2 = 0.25
    hand = sum(0.5 * math.log(2 * math.pi * 0.25) + (t - m) ** 2 / (2 * 0.25) for m, t in pairs) / 2
    assert float(likelihoods.loss(g)(outputs, y)) == pytest.approx(hand, rel=1e-12)


def test_every_table_has_one_row_per_likelihood():
    for table in (TASKS, evaluate.EVALUATIONS, build.DATA, rows.SUMMARY_METRICS):
        assert set(table) == set(Likelihood)


BRANCHES = {
    # flatbma.loop sits below the likelihood's layer: it takes a flag (and float targets) for an epoch's RMSE
    "loop.py": 1,
}
"""Where code outside the tables still branches on the likelihood, each with why (issue #36: at most 3)."""

RMSE_READS = {
    # an epoch's optional RMSE (EpochLog.rmse, a regression's): kept in the record, printed, averaged over processes
    "loop.py": 1,
    "training.py": 1,
    "experiment/parallel/strategies.py": 1,
}
"""Where code reads a regression's optional RMSE field of an epoch's record (no branch on the likelihood)."""

BRANCH = re.compile(
    r"(?<!can\.)\b(likelihood|gaussian) is (not )?None|is_regression_dataset\(|"
    r"isinstance\([^)]*\b(Gaussian|RegressionSplits|TabularDataset)\b|\bif (not )?regression\b|"
    r"\bregression (or|else)\b|\bis (not )?Likelihood\.|== ['\"]gaussian['\"]|\.model\.gaussian is"
)
"""A branch on the likelihood: the likelihood, its object or its data compared, or a regression flag read."""

RMSE_READ = re.compile(r"\brmse is (not )?None")


def _found(pattern: re.Pattern[str]) -> dict[str, int]:
    found: dict[str, int] = {}
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if rel == "likelihood.py":
            continue
        for line in path.read_text().splitlines():
            code = line.split("#")[0].strip()
            if pattern.search(code) and not code.startswith(('"', "raise", 'f"', "def ")):
                found[rel] = found.get(rel, 0) + 1
    return found


def test_a_regression_is_told_apart_from_a_classifier_in_the_likelihood_tables_only():
    """Issue #36: the likelihood is dispatched once (flatbma.likelihood and the tables keyed by it), not by branches."""
    caught = ["if exp.likelihood is not None:", "if is_regression_dataset(d.name):", "if cfg.model.gaussian is None:"]
    assert all(BRANCH.search(line) for line in caught) and not BRANCH.search("if posterior.can.gaussian is None:")
    assert _found(BRANCH) == BRANCHES
    assert sum(BRANCHES.values()) <= 3
    assert _found(RMSE_READ) == RMSE_READS
