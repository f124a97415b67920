"""Flatness of a posterior: per-sample Hessian spectra and distribution-level measures.

The seed papers measure the flatness of a posterior by the top Hessian eigenvalues of sampled models
(λ₁ and λ₁/λ₅, averaged over samples). Reviewers asked whether an average of per-sample eigenvalues
measures the flatness of a *distribution*; flatbma reports both:

* :func:`sample_spectra` — ``λ_1 … λ_k`` of ``∇²L_S(w_m)`` for each sample ``w_m ~ q``;
* :func:`distribution_spectrum` — the top eigenvalues of the Hessian of the expected loss
  ``E_q[L_S(w)]`` with respect to the posterior's location. For samples ``w_m = μ + ξ_m`` with
  the noise ``ξ_m`` held fixed (the reparameterization), ``∇²_μ (1/S) Σ_m L_S(μ + ξ_m)
  = (1/S) Σ_m ∇²L_S(w_m)``: the eigenvalues of the *averaged Hessian*, which are at most the
  average of the per-sample top eigenvalues (λ₁ is convex in the matrix), with equality only when
  the samples' sharp directions align;
* :func:`sam_sharpness` — ``E_w[max_{‖ε‖≤ρ} L_S(w+ε) − L_S(w)]`` with the first-order maximizer
  ``ε = ρ ∇L_S(w)/‖∇L_S(w)‖`` (Foret et al. 2021), averaged over samples.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call

from flatbma.errors import FlatbmaError
from flatbma.flatness.hvp import HessianOperator, LossFn, hvp_fn, nonzero_checked
from flatbma.flatness.lanczos import hessian_eigenvalues, lanczos
from flatbma.predict import eval_mode
from flatbma.types import Batch

__all__ = ["distribution_spectrum", "flatness_report", "sam_sharpness", "sample_spectra"]


def _check_samples(samples: Sequence[Mapping[str, Tensor]]) -> None:
    if not samples:
        raise FlatbmaError("flatness needs at least one posterior sample (eval.flatness_samples >= 1)")


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
    ops: list[HessianOperator] = [hvp_fn(model, data, loss_fn=loss_fn, params=params, weights=w) for w in samples]
    products = [nonzero_checked(op) for op in ops]

    def matvec(v: Tensor) -> Tensor:
        return sum(p(v) for p in products) / len(products)

    result = lanczos(
        matvec,
        ops[0].dim,
        k,
        tol=tol,
        max_iter=max_iter,
        eps=ops[0].eps,
        generator=torch.Generator().manual_seed(seed),
        device=ops[0].device,
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
    batches = list(data)
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


def flatness_report(
    model: nn.Module,
    samples: Sequence[Mapping[str, Tensor]],
    data: Iterable[Batch],
    *,
    k: int = 5,
    params: Sequence[str] | None = None,
    loss_fn: LossFn | None = None,
    rho: float = 0.05,
    tol: float = 1e-4,
    max_iter: int = 100,
    seed: int = 0,
) -> dict[str, object]:
    """All flatness measures of a posterior as JSON-ready values.

    Keys: ``hessian_top_eigenvalues`` (``[S][k]``), ``lambda1`` / ``lambda1_std`` (mean ± std over
    samples), ``lambda1_over_lambdak`` / its std with ``k`` (``lambda1_over_lambda5`` when ``k = 5``),
    ``distribution_top_eigenvalues`` (the averaged Hessian), ``distribution_lambda1``,
    ``sam_sharpness`` / ``sam_sharpness_std`` and ``flatness_samples``. With a single sample the
    distribution spectrum is that sample's spectrum.
    """
    data = list(data)
    opts = dict(k=k, params=params, loss_fn=loss_fn, tol=tol, max_iter=max_iter, seed=seed)
    spectra = sample_spectra(model, samples, data, **opts)
    lam1 = spectra[:, 0]
    ratio = spectra[:, 0] / spectra[:, -1]
    # with one sample (a point estimate) the averaged Hessian is that sample's: not computed twice
    dist = spectra[0] if len(samples) == 1 else distribution_spectrum(model, samples, data, **opts)
    sharp = sam_sharpness(model, samples, data, rho=rho, params=params, loss_fn=loss_fn)

    def std(x: Tensor) -> float:
        return float(x.std(unbiased=True)) if len(x) > 1 else 0.0

    return {
        "hessian_top_eigenvalues": spectra.tolist(),
        "lambda1": float(lam1.mean()),
        "lambda1_std": std(lam1),
        f"lambda1_over_lambda{k}": float(ratio.mean()),
        f"lambda1_over_lambda{k}_std": std(ratio),
        "distribution_top_eigenvalues": dist.tolist(),
        "distribution_lambda1": float(dist[0]),
        "sam_sharpness": float(sharp.mean()),
        "sam_sharpness_std": std(sharp),
        "flatness_samples": len(samples),
    }
