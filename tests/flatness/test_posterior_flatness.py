import pytest
import torch
from torch import nn

from flatbma.errors import FlatbmaError
from flatbma.flatness.posterior import distribution_spectrum, flatness_report, sam_sharpness, sample_spectra


class Vector(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(d, dtype=torch.float64))

    def forward(self, x):
        return self.w.expand(x.shape[0], -1)


A = torch.tensor([3.0, 1.0, 0.5, 0.2, 0.1, 0.05], dtype=torch.float64)
DATA = [(torch.zeros(2, 1, dtype=torch.float64), torch.zeros(2))]


def quartic(out, y):  # L(w) = Σ a_i w_i⁴ / 12  →  H(w) = diag(a_i w_i²)
    return (A * out[0] ** 4).sum() / 12


def quadratic(out, y):  # L(w) = ½ Σ a_i w_i²  →  H = diag(a)
    return 0.5 * (A * out[0] ** 2).sum()


SAMPLES = [
    {"w": torch.tensor([1.0, 2.0, 0.5, 1.0, 1.0, 1.0], dtype=torch.float64)},
    {"w": torch.tensor([0.2, 0.1, 3.0, 1.0, 1.0, 1.0], dtype=torch.float64)},
]


def test_per_sample_and_distribution_spectra_of_a_quartic():
    model = Vector(6)
    spectra = sample_spectra(model, SAMPLES, DATA, k=2, loss_fn=quartic, tol=1e-8, max_iter=6)
    for row, s in zip(spectra, SAMPLES):
        expected = torch.sort(A * s["w"] ** 2, descending=True).values[:2]
        torch.testing.assert_close(row, expected, rtol=1e-6, atol=1e-8)
    averaged = A * torch.stack([s["w"] ** 2 for s in SAMPLES]).mean(0)
    dist = distribution_spectrum(model, SAMPLES, DATA, k=2, loss_fn=quartic, tol=1e-8, max_iter=6)
    torch.testing.assert_close(dist, torch.sort(averaged, descending=True).values[:2], rtol=1e-6, atol=1e-8)
    # λ₁ of the averaged Hessian never exceeds the average of per-sample λ₁ (convexity)
    assert dist[0] <= spectra[:, 0].mean() + 1e-9


def test_a_single_sample_reports_its_own_spectrum_as_the_distribution_spectrum():
    model = Vector(6)
    one = SAMPLES[:1]
    report = flatness_report(model, one, DATA, k=2, loss_fn=quartic, tol=1e-8, max_iter=6)
    direct = distribution_spectrum(model, one, DATA, k=2, loss_fn=quartic, tol=1e-8, max_iter=6)
    torch.testing.assert_close(torch.tensor(report["distribution_top_eigenvalues"], dtype=torch.float64), direct)
    assert report["distribution_top_eigenvalues"] == report["hessian_top_eigenvalues"][0]


def test_sam_sharpness_of_a_quadratic_is_exact():
    model = Vector(6)
    rho = 0.1
    got = sam_sharpness(model, SAMPLES, DATA, rho=rho, loss_fn=quadratic)
    for value, s in zip(got, SAMPLES):
        g = A * s["w"]
        u = g / g.norm()
        assert float(value) == pytest.approx(float(rho * g.norm() + 0.5 * rho**2 * (A * u * u).sum()), rel=1e-9)


def test_report_keys_and_bad_input():
    model = Vector(6)
    report = flatness_report(model, SAMPLES, DATA, k=5, loss_fn=quartic, max_iter=6, tol=1e-8)
    for key in (
        "hessian_top_eigenvalues",
        "lambda1",
        "lambda1_std",
        "lambda1_over_lambda5",
        "distribution_lambda1",
        "sam_sharpness",
        "flatness_samples",
    ):
        assert key in report
    with pytest.raises(FlatbmaError, match="at least one posterior sample"):
        sample_spectra(model, [], DATA)
