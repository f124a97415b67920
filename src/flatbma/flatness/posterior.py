"""Flatness of a posterior: per-sample Hessian spectra, distribution-level measures, and their protocol.

* :func:`sample_spectra` — ``λ_1 … λ_k`` of ``∇²L_S(w_m)`` for each sample ``w_m ~ q``;
* :func:`distribution_spectrum` — the top eigenvalues of the *averaged Hessian*
  ``∇²_μ (1/S) Σ_m L_S(μ + ξ_m) = (1/S) Σ_m ∇²L_S(w_m)`` (noise held fixed), whose λ₁ is at most the average
  per-sample λ₁ (docs/methods.md §8.4);
* :func:`sam_sharpness` — ``L_S(w + ρ g/‖g‖) − L_S(w)``, ``g = ∇L_S(w)``, per sample (Foret et al., ICLR 2021).

:func:`flatness_report` is the protocol, the same for every method (docs/methods.md §8.5): every eigenvalue from
Lanczos to a residual tolerance, an unconverged one reported and never averaged; per-sample λ₁ summarized by mean,
median and a bootstrap interval; distinct samples only. :func:`repeatability` compares two measurements.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call

from flatbma import progress
from flatbma.bn import eval_mode
from flatbma.errors import FlatbmaError
from flatbma.flatness.hutchinson import TraceEstimate, hutchinson_trace
from flatbma.flatness.hvp import HessianOperator, LossFn, _unpack, hvp_fn, nonzero_checked
from flatbma.flatness.lanczos import EigenResult, default_basis_size, hessian_eigenvalues, lanczos
from flatbma.rng import derive_seed, seeded_generator
from flatbma.stats import Summary, summarize
from flatbma.types import Batch

__all__ = [
    "HEAVY_TAIL_FACTOR",
    "SampleFlatness",
    "SpectrumOptions",
    "distinct_samples",
    "distribution_spectrum",
    "flatness_report",
    "lambda1_summary",
    "measure_samples",
    "repeatability",
    "repeatable",
    "sam_sharpness",
    "sample_spectra",
]

_MEAN_STREAM = -1
"""Stream of the measurement seed that seeds λ₁ at the posterior mean (samples use streams ``0, 1, …``)."""
_DISTRIBUTION_STREAM = -2
"""Stream of the measurement seed for the averaged Hessian's Lanczos start vector."""


@dataclass(frozen=True)
class SpectrumOptions:
    """The keywords every flatness entry point takes to measure a spectrum; the defaults are the protocol's.

    Attributes:
        k: eigenvalues per spectrum.
        params: the parameters of the Hessian (the Bayesian subset; ``None``: every trainable one).
        loss_fn: mean loss ``loss_fn(logits, y)``; cross-entropy when ``None``.
        tol: relative residual tolerance of every eigenvalue (Lanczos).
        max_iter: Hessian-vector products per spectrum at most.
    """

    k: int = 1
    params: Sequence[str] | None = None
    loss_fn: LossFn | None = None
    tol: float = 1e-3
    max_iter: int = 100


def _operator(
    options: SpectrumOptions, model: nn.Module, data: list[Batch], weights: Mapping[str, Tensor]
) -> HessianOperator:
    return hvp_fn(model, data, loss_fn=options.loss_fn, params=options.params, weights=weights)


def _top_eigen(
    options: SpectrumOptions,
    matvec: Callable[[Tensor], Tensor],
    op: HessianOperator,
    *,
    generator: torch.Generator,
    warn: bool,
    dtype: torch.dtype,
) -> EigenResult:
    """The top ``k`` eigenvalues of ``matvec`` (an operator of ``op``'s size) by bounded-basis Lanczos to ``tol``."""
    return lanczos(
        matvec,
        op.dim,
        options.k,
        tol=options.tol,
        max_iter=options.max_iter,
        eps=op.eps,
        generator=generator,
        device=op.device,
        dtype=dtype,
        warn=warn,
        basis_size=default_basis_size(options.k),
        vectors=False,
    )


def _check_samples(samples: Sequence[Mapping[str, Tensor]]) -> None:
    if not samples:
        raise FlatbmaError("flatness needs at least one posterior sample (eval.flatness_samples >= 1)")


def distinct_samples(samples: Sequence[Mapping[str, Tensor]]) -> list[Mapping[str, Tensor]]:
    """``samples`` without repeats of the same weights (the same tensor objects), in order."""
    seen: dict[tuple[int, ...], Mapping[str, Tensor]] = {}
    for w in samples:
        seen.setdefault(tuple(id(v) for v in w.values()), w)
    return list(seen.values())


def sample_spectra(
    model: nn.Module,
    samples: Sequence[Mapping[str, Tensor]],
    data: Iterable[Batch],
    *,
    k: int = 5,
    params: Sequence[str] | None = None,
    loss_fn: LossFn | None = None,
    tol: float = 1e-4,
    max_iter: int = 100,
    seed: int = 0,
) -> Tensor:
    """Top-``k`` Hessian eigenvalues of every sample: a ``[S, k]`` float64 tensor (rows descending)."""
    _check_samples(samples)
    return torch.stack(
        [
            hessian_eigenvalues(
                model, data, k, loss_fn=loss_fn, params=params, weights=w, tol=tol, max_iter=max_iter, seed=seed
            )
            for w in samples
        ]
    )


@dataclass(frozen=True)
class SampleFlatness:
    """The Hessian measurements of one weight sample (:func:`measure_samples`).

    Attributes:
        eigen: its top-``k`` eigenpairs with their convergence flags.
        trace: Hutchinson's estimate of ``tr ∇²L_S(w)`` (``None`` when not asked).
        products: Hessian-vector products spent on this sample.
    """

    eigen: EigenResult
    trace: TraceEstimate | None
    products: int


def measure_samples(
    model: nn.Module,
    samples: Sequence[Mapping[str, Tensor]],
    data: Iterable[Batch],
    *,
    k: int = 1,
    params: Sequence[str] | None = None,
    loss_fn: LossFn | None = None,
    tol: float = 1e-3,
    max_iter: int = 100,
    seed: int = 0,
    trace_probes: int = 0,
) -> list[SampleFlatness]:
    """Top-``k`` eigenpairs (Lanczos to ``tol``) and, with ``trace_probes ≥ 2``, Hutchinson's trace of every sample.

    One Hessian operator per sample serves both. Sample ``i`` draws its Lanczos start vector and its probes from
    streams ``2i`` and ``2i + 1`` of ``seed``, so a sample's measurement does not depend on the others.
    """
    options = SpectrumOptions(k=k, params=params, loss_fn=loss_fn, tol=tol, max_iter=max_iter)
    return _measure(model, samples, list(data), options, seed=seed, trace_probes=trace_probes)


def _measure(
    model: nn.Module,
    samples: Sequence[Mapping[str, Tensor]],
    data: list[Batch],
    options: SpectrumOptions,
    *,
    seed: int,
    trace_probes: int = 0,
) -> list[SampleFlatness]:
    _check_samples(samples)
    out = []
    for i, w in enumerate(progress.current().bar(samples, desc="Hessian spectra", unit="sample")):
        op = _operator(options, model, data, w)
        matvec = nonzero_checked(op)
        eigen = _top_eigen(options, matvec, op, generator=seeded_generator(seed, 2 * i), warn=False, dtype=op.dtype)
        trace = None
        if trace_probes:
            trace = hutchinson_trace(
                matvec, op.dim, num_samples=trace_probes, generator=seeded_generator(seed, 2 * i + 1), device=op.device
            )
        out.append(SampleFlatness(eigen, trace, op.num_products))
    return out


def _distribution_eigen(
    model: nn.Module,
    samples: Sequence[Mapping[str, Tensor]],
    data: list[Batch],
    options: SpectrumOptions,
    *,
    generator: torch.Generator,
    warn: bool,
) -> EigenResult:
    ops: list[HessianOperator] = [_operator(options, model, data, w) for w in samples]
    products = [nonzero_checked(op) for op in ops]

    def matvec(v: Tensor) -> Tensor:
        return sum(p(v) for p in products) / len(products)

    # the basis in float64, lanczos's default (the per-sample spectra use the parameters' dtype)
    return _top_eigen(options, matvec, ops[0], generator=generator, warn=warn, dtype=torch.float64)


def distribution_spectrum(
    model: nn.Module,
    samples: Sequence[Mapping[str, Tensor]],
    data: Iterable[Batch],
    *,
    k: int = 5,
    params: Sequence[str] | None = None,
    loss_fn: LossFn | None = None,
    tol: float = 1e-4,
    max_iter: int = 100,
    seed: int = 0,
) -> Tensor:
    """Top-``k`` eigenvalues of ``∇²_μ E_q[L_S] = (1/S) Σ_m ∇²L_S(w_m)`` (fixed noise), descending."""
    _check_samples(samples)
    options = SpectrumOptions(k=k, params=params, loss_fn=loss_fn, tol=tol, max_iter=max_iter)
    result = _distribution_eigen(
        model, samples, list(data), options, generator=torch.Generator().manual_seed(seed), warn=True
    )
    return result.eigenvalues


def _loss_and_grad(
    model: nn.Module, weights: Mapping[str, Tensor], names: Sequence[str], data: list[Batch], loss_fn: LossFn
) -> tuple[float, list[Tensor]]:
    leaves = {k: weights[k].detach().requires_grad_(True) for k in names}
    n = sum(len(y) for _, y in data)
    total = 0.0
    grads = [torch.zeros_like(v) for v in leaves.values()]
    for x, y in data:
        loss = loss_fn(functional_call(model, {**weights, **leaves}, (x,)), y) * (len(y) / n)
        for g, d in zip(grads, torch.autograd.grad(loss, list(leaves.values()))):
            g += d
        total += float(loss.detach())
    return total, grads


@torch.no_grad()
def _loss(model: nn.Module, weights: Mapping[str, Tensor], data: list[Batch], loss_fn: LossFn) -> float:
    n = sum(len(y) for _, y in data)
    return sum(float(loss_fn(functional_call(model, dict(weights), (x,)), y)) * len(y) / n for x, y in data)


def sam_sharpness(
    model: nn.Module,
    samples: Sequence[Mapping[str, Tensor]],
    data: Iterable[Batch],
    *,
    rho: float = 0.05,
    params: Sequence[str] | None = None,
    loss_fn: LossFn | None = None,
) -> Tensor:
    """``L_S(w + ρ g/‖g‖) − L_S(w)`` with ``g = ∇L_S(w)`` for every sample (a ``[S]`` float64 tensor)."""
    _check_samples(samples)
    if not rho > 0:
        raise FlatbmaError(f"the sharpness radius rho must be > 0, got {rho!r}")
    loss_fn = loss_fn or F.cross_entropy
    names = list(params) if params is not None else [n for n, p in model.named_parameters() if p.requires_grad]
    batches = [_unpack(batch) for batch in data]  # pairs (x, y) or dicts, as the Hessian reads them
    if not batches:
        raise FlatbmaError("sharpness needs training data, but the data is empty")
    out = []
    with eval_mode(model):
        for w in samples:
            full = {**dict(model.named_parameters()), **dict(model.named_buffers()), **w}
            base, grads = _loss_and_grad(model, full, names, batches, loss_fn)
            norm = math.sqrt(sum(float((g * g).sum()) for g in grads)) + 1e-12
            moved = dict(full)
            for name, g in zip(names, grads):
                moved[name] = full[name].detach() + rho * g / norm
            out.append(_loss(model, moved, batches, loss_fn) - base)
    return torch.tensor(out, dtype=torch.float64)


# ---------------------------------------------------------------------------------------------------
# the protocol


def _same_weights(a: Mapping[str, Tensor], b: Mapping[str, Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[k] is b[k] or torch.equal(a[k], b[k]) for k in a)


def _unconverged_messages(label: str, result: EigenResult, options: SpectrumOptions) -> list[str]:
    tol, max_iter = options.tol, options.max_iter
    rel = result.residuals / result.eigenvalues.abs().clamp_min(torch.finfo(torch.float64).tiny)
    return [
        f"{label}: λ{j + 1} ≈ {float(result.eigenvalues[j]):.6g} has relative residual {float(rel[j]):.1e} > "
        f"tol {tol:g} after {result.num_matvecs} Hessian-vector products (cap: max_iter={max_iter})"
        for j in range(len(result.eigenvalues))
        if not bool(result.converged_each[j])
    ]


def _summary(values: Sequence[float], *, level: float, seed: int) -> Summary | None:
    """Mean, median and the seeded bootstrap interval of ``values`` (``None`` when there are none)."""
    return summarize(values, level=level, method="bootstrap", seed=seed) if values else None


def lambda1_summary(
    measured: Sequence[SampleFlatness], *, level: float = 0.95, seed: int = 0
) -> tuple[Summary | None, list[float]]:
    """The summary of the converged per-sample λ₁ and the list of the unconverged ones."""
    converged = [float(m.eigen.eigenvalues[0]) for m in measured if bool(m.eigen.converged_each[0])]
    unconverged = [float(m.eigen.eigenvalues[0]) for m in measured if not bool(m.eigen.converged_each[0])]
    return _summary(converged, level=level, seed=seed), unconverged


def flatness_report(
    model: nn.Module,
    samples: Sequence[Mapping[str, Tensor]],
    data: Iterable[Batch],
    *,
    mean: Mapping[str, Tensor] | None = None,
    k: int = 1,
    params: Sequence[str] | None = None,
    loss_fn: LossFn | None = None,
    rho: float = 0.05,
    tol: float = 1e-3,
    max_iter: int = 100,
    seed: int = 0,
    trace_probes: int = 0,
    distribution: bool = True,
    level: float = 0.95,
) -> dict[str, Any]:
    """The flatness protocol (module docstring) of a posterior's samples, as JSON-ready values.

    Args:
        model: the network (called with each sample's weights and buffers).
        samples: posterior samples (weights and buffers by module name); repeats are measured once.
        data: the training batches the Hessian is taken over (un-augmented).
        mean: the weights at the posterior mean, for ``lambda1_at_mean`` (``None``: not measured).
        k: eigenvalues per spectrum (``k > 1`` adds ``λ₁/λ_k``).
        params: the parameters of the Hessian (the Bayesian subset; ``None``: every trainable one).
        loss_fn: mean loss ``loss_fn(logits, y)``; cross-entropy when ``None``.
        rho: radius of the SAM sharpness.
        tol: relative residual tolerance of every eigenvalue.
        max_iter: Hessian-vector products per spectrum at most.
        seed: measurement seed (Lanczos start vectors, Hutchinson probes, bootstrap resamples).
        trace_probes: Hutchinson probes per sample (``0``: no trace).
        distribution: also compute the spectrum of the averaged Hessian.
        level: confidence level of the intervals.

    Returns:
        ``lambda1`` (mean of the converged per-sample λ₁, ``None`` if none converged), ``lambda1_std``,
        ``lambda1_summary`` (:meth:`flatbma.stats.Summary.to_dict`), ``lambda1_unconverged``,
        ``hessian_top_eigenvalues`` / ``hessian_eigenvalue_converged`` (``[S][k]``), with ``k > 1``
        ``lambda1_over_lambda{k}`` and its std over the samples whose λ₁ and λ_k both converged,
        ``lambda1_at_mean`` / ``lambda1_at_mean_converged``, ``distribution_top_eigenvalues`` /
        ``distribution_converged`` / ``distribution_lambda1`` (``None`` unless converged), ``hessian_trace``
        (a summary over samples, or over one sample's probes), ``sam_sharpness`` / ``sam_sharpness_std``,
        ``flatness_samples`` (distinct samples), ``hessian_products``, ``hessian_converged`` and
        ``hessian_warnings`` (one line per unconverged eigenvalue).
    """
    _check_samples(samples)
    data = list(data)
    chosen = distinct_samples(samples)
    options = SpectrumOptions(k=k, params=params, loss_fn=loss_fn, tol=tol, max_iter=max_iter)
    measured = _measure(model, chosen, data, options, seed=seed, trace_probes=trace_probes)
    warnings_ = [
        line for i, m in enumerate(measured) for line in _unconverged_messages(f"sample {i}", m.eigen, options)
    ]
    products = sum(m.products for m in measured)
    summary, unconverged = lambda1_summary(measured, level=level, seed=seed)
    report: dict[str, Any] = {
        "hessian_top_eigenvalues": [m.eigen.eigenvalues.tolist() for m in measured],
        "hessian_eigenvalue_converged": [m.eigen.converged_each.tolist() for m in measured],
        "lambda1": summary.mean if summary else None,
        "lambda1_std": (summary.std or 0.0) if summary else None,
        "lambda1_summary": summary.to_dict() if summary else None,
        "lambda1_unconverged": unconverged,
    }
    if k > 1:
        ratios = [
            float(m.eigen.eigenvalues[0] / m.eigen.eigenvalues[-1])
            for m in measured
            if bool(m.eigen.converged_each[0]) and bool(m.eigen.converged_each[-1])
        ]
        spread = float(torch.tensor(ratios, dtype=torch.float64).std()) if len(ratios) > 1 else None
        report[f"lambda1_over_lambda{k}"] = sum(ratios) / len(ratios) if ratios else None
        report[f"lambda1_over_lambda{k}_std"] = spread

    if mean is not None:
        if len(chosen) == 1 and _same_weights(mean, chosen[0]):
            at_mean = measured[0].eigen  # a point: its mean is its sample
        else:
            (m,) = _measure(model, [mean], data, options, seed=derive_seed(seed, _MEAN_STREAM))
            at_mean, products = m.eigen, products + m.products
            warnings_ += _unconverged_messages("posterior mean", at_mean, options)
        report["lambda1_at_mean"] = float(at_mean.eigenvalues[0]) if bool(at_mean.converged_each[0]) else None
        report["lambda1_at_mean_converged"] = bool(at_mean.converged_each[0])
        if not report["lambda1_at_mean_converged"]:
            report["lambda1_at_mean_unconverged"] = float(at_mean.eigenvalues[0])

    if distribution:
        if len(chosen) == 1:
            dist = measured[0].eigen
        else:
            generator = seeded_generator(seed, _DISTRIBUTION_STREAM)
            dist = _distribution_eigen(model, chosen, data, options, generator=generator, warn=False)
            products += dist.num_matvecs * len(chosen)
            warnings_ += _unconverged_messages("averaged Hessian", dist, options)
        report["distribution_top_eigenvalues"] = dist.eigenvalues.tolist()
        report["distribution_converged"] = dist.converged_each.tolist()
        report["distribution_lambda1"] = float(dist.eigenvalues[0]) if bool(dist.converged_each[0]) else None

    if trace_probes:
        if len(measured) == 1:  # one sample: its probes are the independent estimates
            values = measured[0].trace.samples.tolist()
        else:
            values = [m.trace.trace for m in measured]
        report["hessian_trace"] = {**_summary(values, level=level, seed=seed).to_dict(), "probes": trace_probes}

    sharp = sam_sharpness(model, chosen, data, rho=rho, params=options.params, loss_fn=options.loss_fn)
    report["sam_sharpness"] = float(sharp.mean())
    report["sam_sharpness_std"] = float(sharp.std(unbiased=True)) if len(sharp) > 1 else 0.0
    report["flatness_samples"] = len(chosen)
    report["hessian_products"] = products
    report["hessian_converged"] = not warnings_
    report["hessian_warnings"] = warnings_
    return report


def repeatability(
    first: Summary | Mapping[str, Any] | None, second: Summary | Mapping[str, Any] | None, *, tol: float
) -> dict[str, Any]:
    """Whether two measurements of the same posterior's λ₁ agree within their reported intervals.

    ``first`` and ``second`` are :class:`~flatbma.stats.Summary` objects or their ``to_dict`` forms, with means
    ``m₁, m₂``; with ``h₁``, ``h₂`` the half-widths of their intervals on the facing sides, they **agree** when
    ``|m₁ − m₂| ≤ √(h₁² + h₂²)`` (docs/methods.md §8.7). Also reported: ``means_in_other_interval``
    (``|m₁ − m₂| ≤ min(h₁, h₂)``) and ``intervals_overlap``. Without intervals (one distinct sample) the values
    agree when they differ by at most ``2·tol`` relatively; no converged λ₁ agrees with nothing.

    The measurement is **repeatable** (:func:`repeatable`) when the means agree *and* the two means, and the two
    medians, lie within :data:`HEAVY_TAIL_FACTOR` of each other (``mean_ratio``, ``median_ratio``: larger
    magnitude over smaller, ``inf`` across signs or zero), since a heavy-tailed λ₁ has wide intervals.

    Returns:
        ``{"first", "second" (the summaries), "agree", "means_in_other_interval", "intervals_overlap",
        "mean_ratio", "median_ratio", "repeatable"}`` (``means_in_other_interval`` and
        ``intervals_overlap`` ``None`` without intervals, a ratio ``None`` without its two values).
    """
    a = first.to_dict() if isinstance(first, Summary) else first
    b = second.to_dict() if isinstance(second, Summary) else second
    out: dict[str, Any] = {
        "first": a,
        "second": b,
        "agree": False,
        "means_in_other_interval": None,
        "intervals_overlap": None,
    }
    if a is None or b is None:
        out.update(mean_ratio=None, median_ratio=None, repeatable=False)
        return out
    ia, ib = a.get("interval"), b.get("interval")
    if ia is None or ib is None:
        out["agree"] = abs(a["mean"] - b["mean"]) <= 2 * tol * max(abs(a["mean"]), abs(b["mean"]))
    else:
        low, high, low_i, high_i = (a, b, ia, ib) if a["mean"] <= b["mean"] else (b, a, ib, ia)
        reach = math.hypot(low_i["high"] - low["mean"], high["mean"] - high_i["low"])
        out["agree"] = high["mean"] - low["mean"] <= reach
        out["means_in_other_interval"] = ia["low"] <= b["mean"] <= ia["high"] and ib["low"] <= a["mean"] <= ib["high"]
        out["intervals_overlap"] = ia["low"] <= ib["high"] and ib["low"] <= ia["high"]
    out["mean_ratio"] = _ratio(a.get("mean"), b.get("mean"))
    out["median_ratio"] = _ratio(a.get("median"), b.get("median"))
    out["repeatable"] = repeatable(out)
    return out


HEAVY_TAIL_FACTOR = 2.0
"""Two measurements of one posterior's λ₁ whose means (or medians) differ by more than this factor are not
repeatable, whatever their intervals say."""


def _ratio(x: Any, y: Any) -> float | None:
    """``max(|x|, |y|) / min(|x|, |y|)`` of two numbers of one sign (1 when equal, ``inf`` across signs or 0)."""
    if not (isinstance(x, (int, float)) and isinstance(y, (int, float))) or isinstance(x, bool) or isinstance(y, bool):
        return None
    if not (math.isfinite(x) and math.isfinite(y)):
        return None
    if x == y:
        return 1.0
    if x * y <= 0:
        return math.inf
    return max(abs(x), abs(y)) / min(abs(x), abs(y))


def repeatable(record: Mapping[str, Any]) -> bool | None:
    """Whether a repeated λ₁ measurement (:func:`repeatability`'s record) is repeatable.

    ``agree`` and both means, and both medians where recorded, within :data:`HEAVY_TAIL_FACTOR` of each other
    (ratios computed from ``first`` and ``second``); ``None`` when the record has no boolean ``agree``.
    """
    agree = record.get("agree")
    if not isinstance(agree, bool):
        return None
    first, second = record.get("first"), record.get("second")
    first = first if isinstance(first, Mapping) else {}
    second = second if isinstance(second, Mapping) else {}
    ratios = [_ratio(first.get(k), second.get(k)) for k in ("mean", "median")]
    return agree and all(r is None or r <= HEAVY_TAIL_FACTOR for r in ratios)
