import pytest
import torch
from torch import nn

from flatbma.errors import FlatbmaError
from flatbma.flatness.posterior import (
    SpectrumOptions,
    distribution_spectrum,
    flatness_report,
    measure_samples,
    repeatability,
    sam_sharpness,
    sample_spectra,
)


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


# ----------------------------------------------------------------------------- the protocol

GAP = {"w": torch.sqrt(torch.tensor([100.0, 1.0, 0.9, 0.8, 0.7, 0.6], dtype=torch.float64) / A)}  # H = diag(...)
CLOSE = {"w": torch.sqrt(torch.tensor([1.0, 0.999, 0.998, 0.5, 0.3, 0.1], dtype=torch.float64) / A)}


def test_unconverged_eigenvalues_are_reported_not_averaged():
    """λ₁ of GAP converges in 3 Lanczos steps, λ₁ of CLOSE (gap 1e-3) does not: only GAP's is summarized."""
    report = flatness_report(Vector(6), [GAP, CLOSE], DATA, loss_fn=quartic, max_iter=3, tol=1e-3, distribution=False)
    assert report["hessian_eigenvalue_converged"] == [[True], [False]]
    assert report["lambda1"] == pytest.approx(100.0, rel=1e-6) and report["lambda1_summary"]["n"] == 1
    assert len(report["lambda1_unconverged"]) == 1 and report["lambda1_unconverged"][0] < 1.0
    assert not report["hessian_converged"]
    assert len(report["hessian_warnings"]) == 1 and report["hessian_warnings"][0].startswith("sample 1: λ1")
    # the per-eigenvalue flags of the solver itself
    op_report = flatness_report(Vector(6), [CLOSE], DATA, loss_fn=quartic, k=2, max_iter=6, tol=1e-3)
    assert op_report["hessian_converged"] and op_report["lambda1_over_lambda2"] == pytest.approx(1.0 / 0.999, rel=2e-3)


def test_ratio_needs_a_converged_lambda_k():
    report = flatness_report(Vector(6), [CLOSE], DATA, loss_fn=quartic, k=2, max_iter=2, tol=1e-6, distribution=False)
    assert report["hessian_eigenvalue_converged"][0][1] is False
    assert report["lambda1_over_lambda2"] is None


def test_protocol_values_on_a_quartic():
    """λ₁ per sample, at the mean, of the averaged Hessian, the trace (exact for a diagonal Hessian), the summary."""
    samples = [
        {"w": torch.tensor([1.0, 2.0, 0.5, 1.0, 1.0, 1.0], dtype=torch.float64) * (1 + 0.1 * i)} for i in range(5)
    ]
    mean = {"w": torch.tensor([1.0, 2.0, 0.5, 1.0, 1.0, 1.0], dtype=torch.float64) * 1.2}
    report = flatness_report(
        Vector(6), samples, DATA, loss_fn=quartic, mean=mean, tol=1e-8, max_iter=6, trace_probes=3, seed=4
    )
    per_sample = [float((A * s["w"] ** 2).max()) for s in samples]
    assert report["lambda1"] == pytest.approx(sum(per_sample) / 5, rel=1e-6)
    summary = report["lambda1_summary"]
    assert summary["n"] == 5 and summary["method"] == "bootstrap"
    assert summary["interval"]["low"] <= summary["mean"] <= summary["interval"]["high"]
    assert report["lambda1_at_mean"] == pytest.approx(float((A * mean["w"] ** 2).max()), rel=1e-6)
    averaged = A * torch.stack([s["w"] ** 2 for s in samples]).mean(0)
    assert report["distribution_lambda1"] == pytest.approx(float(averaged.max()), rel=1e-6)
    traces = [float((A * s["w"] ** 2).sum()) for s in samples]  # zᵀ diag(h) z = Σ h_i for z ∈ {±1}^d
    assert report["hessian_trace"]["mean"] == pytest.approx(sum(traces) / 5, rel=1e-9)
    assert report["hessian_trace"]["probes"] == 3
    assert report["hessian_converged"] and report["flatness_samples"] == 5
    again = flatness_report(
        Vector(6), samples, DATA, loss_fn=quartic, mean=mean, tol=1e-8, max_iter=6, trace_probes=3, seed=4
    )
    assert again == report  # seeded: the same measurement twice


def test_a_point_is_measured_once_and_its_mean_is_its_sample():
    w = {"w": torch.tensor([1.0, 2.0, 0.5, 1.0, 1.0, 1.0], dtype=torch.float64)}
    copies = [dict(w) for _ in range(4)]  # the same tensors (as MC dropout's samples are)
    report = flatness_report(Vector(6), copies, DATA, loss_fn=quartic, mean=dict(w), tol=1e-8, max_iter=6)
    assert report["flatness_samples"] == 1 and report["lambda1_summary"]["n"] == 1
    assert report["lambda1_summary"]["interval"] is None and report["lambda1_std"] == 0.0
    assert report["lambda1_at_mean"] == report["lambda1"]
    assert report["distribution_top_eigenvalues"] == report["hessian_top_eigenvalues"][0]


def test_repeatability_compares_the_intervals():
    from flatbma.stats import summarize

    a = summarize([10.0, 12.0, 11.0, 13.0, 9.0], method="bootstrap")
    close = summarize([10.5, 12.5, 11.5, 12.0, 10.0], method="bootstrap")
    far = summarize([30.0, 31.0, 29.0, 32.0, 30.5], method="bootstrap")
    result = repeatability(a, close, tol=1e-3)
    assert result["agree"] and result["means_in_other_interval"] and result["intervals_overlap"]
    result = repeatability(a, far, tol=1e-3)
    assert not result["agree"] and result["means_in_other_interval"] is False and result["intervals_overlap"] is False
    assert repeatability(a.to_dict(), close.to_dict(), tol=1e-3)["agree"]  # the JSON forms too
    one, other = summarize([100.0]), summarize([100.15])
    assert repeatability(one, other, tol=1e-3)["agree"] and not repeatability(one, other, tol=1e-4)["agree"]
    assert repeatability(None, one, tol=1e-3)["agree"] is False


def test_agreement_is_the_two_sample_test_of_the_reported_half_widths():
    """Agreement is |m₁ − m₂| ≤ √(h₁² + h₂²) (facing half-widths); the means need not lie in each other's interval."""
    first = {"n": 8, "mean": 10.0, "interval": {"low": 8.0, "high": 12.0, "level": 0.95}}
    second = {"n": 8, "mean": 12.5, "interval": {"low": 11.0, "high": 13.0, "level": 0.95}}  # √(2² + 1.5²) = 2.5
    result = repeatability(first, second, tol=1e-3)
    assert result["agree"] and result["means_in_other_interval"] is False and result["intervals_overlap"]
    result = repeatability(first, {**second, "mean": 12.6}, tol=1e-3)
    assert not result["agree"]


def test_noise_test_two_measurements_of_one_posterior_agree():
    """The noise test on a small network: a Gaussian posterior around an MLP's weights, measured twice.

    Each measurement draws its own 8 samples (another generator seed) and uses its own measurement seed
    (Lanczos start vectors, bootstrap). Honest 95% intervals make the two agree 19 times in 20 in
    theory (the percentile bootstrap of 8 samples is a little narrow): of 10 repeated pairs, at least 8.
    """
    from tests.flatness.problems import make_problem

    problem = make_problem()
    model = problem.model.eval()
    names = [n for n, _ in model.named_parameters()]
    base = {k: v.detach() for k, v in model.named_parameters()}

    def measure(seed: int) -> dict:
        g = torch.Generator().manual_seed(seed)
        draws = [
            {k: v + 0.3 * torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in base.items()} for _ in range(8)
        ]
        report = flatness_report(model, draws, problem.batches, params=names, seed=seed, distribution=False)
        assert report["hessian_converged"]
        return report["lambda1_summary"]

    results = [repeatability(measure(2 * i), measure(2 * i + 1), tol=1e-3) for i in range(10)]
    assert sum(r["agree"] for r in results) >= 8, [r["agree"] for r in results]
    assert all(r["first"]["mean"] != r["second"]["mean"] for r in results)  # different samples were measured


def test_the_protocol_and_measure_samples_default_to_the_shared_spectrum_options():
    import dataclasses
    import inspect

    for entry in (flatness_report, measure_samples):
        defaults = inspect.signature(entry).parameters
        for field in dataclasses.fields(SpectrumOptions):
            assert defaults[field.name].default == field.default, (entry.__name__, field.name)
