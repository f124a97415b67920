"""Evaluation in one place: a trained (experiment, state) → metrics.

The BMA predictive ``log p(y|x) = logsumexp_m log softmax(f(x; w_m))_y − log M`` (or the Laplace family's
linearized one), BatchNorm statistics recomputed for every method; temperature scaling (Guo et al. 2017),
corrupted test sets (Hendrycks & Dietterich 2019), OOD detection, the flatness protocol, a 1-D loss landscape.
:func:`evaluate_state` (``train``/``evaluate``) and :func:`measure` (``compare``) draw from the build's RNG state
(:attr:`Experiment.rng`) under a fork, so a state's metrics do not depend on what ran before in the process.

Over 500 lines on purpose: ``train``, ``evaluate`` and ``compare`` measure a state with the same code.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from functools import partial
from itertools import islice
from typing import Any

import torch
from torch import Tensor

from flatbma import likelihood as likelihoods
from flatbma import progress
from flatbma.bn import has_batchnorm, with_recomputed_statistics
from flatbma.calibration import fit_temperature
from flatbma.data.corruptions import applicable, corrupt_dataset
from flatbma.errors import FlatbmaError
from flatbma.experiment.config.run_config import CORRUPTIONS_NOT_TABULAR
from flatbma.experiment.run.build import Experiment
from flatbma.flatness import (
    distinct_samples,
    flatness_report,
    lambda1_summary,
    measure_samples,
    repeatability,
    sample_variance,
    width,
)
from flatbma.flatness.landscape import posterior_landscape, random_direction
from flatbma.health import HEALTH_EXAMPLES
from flatbma.likelihood import Likelihood, kind
from flatbma.linearized import LinearizedPredictive
from flatbma.metric_names import Group, test_keys
from flatbma.metrics import StreamingMetrics
from flatbma.ood import ood_dataset, ood_metrics, uncertainty_scores
from flatbma.precision import autocast
from flatbma.predict import (
    Predictions,
    evaluate,
    paired_nll,
    predict,
    rescaled_metrics,
    stream_metrics,
)
from flatbma.predictor import bma_predictions as predictor_predictions
from flatbma.predictor import posterior_mean as mean_weights
from flatbma.predictor import reference_point, trained_names
from flatbma.regression import Gaussian, mixture_metrics, normal_nll, sample_outputs
from flatbma.rng import splitmix64
from flatbma.types import Batch, Params, Predictive, State, prediction_mode

CLEAN_KEYS = test_keys(Group.CLASSIFIER)
"""BMA metrics on the clean test set (:mod:`flatbma.metric_names`)."""


BN_RECOMPUTED = "recomputed (un-augmented training set)"
"""``bn_statistics`` of a model with BatchNorm: every sample's statistics, the point's included, recomputed."""
BN_NONE = "none (the model has no BatchNorm)"
"""``bn_statistics`` of a model without BatchNorm."""
BN_AT_MEAN = "recomputed at the posterior mean (un-augmented training set), linearized there"
"""``bn_statistics`` of ``glm`` and ``probit``: recomputed once, at ``w̄`` (the flatness samples: each their own)."""

REPEAT_STREAM = 1
"""Stream of the run's seed (:func:`flatbma.rng.splitmix64`) that seeds the repeated flatness measurement."""


def posterior_samples(exp: Experiment, state: State, n: int | None = None, *, seed: int | None = None) -> list[Params]:
    """``n`` posterior samples (default ``eval.num_samples``): :func:`draw_samples`, then :func:`with_bn_statistics`."""
    return with_bn_statistics(exp, draw_samples(exp, state, n, seed=seed))


def draw_samples(exp: Experiment, state: State, n: int | None = None, *, seed: int | None = None) -> list[Params]:
    """``n`` samples (default ``eval.num_samples``) drawn from a CPU generator of ``seed`` (default the run's)."""
    generator = torch.Generator(device="cpu").manual_seed(exp.config.seed if seed is None else seed)
    return exp.method.sample(state, exp.config.eval.num_samples if n is None else n, generator)


def bma_predictions(
    exp: Experiment, state: State, drawn: list[Params], samples: list[Params] | None = None
) -> Predictions:
    """What the BMA averages, by the method's :attr:`~flatbma.types.Capabilities.predictive`.

    ``samples``: the ``drawn`` samples with recomputed BatchNorm statistics (computed here when not given).
    ``glm`` and ``probit``: the network linearized at the posterior mean, statistics recomputed there (``glm``
    averages over ``Δ_m = w_m − w̄`` of ``drawn``), as :class:`flatbma.BMA` does.
    """
    if samples is not None and exp.method.can.predictive is Predictive.SAMPLES:
        return samples
    return predictor_predictions(exp.method, state, drawn, _trained_names(exp), partial(with_bn_statistics, exp))


def diagnostics(exp: Experiment, state: State) -> dict[str, Any]:
    """``{"diagnostics": ...}`` of a method that has them (:attr:`~flatbma.types.Capabilities.diagnostics`), or {}."""
    if exp.method.can.diagnostics is None:
        return {}
    return {"diagnostics": exp.method.can.diagnostics(state)}


def with_bn_statistics(exp: Experiment, samples: list[Params]) -> list[Params]:
    """``samples`` with BatchNorm statistics recomputed on the un-augmented training data in a fixed order.

    One pass over :attr:`Experiment.bn_loader` with dropout off (MC dropout gets its deterministic network's
    statistics). Repeats of the same weights (same tensors) are recomputed once and share one dict; samples of a
    model without BatchNorm are returned as given.
    """
    with forward_precision(exp):
        return with_recomputed_statistics(exp.model, samples, exp.bn_loader, device=exp.device)


def forward_precision(exp: Experiment) -> AbstractContextManager[Any]:
    """The run's ``train.precision`` for the BMA's forward passes: autocast to bf16/fp16, none at fp32.

    It covers the BatchNorm recomputation and the predictions; the logits leave the model as float32.
    Hessian-vector products and linearized predictives stay float32 (:mod:`flatbma.precision`).
    """
    return autocast(exp.config.train.precision, exp.device)


def posterior_mean(exp: Experiment, state: State, samples: list[Params]) -> Params:
    """The posterior mean (the method's, else the average of ``samples``) with recomputed BatchNorm statistics."""
    return with_bn_statistics(exp, [mean_weights(exp.method, state, samples, _trained_names(exp))])[0]


def posterior_width(exp: Experiment, state: State, samples: list[Params]) -> dict[str, Any]:
    """``tr Σ`` and median marginal std over the trained weights: exact where the method has them, else from samples."""
    if exp.method.marginal_variance is not None:
        return width(exp.method.marginal_variance(state), exact=True, source="closed form").to_dict()
    distinct = distinct_samples(samples)
    variance = sample_variance(distinct, _trained_names(exp))
    return width(variance, exact=False, source=f"sample variance over {len(distinct)} samples").to_dict()


def bn_statistics(exp: Experiment) -> str:
    """What the samples' BatchNorm statistics are: :data:`BN_RECOMPUTED`, :data:`BN_AT_MEAN` or :data:`BN_NONE`."""
    if not has_batchnorm(exp.model):
        return BN_NONE
    return BN_RECOMPUTED if exp.method.can.predictive is Predictive.SAMPLES else BN_AT_MEAN


def _trained_names(exp: Experiment) -> list[str]:
    return trained_names(exp.model)


def bma_metrics(exp: Experiment, samples: Predictions) -> dict[str, Any]:
    """BMA metrics on the test set (summed over the processes that each evaluate a shard of it)."""
    with forward_precision(exp):
        return evaluate(
            exp.model,
            samples,
            exp.test_loader,
            num_classes=exp.num_classes,
            n_bins=exp.config.eval.n_bins,
            device=exp.device,
            mode=prediction_mode(exp.method, exp.config.seed),
            reduce_metrics=exp.strategy.reduce_metrics,
        )


def flatness_metrics(exp: Experiment, state: State, samples: list[Params]) -> dict[str, Any]:
    """The flatness protocol of ``state``, its posterior width and the measurement's repeatability.

    The Hessian of the run's mean training loss (cross-entropy or Gaussian NLL, un-augmented; docs/methods.md §8.1)
    over the trained parameters on :attr:`Experiment.hessian_loader`, every sample with the BMA's BatchNorm
    statistics. λ₁ per sample on the first ``eval.flatness_samples`` samples (drawn anew when the BMA has fewer) and
    at the posterior mean, plus what ``eval.trace`` and ``eval.distribution_spectrum`` ask for. With
    ``eval.repeatability`` λ₁ is measured again on another draw and seed (stream :data:`REPEAT_STREAM`).
    """
    e = exp.config.eval
    start = time.perf_counter()
    names = _trained_names(exp)
    data = [(x.to(exp.device), y.to(exp.device)) for x, y in exp.hessian_loader]
    if len(samples) < e.flatness_samples:
        samples = posterior_samples(exp, state, e.flatness_samples)
    chosen = samples[: e.flatness_samples]
    options = dict(k=e.hessian_k, params=names, tol=e.hessian_tol, max_iter=e.hessian_max_iter, loss_fn=exp.likelihood)
    spectrum = "λ₁" if e.hessian_k == 1 else f"λ₁…λ{e.hessian_k}"
    with progress.current().phase("flatness", f"{progress.count(len(chosen), 'sample')} {spectrum}"):
        report = flatness_report(
            exp.model,
            chosen,
            data,
            mean=posterior_mean(exp, state, samples),
            rho=e.sharpness_rho,
            seed=exp.config.seed,
            trace_probes=e.trace_probes if e.trace else 0,
            distribution=e.distribution_spectrum,
            **options,
        )
    report["width"] = posterior_width(exp, state, samples)
    report["hessian_examples"] = sum(len(y) for _, y in data)
    report["hessian_tol"] = e.hessian_tol
    report["flatness_time_s"] = time.perf_counter() - start
    if e.repeatability:
        start = time.perf_counter()
        with progress.current().phase("repeatability", "λ₁ again (another seed, another draw)"):
            report["repeatability"] = _repeat(exp, state, report, data, options)
        report["repeatability_time_s"] = time.perf_counter() - start
    return report


def _repeat(
    exp: Experiment, state: State, first: dict[str, Any], data: list[Batch], options: dict[str, Any]
) -> dict[str, Any]:
    """λ₁ per sample measured again (another measurement seed, another draw), compared with the first."""
    seed = splitmix64(exp.config.seed, REPEAT_STREAM) >> 1
    again = posterior_samples(exp, state, exp.config.eval.flatness_samples, seed=seed)
    measured = measure_samples(exp.model, distinct_samples(again), data, seed=seed, **options)
    second, unconverged = lambda1_summary(measured, seed=seed)
    result = repeatability(first["lambda1_summary"], second, tol=exp.config.eval.hessian_tol)
    result["second_unconverged"] = unconverged
    result["seed"] = seed
    return result


def training_fit(exp: Experiment, predictions: Predictions, state: State | None = None) -> dict[str, Any]:
    """How the BMA fits its training data: the health entry's measurements (:mod:`flatbma.health`).

    The BMA's accuracy and NLL on the first :data:`~flatbma.health.HEALTH_EXAMPLES` (whole batches) un-augmented
    training images of :attr:`Experiment.bn_loader` (a fixed random order), and the chance level (the share of the
    most frequent class among them); with ``state``, :func:`against_mean`. Runs under forked random generators.

    Returns:
        ``{"train_bma_accuracy", "train_bma_nll", "train_examples", "chance_accuracy", "against_mean"}``.
    """
    correct, nll, used, counts = 0, 0.0, 0, torch.zeros(exp.num_classes, dtype=torch.int64)
    devices = [exp.device.index or 0] if exp.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):  # a DataLoader's iterator draws its base seed
        mode = prediction_mode(exp.method, exp.config.seed)
        for log_probs, y in predict(exp.model, predictions, exp.bn_loader, device=exp.device, mode=mode):
            correct += int((log_probs.argmax(-1) == y).sum())
            nll -= float(log_probs.double().gather(1, y[:, None].to(torch.int64)).sum())
            counts += torch.bincount(y.cpu(), minlength=exp.num_classes)
            used += 1
            if int(counts.sum()) >= HEALTH_EXAMPLES:
                break
        n = int(counts.sum())
        fit = {"train_bma_accuracy": correct / n, "train_bma_nll": nll / n, "train_examples": n}
        compared = None if state is None else against_mean(exp, state, predictions, fit, used)
    return {**fit, "chance_accuracy": int(counts.max()) / n, "against_mean": compared}


def against_mean(
    exp: Experiment, state: State, predictions: Predictions, fit: dict[str, Any], batches: int
) -> dict[str, Any] | None:
    """The BMA's NLL and accuracy beside its reference network's, for the health rule ``worse_than_mean``.

    The reference (:func:`flatbma.predictor.reference_point`: the posterior mean, a mixture's ``"member 0"`` or
    SG-MCMC's ``"sample average"``) is evaluated as a point estimate with recomputed BatchNorm statistics, on the
    validation split when the run has one (the BMA too), else on the training ``batches`` :func:`training_fit` scored.

    Returns:
        ``{"data": "validation" | "training", "examples", "num_classes", "reference", "bma_nll", "bma_accuracy",
        "mean_nll", "mean_accuracy"}``, on validation data with ``nll_diff_se`` (:func:`flatbma.predict.paired_nll`).
    """
    if isinstance(predictions, LinearizedPredictive):  # linearized at the mean, with the mean's statistics
        at_mean, reference = [dict(predictions.mean)], "mean"
    else:
        names = trained_names(exp.model)
        weights, reference = reference_point(exp.method, state, predictions, names, exp.config.seed)
        at_mean = with_bn_statistics(exp, [weights])
    if exp.val_loader is not None:  # example by example: the rule weighs the difference against its noise
        mode = prediction_mode(exp.method, exp.config.seed)
        paired = paired_nll(exp.model, predictions, at_mean[0], list(exp.val_loader), device=exp.device, mode=mode)
        return {"data": "validation", "num_classes": exp.num_classes, "reference": reference, **paired}
    point = evaluate(exp.model, at_mean, islice(exp.bn_loader, batches), num_classes=exp.num_classes, device=exp.device)
    return {
        "data": "training",
        "examples": fit["train_examples"],
        "num_classes": exp.num_classes,
        "reference": reference,
        "bma_nll": fit["train_bma_nll"],
        "bma_accuracy": fit["train_bma_accuracy"],
        "mean_nll": point["nll"],
        "mean_accuracy": point["accuracy"],
    }


def regression_fit(exp: Experiment, samples: list[Params], *, test_rmse: float) -> dict[str, Any]:
    """How a regression BMA fits data like its training data: the health entry's measurements for its rules.

    The RMSE of the mixture mean ``(1/M) Σ_m μ_m(x)`` on the validation split, else on the first
    :data:`~flatbma.health.HEALTH_EXAMPLES` (whole batches) training examples of :attr:`Experiment.bn_loader`, and
    their targets' std (``ddof = 0``: the RMSE of predicting their mean). ``fitted_start``: the run started from
    fitted weights (``prior.init`` or ``model.pretrained``), which may rightly barely move. Runs under forked RNGs.

    Returns:
        ``{"regression": {"data": "validation" | "training", "examples", "rmse", "target_std", "test_rmse",
        "fitted_start"}}``.
    """
    cfg = exp.config
    devices = [exp.device.index or 0] if exp.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):  # a DataLoader's iterator draws its base seed
        if exp.val_loader is not None:
            batches, data = list(exp.val_loader), "validation"
        else:
            batches, used, data = [], 0, "training"
            for batch in exp.bn_loader:
                batches.append(batch)
                used += len(batch[1])
                if used >= HEALTH_EXAMPLES:
                    break
        mu, _, y = regression_moments(exp, samples, batches)
    mean, y = mu.double().mean(0), y.double()
    return {
        "regression": {
            "data": data,
            "examples": len(y),
            "rmse": float((mean - y).pow(2).mean().sqrt()),
            "target_std": float(y.std(correction=0)),
            "test_rmse": test_rmse,
            "fitted_start": cfg.model.pretrained is not None or (cfg.prior is not None and cfg.prior.init),
        }
    }


REGRESSION_KEYS = test_keys(Group.REGRESSION)
"""Metrics of a regression run's BMA on the test set (:func:`flatbma.regression.mixture_metrics`)."""


def metric_keys(record: Any) -> tuple[str, ...]:
    """The test metrics a run's record holds: :data:`REGRESSION_KEYS` for a regression's, else :data:`CLEAN_KEYS`."""
    return EVALUATIONS[likelihoods.recorded(record.get("likelihood") if isinstance(record, dict) else None)].keys


def regression_metrics(exp: Experiment, samples: list[Params]) -> dict[str, Any]:
    """The test-set mixture ``(1/M) Σ_m N(y; μ_m, σ_m²)`` of ``samples``: :func:`flatbma.regression.mixture_metrics`."""
    return mixture_metrics(*regression_moments(exp, samples, exp.test_loader))


def regression_moments(
    exp: Experiment, samples: list[Params], loader: Iterable[Batch]
) -> tuple[Tensor, Tensor, Tensor]:
    """Every sample's ``(μ_m, σ_m²)`` ``[M, N]`` on a whole loader and its targets ``[N]``, on the CPU.

    By the run's :class:`~flatbma.regression.Gaussian`, in the method's prediction mode; no gradients.
    """
    gaussian: Gaussian = exp.likelihood  # type: ignore[assignment]  # (EVALUATIONS' Gaussian row)
    mode = prediction_mode(exp.method, exp.config.seed)
    exp.model.eval()
    means, variances, targets = [], [], []
    with torch.no_grad(), forward_precision(exp), mode(exp.model) if mode is not None else nullcontext():
        for x, y in loader:
            mu, var = gaussian.moments(sample_outputs(exp.model, samples, x.to(exp.device)))
            means.append(mu.cpu())
            variances.append(var.cpu())
            targets.append(y)
    return torch.cat(means, dim=1), torch.cat(variances, dim=1), torch.cat(targets)


def evaluate_state(exp: Experiment, state: State, *, flatness: bool = False) -> dict[str, Any]:
    """BMA metrics of ``state`` on the test set (and flatness when asked), from the build's RNG state.

    ``health`` holds :func:`training_fit` (the caller adds the loss history, :func:`flatbma.health.assess`); a
    regression run records :func:`regression_metrics` instead.
    """
    return EVALUATIONS[kind(exp.likelihood)].state(exp, state, flatness)


def _regression_state(exp: Experiment, state: State, flatness: bool) -> dict[str, Any]:
    """:func:`evaluate_state` of a regression run."""
    if exp.config.eval.ood:
        raise FlatbmaError(
            "OOD detection (--ood, eval.ood) is not measured for a regression run (model.likelihood: gaussian) yet"
        )
    with exp.rng.restored():
        samples = with_bn_statistics(exp, draw_samples(exp, state))
        metrics: dict[str, Any] = {"likelihood": "gaussian", **regression_metrics(exp, samples)}
        metrics["health"] = regression_fit(exp, samples, test_rmse=metrics["rmse"])
        metrics["bn_statistics"] = bn_statistics(exp)
        metrics.update(diagnostics(exp, state))
        if flatness:
            metrics.update(flatness_metrics(exp, state, samples))
    return metrics


def _classifier_state(exp: Experiment, state: State, flatness: bool) -> dict[str, Any]:
    """:func:`evaluate_state` of a classifier."""
    what = f"{progress.count(exp.config.eval.num_samples, 'sample')} on the test set"
    with exp.rng.restored():
        with progress.current().phase("BMA", what):
            drawn = draw_samples(exp, state)
            samples = _samples_if_averaged(exp, drawn)
            predictions = bma_predictions(exp, state, drawn, samples)
            metrics = bma_metrics(exp, predictions)
        metrics["health"] = training_fit(exp, predictions, state)
        metrics["bn_statistics"] = bn_statistics(exp)
        metrics.update(diagnostics(exp, state))
        if exp.config.eval.ood is not None:
            metrics["ood"] = ood_record(exp, predictions)
        if flatness:
            samples = samples if samples is not None else with_bn_statistics(exp, drawn)
            metrics.update(flatness_metrics(exp, state, samples))
    return metrics


def _samples_if_averaged(exp: Experiment, drawn: list[Params]) -> list[Params] | None:
    """``drawn`` with recomputed statistics when the BMA averages them (``samples``), else ``None`` (made if asked)."""
    return with_bn_statistics(exp, drawn) if exp.method.can.predictive is Predictive.SAMPLES else None


def bma_log_probs_over(exp: Experiment, samples: Predictions, loader: Iterable[Batch]) -> tuple[Tensor, Tensor]:
    """BMA log-probabilities and labels of a whole (small) loader, e.g. the validation split, on the CPU."""
    outs, labels = [], []
    with forward_precision(exp):
        mode = prediction_mode(exp.method, exp.config.seed)
        for log_probs, y in predict(exp.model, samples, loader, device=exp.device, mode=mode):
            outs.append(log_probs.cpu())
            labels.append(y.cpu())
    return torch.cat(outs), torch.cat(labels)


def validation_metrics(exp: Experiment, state: State, n: int) -> dict[str, float]:
    """The BMA of ``n`` posterior samples of ``state`` on the validation split: ``nll``, ``loss``, ``accuracy``.

    ``nll = −mean log (1/n) Σ_m p(y|x, w_m)``, ``loss = −mean (1/n) Σ_m log p(y|x, w_m)``. Samples are drawn as for
    the test evaluation, from the build's RNG state (the caller's global RNG is left as it was); the model's
    train/eval mode is restored. Raises ``FlatbmaError`` without a validation split.
    """
    if exp.val_loader is None:
        raise FlatbmaError(
            "validation metrics need a validation split: set data.val_per_class, data.val_pool or data.val_fraction"
        )
    return EVALUATIONS[kind(exp.likelihood)].validation(exp, state, n)


def _classifier_validation(exp: Experiment, state: State, n: int | None) -> dict[str, float]:
    """:func:`validation_metrics` of a classifier."""
    training = exp.model.training
    try:
        with exp.rng.restored():
            samples = bma_predictions(exp, state, draw_samples(exp, state, n))
            per_sample = [bma_log_probs_over(exp, [s], exp.val_loader) for s in samples]
    finally:
        exp.model.train(training)
    labels = per_sample[0][1].to(torch.int64)[:, None]
    log_probs = torch.stack([lp for lp, _ in per_sample]).double()  # [n, N, C]
    bma = torch.logsumexp(log_probs, dim=0) - math.log(len(per_sample))
    return {
        "nll": float(-bma.gather(1, labels).mean()),
        "loss": float(-log_probs.gather(2, labels.expand(len(per_sample), -1, -1)).mean()),
        "accuracy": float((bma.argmax(1) == labels[:, 0]).double().mean()),
    }


def regression_validation(exp: Experiment, state: State, n: int | None = None) -> dict[str, float]:
    """The mixture of ``n`` posterior samples of ``state`` on the validation split: ``nll``, ``loss``, ``rmse``.

    As :func:`validation_metrics`, with ``nll = −mean log (1/n) Σ_m N(y; μ_m, σ_m²)``, ``loss = −mean (1/n) Σ_m
    log N(y; μ_m, σ_m²)`` and the RMSE of the mixture mean; ``n`` defaults to ``eval.num_samples``.
    """
    if exp.val_loader is None:
        raise FlatbmaError(
            "validation metrics need a validation split: set data.val_fraction (or data.val_per_class, data.val_pool)"
        )
    training = exp.model.training
    try:
        with exp.rng.restored():
            samples = with_bn_statistics(exp, draw_samples(exp, state, n))
            mu, var, y = regression_moments(exp, samples, exp.val_loader)
    finally:
        exp.model.train(training)
    mixture = mixture_metrics(mu, var, y)
    per_sample = normal_nll(mu.to(torch.float64), var.to(torch.float64), y.to(torch.float64))
    return {"nll": mixture["nll"], "loss": float(per_sample.mean()), "rmse": mixture["rmse"]}


def bma_curve_metrics(
    exp: Experiment,
    samples: Predictions,
    loader: Iterable[Batch],
    sizes: tuple[int, ...],
    *,
    temperature: float = 1.0,
    keep: list[tuple[Tensor, Tensor]] | None = None,
) -> tuple[dict[int, dict[str, float]], dict[str, list]]:
    """Metrics of the BMA of the first ``m`` samples for every ``m`` in ``sizes``, in one pass.

    ``temperature`` rescales every BMA predictive (``softmax(log p / T)``; 1 = none). ``keep``: see
    :func:`flatbma.predict.stream_metrics` (the full BMA's predictives, for :func:`rescaled`).

    Returns:
        ``({m: metrics}, reliability diagram of the full BMA)``.
    """
    with forward_precision(exp):
        states = stream_metrics(
            exp.model,
            samples,
            loader,
            num_classes=exp.num_classes,
            n_bins=exp.config.eval.n_bins,
            sizes=sizes,
            temperature=temperature,
            device=exp.device,
            mode=prediction_mode(exp.method, exp.config.seed),
            reduce_metrics=exp.strategy.reduce_metrics,
            keep=keep,
        )
    return {m: s.compute() for m, s in states.items()}, _reliability(states[len(samples)])


def rescaled(exp: Experiment, kept: list[tuple[Tensor, Tensor]], temperature: float) -> dict[str, float]:
    """Metrics of the kept full-BMA predictives (:func:`bma_curve_metrics`'s ``keep``) at ``temperature``."""
    return rescaled_metrics(
        kept,
        temperature,
        num_classes=exp.num_classes,
        n_bins=exp.config.eval.n_bins,
        reduce_metrics=exp.strategy.reduce_metrics,
    ).compute()


def _reliability(state: StreamingMetrics) -> dict[str, list]:
    """The reliability diagram as JSON lists (empty bins: ``None``)."""
    return {k: [None if v != v else float(v) for v in t.tolist()] for k, t in state.reliability().items()}


def corruption_metrics(
    exp: Experiment, samples: Predictions, names: tuple[str, ...], severities: tuple[int, ...]
) -> dict[str, dict[str, dict[str, float]]]:
    """BMA accuracy/NLL/ECE on each corrupted copy of the test set."""
    test = exp.test_loader.dataset
    channels = test.images.shape[1]
    out: dict[str, dict[str, dict[str, float]]] = {name: {} for name in names if applicable(name, channels)}
    sets = [(name, severity) for name in out for severity in severities]
    report = progress.current()
    what = f"{progress.count(len(sets), 'test set')}, {progress.count(len(samples), 'sample')}"
    with report.phase("corruptions", what) if sets else nullcontext():
        for name, severity in report.bar(sets, desc="corruptions", unit="set"):
            shifted = corrupt_dataset(test, name, severity, seed=exp.config.seed)
            loader = torch.utils.data.DataLoader(shifted, batch_size=exp.config.data.eval_batch_size)
            metrics, _ = bma_curve_metrics(exp, samples, loader, (len(samples),))
            m = metrics[len(samples)]
            out[name][str(severity)] = {k: m[k] for k in ("accuracy", "nll", "ece")}
    return out


def ood_record(exp: Experiment, predictions: Predictions) -> dict[str, Any]:
    """OOD detection by the BMA's uncertainty: the test set against ``eval.ood`` (:mod:`flatbma.ood`).

    Both whole sets on every process (the AUROC needs every score), under forked random generators: nothing
    measured after it changes.
    """
    name = exp.config.eval.ood
    test = exp.test_loader.dataset
    batch = exp.config.data.eval_batch_size
    devices = [exp.device.index or 0] if exp.device.type == "cuda" else []
    with progress.current().phase("OOD", f"the test set against {name}"), torch.random.fork_rng(devices=devices):
        shifted = ood_dataset(name, test, seed=exp.config.seed)
        options = dict(device=exp.device, mode=exp.method.predict_mode, precision=partial(forward_precision, exp))
        scores_in = uncertainty_scores(exp.model, predictions, torch.utils.data.DataLoader(test, batch), **options)
        scores_out = uncertainty_scores(exp.model, predictions, torch.utils.data.DataLoader(shifted, batch), **options)
    return ood_metrics(scores_in, scores_out, name=name, predictive=exp.method.can.predictive)


def landscape_metrics(exp: Experiment, samples: list[Params]) -> dict[str, list[float]]:
    """The training loss along one filter-normalized random direction: mean ± std over the distinct flatness samples."""
    names = _trained_names(exp)
    chosen = distinct_samples(samples[: exp.config.eval.flatness_samples])
    data = [(x.to(exp.device), y.to(exp.device)) for x, y in exp.hessian_loader]
    direction = random_direction(chosen[0], names, seed=exp.config.seed)
    alphas = torch.linspace(-1.0, 1.0, 21)
    mean, std = posterior_landscape(exp.model, data, chosen, direction, alphas, loss_fn=exp.likelihood)
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

    ``bma_curve``: numbers of samples ``m`` of the BMA curve; ``corruptions`` × ``severities``: the corrupted test
    sets; ``corruption_samples``: BMA samples on them (the first ones; ``None``: all); ``flatness``: measure Hessian
    spectra and distribution-level flatness; ``landscape``: record a 1-D loss landscape.
    """
    return EVALUATIONS[kind(exp.likelihood)].measure(
        exp,
        state,
        bma_curve=bma_curve,
        corruptions=corruptions,
        severities=severities,
        corruption_samples=corruption_samples,
        flatness=flatness,
        landscape=landscape,
    )


def _regression_measure(
    exp: Experiment, state: State, *, corruptions: tuple[str, ...], flatness: bool, landscape: bool, **_: Any
) -> dict[str, Any]:
    """:func:`measure` of a regression run: :func:`evaluate_state`'s metrics, no corruptions (tabular data)."""
    report = progress.current()
    if corruptions:
        raise FlatbmaError(CORRUPTIONS_NOT_TABULAR)
    start = time.perf_counter()
    result = evaluate_state(exp, state, flatness=flatness)
    result.update(temperature=None, corruptions={}, landscape=None)  # its health: evaluate_state's
    if landscape:
        with exp.rng.restored(), report.phase("landscape", "one random direction"):
            result["landscape"] = landscape_metrics(exp, with_bn_statistics(exp, draw_samples(exp, state)))
    result["eval_time_s"] = time.perf_counter() - start
    return result


def _classifier_measure(
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
    """:func:`measure` of a classifier."""
    report = progress.current()
    with exp.rng.restored():
        start = time.perf_counter()
        with report.phase("BMA", f"{progress.count(exp.config.eval.num_samples, 'sample')} on the test set"):
            drawn = draw_samples(exp, state)
            samples = _samples_if_averaged(exp, drawn)
            averaged = bma_predictions(exp, state, drawn, samples)
            kept: list[tuple[Tensor, Tensor]] = []  # the full BMA's test predictives, for temperature scaling
            curve, reliability = bma_curve_metrics(exp, averaged, exp.test_loader, bma_curve, keep=kept)
        full = curve[len(averaged)]
        result: dict[str, Any] = {k: full[k] for k in CLEAN_KEYS}
        result["health"] = training_fit(exp, averaged, state)  # completed by the caller with the loss history
        result["bma_curve"] = {
            "num_samples": list(curve),
            **{k: [curve[m][k] for m in curve] for k in ("accuracy", "nll", "ece")},
        }
        result["reliability"] = reliability
        result["bn_statistics"] = bn_statistics(exp)
        result.update(diagnostics(exp, state))
        result["temperature"] = None
        if exp.val_loader is not None:  # temperature scaling on the k-shot validation split, reported separately
            with report.phase("temperature", "fitted on the validation split, applied to the test predictives"):
                val_log_probs, val_labels = bma_log_probs_over(exp, averaged, exp.val_loader)
                t = fit_temperature(val_log_probs, val_labels)
                scaled = rescaled(exp, kept, t)
            result["temperature"] = t
            result["temperature_scaled"] = {k: scaled[k] for k in CLEAN_KEYS}
        del kept
        shifted = averaged[:corruption_samples] if corruption_samples else averaged
        result["corruptions"] = corruption_metrics(exp, shifted, corruptions, severities)
        result["corruption_samples"] = len(shifted)
        if exp.config.eval.ood is not None:
            result["ood"] = ood_record(exp, averaged)
        if (flatness or landscape) and samples is None:
            samples = with_bn_statistics(exp, drawn)
        if flatness:
            result.update(flatness_metrics(exp, state, samples))
        result["landscape"] = None
        if landscape:
            with report.phase("landscape", "one random direction"):
                result["landscape"] = landscape_metrics(exp, samples)
        result["eval_time_s"] = time.perf_counter() - start
    return result


def _classifier_validation_nll(exp: Experiment, state: State) -> float:
    """The BMA's NLL ``−mean log p̄(y|x)`` on the validation split (:func:`validation_nll`'s, a classifier's)."""
    with exp.rng.restored():
        averaged = bma_predictions(exp, state, draw_samples(exp, state))
        log_probs, labels = bma_log_probs_over(exp, averaged, exp.val_loader)  # type: ignore[arg-type]
    return float(-log_probs.gather(1, labels[:, None].to(torch.int64)).mean())


def validation_nll(exp: Experiment, state: State) -> float:
    """The validation NLL of the BMA of ``state``, from the build's RNG state: what a comparison chooses by.

    Samples are drawn as for the test evaluation and averaged by the method's predictive (:func:`bma_predictions`);
    a regression run is scored by its mixture NLL ``−(1/N) Σᵢ log (1/M) Σ_m N(yᵢ; μ_m(xᵢ), σ_m²(xᵢ))``.
    """
    return EVALUATIONS[kind(exp.likelihood)].validation_nll(exp, state)


@dataclass(frozen=True)
class Evaluation:
    """How a run of one likelihood is evaluated (a row of :data:`EVALUATIONS`).

    ``state``, ``validation``, ``validation_nll`` and ``measure`` implement :func:`evaluate_state`,
    :func:`validation_metrics`, :func:`validation_nll` and :func:`measure`; ``keys``: the test metrics a run's record
    holds (:func:`metric_keys`).
    """

    state: Callable[[Experiment, State, bool], dict[str, Any]]
    validation: Callable[[Experiment, State, int | None], dict[str, float]]
    validation_nll: Callable[[Experiment, State], float]
    measure: Callable[..., dict[str, Any]]
    keys: tuple[str, ...]


EVALUATIONS: dict[Likelihood, Evaluation] = {
    Likelihood.CATEGORICAL: Evaluation(
        _classifier_state, _classifier_validation, _classifier_validation_nll, _classifier_measure, CLEAN_KEYS
    ),
    Likelihood.GAUSSIAN: Evaluation(
        _regression_state,
        regression_validation,
        lambda exp, state: regression_validation(exp, state)["nll"],
        _regression_measure,
        REGRESSION_KEYS,
    ),
}
"""The evaluation's rows of the likelihood dispatch (:mod:`flatbma.likelihood`), one per :class:`Likelihood`."""
