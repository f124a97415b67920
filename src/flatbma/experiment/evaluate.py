"""Evaluation in one place: a trained (experiment, state) → metrics.

* :func:`posterior_samples` — the ``eval.num_samples`` weight samples of the BMA, BatchNorm statistics
  recomputed on the training data when the method asks (SWAG's ``bn_update``);
* :func:`bma_metrics` — accuracy, NLL, ECE, adaptive ECE and Brier score of the BMA predictive
  ``log p(y|x) = logsumexp_m log softmax(f(x; w_m))_y − log M`` (:func:`flatbma.predict.evaluate`);
* :func:`bma_curve_metrics` — the same for the BMA of the first ``m`` samples, every ``m`` of a list,
  in one pass (:func:`flatbma.predict.stream_metrics`), with the reliability diagram of the full BMA;
* temperature scaling on the validation split (Guo et al. 2017), corrupted test sets (Hendrycks &
  Dietterich 2019), Hessian spectra and distribution-level flatness, a 1-D loss landscape;
* :func:`evaluate_state` (what ``flatbma train``/``evaluate`` record) and :func:`measure` (what
  ``flatbma compare`` records) put them together.

Both entry points draw their random numbers (BatchNorm batches and augmentation, MC-dropout masks,
corruption seeds' loaders) from the state the experiment's build left (:attr:`Experiment.rng`, and
a fresh BatchNorm loader), under a forked RNG: the metrics of a state do not depend on what ran
before in the process — right after training or from a checkpoint on disk, they are the same.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from flatbma.bn import recompute_bn_statistics
from flatbma.calibration import fit_temperature
from flatbma.data.corruptions import applicable, corrupt_dataset
from flatbma.experiment.build import Experiment
from flatbma.flatness.lanczos import ConvergenceWarning
from flatbma.flatness.landscape import posterior_landscape, random_direction
from flatbma.flatness.posterior import flatness_report
from flatbma.metrics import StreamingMetrics
from flatbma.predict import evaluate, predict, stream_metrics
from flatbma.types import Batch, Params, State

CLEAN_KEYS = ("accuracy", "nll", "ece", "aece", "brier")
"""BMA metrics on the clean test set."""


def posterior_samples(exp: Experiment, state: State) -> list[Params]:
    """The ``eval.num_samples`` posterior samples of the BMA (BatchNorm recomputed when the method asks).

    Sampling uses a generator seeded by the run's seed; BatchNorm recomputation runs every sample
    through one fresh loader of the training data (:attr:`Experiment.bn_loader`), one epoch each.
    """
    generator = torch.Generator(device="cpu").manual_seed(exp.config.seed)
    samples = exp.method.sample(state, exp.config.eval.num_samples, generator)
    if exp.method.recompute_bn:
        loader = exp.bn_loader()
        samples = [recompute_bn_statistics(exp.model, w, loader, device=exp.device) for w in samples]
    return samples


def bma_metrics(exp: Experiment, samples: list[Params]) -> dict[str, Any]:
    """BMA metrics on the test set (summed over the processes that each evaluate a shard of it)."""
    return evaluate(
        exp.model,
        samples,
        exp.test_loader,
        num_classes=exp.num_classes,
        n_bins=exp.config.eval.n_bins,
        device=exp.device,
        mode=exp.method.predict_mode,
        reduce_metrics=exp.strategy.reduce_metrics,
    )


def flatness_metrics(exp: Experiment, samples: list[Params]) -> dict[str, Any]:
    """Hessian spectra of the first ``eval.flatness_samples`` samples and distribution-level flatness.

    The Hessian is that of the mean training loss (no augmentation) over the trained parameters —
    the Bayesian subset when ``model.trainable`` restricts it. Lanczos runs that stop at
    ``eval.hessian_max_iter`` before reaching their tolerance are reported (``hessian_converged``,
    ``hessian_warnings`` with their residuals) rather than printed.
    """
    e = exp.config.eval
    names = [n for n, p in exp.model.named_parameters() if p.requires_grad]
    chosen = samples[: e.flatness_samples]
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:  # recorded in the report instead of printed per spectrum
        warnings.simplefilter("always", ConvergenceWarning)
        report = flatness_report(
            exp.model,
            chosen,
            [(x.to(exp.device), y.to(exp.device)) for x, y in exp.hessian_loader],
            k=e.hessian_k,
            params=names,
            rho=e.sharpness_rho,
            max_iter=e.hessian_max_iter,
            seed=exp.config.seed,
        )
    unconverged = [str(w.message) for w in caught if issubclass(w.category, ConvergenceWarning)]
    for w in caught:
        if not issubclass(w.category, ConvergenceWarning):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    report["hessian_converged"] = not unconverged
    report["hessian_warnings"] = unconverged
    report["flatness_time_s"] = time.perf_counter() - start
    return report


def evaluate_state(exp: Experiment, state: State, *, flatness: bool = False) -> dict[str, Any]:
    """BMA metrics of ``state`` on the test set (and flatness when asked), from the build's RNG state."""
    with exp.rng.restored():
        samples = posterior_samples(exp, state)
        metrics = bma_metrics(exp, samples)
        if flatness:
            metrics.update(flatness_metrics(exp, samples))
    return metrics


def bma_log_probs_over(exp: Experiment, samples: list[Params], loader: Iterable[Batch]) -> tuple[Tensor, Tensor]:
    """BMA log-probabilities and labels of a whole (small) loader, e.g. the validation split, on the CPU."""
    outs, labels = [], []
    for log_probs, y in predict(exp.model, samples, loader, device=exp.device, mode=exp.method.predict_mode):
        outs.append(log_probs.cpu())
        labels.append(y.cpu())
    return torch.cat(outs), torch.cat(labels)


def bma_curve_metrics(
    exp: Experiment,
    samples: list[Params],
    loader: Iterable[Batch],
    sizes: tuple[int, ...],
    *,
    temperature: float = 1.0,
) -> tuple[dict[int, dict[str, float]], dict[str, list]]:
    """Metrics of the BMA of the first ``m`` samples for every ``m`` in ``sizes``, in one pass.

    ``temperature`` rescales every BMA predictive (``softmax(log p / T)``; 1 = none).

    Returns:
        ``({m: metrics}, reliability diagram of the full BMA)``.
    """
    states = stream_metrics(
        exp.model,
        samples,
        loader,
        num_classes=exp.num_classes,
        n_bins=exp.config.eval.n_bins,
        sizes=sizes,
        temperature=temperature,
        device=exp.device,
        mode=exp.method.predict_mode,
        reduce_metrics=exp.strategy.reduce_metrics,
    )
    return {m: s.compute() for m, s in states.items()}, _reliability(states[len(samples)])


def _reliability(state: StreamingMetrics) -> dict[str, list]:
    """The reliability diagram as JSON lists (empty bins: ``None``)."""
    return {k: [None if v != v else float(v) for v in t.tolist()] for k, t in state.reliability().items()}


def corruption_metrics(
    exp: Experiment, samples: list[Params], names: tuple[str, ...], severities: tuple[int, ...]
) -> dict[str, dict[str, dict[str, float]]]:
    """BMA accuracy/NLL/ECE on each corrupted copy of the test set."""
    test = exp.test_loader.dataset
    channels = test.images.shape[1]
    out: dict[str, dict[str, dict[str, float]]] = {}
    for name in names:
        if not applicable(name, channels):
            continue
        out[name] = {}
        for severity in severities:
            shifted = corrupt_dataset(test, name, severity, seed=exp.config.seed)
            loader = torch.utils.data.DataLoader(shifted, batch_size=exp.config.data.eval_batch_size)
            metrics, _ = bma_curve_metrics(exp, samples, loader, (len(samples),))
            m = metrics[len(samples)]
            out[name][str(severity)] = {k: m[k] for k in ("accuracy", "nll", "ece")}
    return out


def landscape_metrics(exp: Experiment, samples: list[Params]) -> dict[str, list[float]]:
    """Training loss of each sample along one filter-normalized random direction (mean ± std over samples)."""
    names = [n for n, p in exp.model.named_parameters() if p.requires_grad]
    chosen = samples[: exp.config.eval.flatness_samples]
    data = [(x.to(exp.device), y.to(exp.device)) for x, y in exp.hessian_loader]
    direction = random_direction(chosen[0], names, seed=exp.config.seed)
    alphas = torch.linspace(-1.0, 1.0, 21)
    mean, std = posterior_landscape(exp.model, data, chosen, direction, alphas)
    return {"alphas": alphas.tolist(), "mean": mean.tolist(), "std": std.tolist()}


def measure(
    exp: Experiment,
    state: State,
    *,
    bma_curve: tuple[int, ...],
    corruptions: tuple[str, ...],
    severities: tuple[int, ...],
    corruption_samples: int | None,
    flatness: bool,
    landscape: bool,
) -> dict[str, Any]:
    """Every comparison measurement of ``state`` (``flatbma compare``), from the build's RNG state.

    Args:
        exp: the run's experiment.
        state: its trained state.
        bma_curve: numbers of samples ``m`` of the BMA curve.
        corruptions: corruption names evaluated on the test set.
        severities: their severities.
        corruption_samples: BMA samples on the corrupted sets (the first ones; ``None``: all).
        flatness: measure Hessian spectra and distribution-level flatness.
        landscape: record a 1-D loss landscape.
    """
    with exp.rng.restored():
        start = time.perf_counter()
        samples = posterior_samples(exp, state)
        curve, reliability = bma_curve_metrics(exp, samples, exp.test_loader, bma_curve)
        full = curve[len(samples)]
        result: dict[str, Any] = {k: full[k] for k in CLEAN_KEYS}
        result["bma_curve"] = {
            "num_samples": list(curve),
            **{k: [curve[m][k] for m in curve] for k in ("accuracy", "nll", "ece")},
        }
        result["reliability"] = reliability
        result["temperature"] = None
        if exp.val_loader is not None:  # temperature scaling on the k-shot validation split, reported separately
            val_log_probs, val_labels = bma_log_probs_over(exp, samples, exp.val_loader)
            t = fit_temperature(val_log_probs, val_labels)
            scaled, _ = bma_curve_metrics(exp, samples, exp.test_loader, (len(samples),), temperature=t)
            result["temperature"] = t
            result["temperature_scaled"] = {k: scaled[len(samples)][k] for k in CLEAN_KEYS}
        shifted = samples[:corruption_samples] if corruption_samples else samples
        result["corruptions"] = corruption_metrics(exp, shifted, corruptions, severities)
        result["corruption_samples"] = len(shifted)
        if flatness:
            result.update(flatness_metrics(exp, samples))
        result["landscape"] = landscape_metrics(exp, samples) if landscape else None
        result["eval_time_s"] = time.perf_counter() - start
    return result
