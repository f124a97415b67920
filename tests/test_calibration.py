import pytest
import torch
from scipy.optimize import minimize_scalar

from flatbma.calibration import fit_temperature, scale
from flatbma.errors import FlatbmaError


def test_fit_temperature_matches_scipy_and_recovers_a_known_temperature():
    g = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(2000, 5, generator=g, dtype=torch.float64)
    labels = torch.distributions.Categorical(logits=logits).sample()  # calibrated at T = 1 for `logits`
    over_confident = torch.log_softmax(2.5 * logits, -1)  # needs T ≈ 2.5
    t = fit_temperature(over_confident, labels)
    assert t == pytest.approx(2.5, rel=0.1)
    ref = minimize_scalar(
        lambda tt: float(torch.nn.functional.cross_entropy(over_confident / tt, labels)),
        bounds=(0.05, 20),
        method="bounded",
    ).x
    assert t == pytest.approx(ref, rel=1e-3)
    nll = lambda lp: float(torch.nn.functional.nll_loss(lp, labels))  # noqa: E731
    assert nll(scale(over_confident, t)) <= nll(over_confident)


def test_bad_inputs():
    with pytest.raises(FlatbmaError, match="val_per_class"):
        fit_temperature(torch.zeros(0, 3), torch.zeros(0))
    with pytest.raises(FlatbmaError, match="temperature must be > 0"):
        scale(torch.zeros(2, 3), 0.0)
