"""Every method with its defaults on a from-scratch CNN (issue #35): it runs, and its BMA is no worse than its
reference network on validation data — or it says so, in one line with advice for its own settings.

A small CNN with BatchNorm (``SmallCNN`` of width 4) on 300 of digits' training images, 8 epochs of 10 updates
(the fewest that SWAG's default rank 20 needs: a window of 20 updates, the last quarter), ``fit_posterior`` with
nothing but the method's name, ``epochs`` and a ``val_loader`` of 150 other training images. The reference is
:meth:`BMA.reference <flatbma.predictor.BMA.reference>`: the posterior mean, a mixture's member 0, SGLD's average
of samples.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import flatbma
from flatbma.data import load_digits
from flatbma.health import worse_than_mean
from flatbma.models.small import SmallCNN
from flatbma.predict import evaluate

METHODS = ("sgd", "swag", "mfvi", "lowrank-vi", "fp-bma", "laplace", "ensemble", "multiswag", "mc-dropout", "sgld")


@pytest.fixture(scope="module")
def digits() -> tuple[TensorDataset, DataLoader]:
    splits = load_digits()
    g = torch.Generator().manual_seed(0)
    order = torch.randperm(len(splits.train), generator=g)
    images, labels = splits.train.images[order], splits.train.labels[order]
    train = TensorDataset(images[:300], labels[:300])
    val = DataLoader(TensorDataset(images[300:450], labels[300:450]), batch_size=150)
    return train, val


@pytest.mark.parametrize("method", METHODS)
def test_every_method_runs_with_its_defaults_and_its_bma_is_no_worse_or_it_warns(digits, method):
    train, val = digits
    torch.manual_seed(0)
    loader = DataLoader(train, batch_size=30, shuffle=True, generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        bma = flatbma.fit_posterior(SmallCNN(1, 10, width=4), loader, method, epochs=8, val_loader=val, progress=False)
    lines = [str(w.message) for w in caught if "too wide" in str(w.message)]
    weights, reference = bma.reference()
    compared = {"data": "validation", "num_classes": 10, **bma.paired_nll(val, weights)}  # what fit_posterior weighs
    theirs = evaluate(bma.model, [weights], val, num_classes=10)
    assert compared["mean_nll"] == pytest.approx(theirs["nll"], rel=1e-6)
    assert compared["bma_accuracy"] > 0.2, compared  # chance 0.1 (SGLD 0.23: its chain has no momentum; others > 0.77)
    assert len(lines) == worse_than_mean(compared), (lines, compared)  # worse than its reference: one line
    noise = 2 * compared["nll_diff_se"]
    assert compared["bma_nll"] <= max(1.01 * compared["mean_nll"] + 1e-3, compared["mean_nll"] + noise) or lines
    for line in lines:
        assert line.startswith(f"the {method} BMA has a posterior too wide for its ") and "(try " in line
    samples = bma.samples
    epistemic = float(bma.predict_uncertainty(val)["epistemic"].mean())  # the samples' predictions disagree
    if method == "sgd":
        assert len(samples) == 1 and reference == "mean" and epistemic == 0
        return
    assert epistemic > 1e-6, f"the BMA is a point: mutual information {epistemic:.2e}"  # measured 1.8e-4 to 0.11
    if method == "swag":
        assert int(bma.state.aux["swag/n_collected"]) == 20  # rank 20 spread over the last quarter
    if method == "sgld":
        assert reference == "sample average" and len(samples) == 30  # the second half, 30 kept
    if method in ("ensemble", "multiswag"):
        assert reference == "member 0" and bma.loaded == "member 0 of 5"
