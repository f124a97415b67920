"""Loss landscapes: the training loss along one or two directions through a point or a posterior.

For weights ``w``, directions ``d₁, d₂`` and the mean training loss ``L_S`` (batch losses weighted by
batch size, as in :func:`~flatbma.flatness.hvp_fn`),

    1-D:  f(α) = L_S(w + α d₁),        2-D:  f(α, β) = L_S(w + α d₁ + β d₂),

evaluated in eval mode (BatchNorm on the running statistics, unchanged along the direction). For a posterior, every
sample ``w_m`` moves along the *same* direction, reported as mean ± standard deviation over samples. Directions:

* :func:`random_direction` — a Gaussian direction, *filter-normalized* (Li et al., "Visualizing the Loss Landscape
  of Neural Nets", NeurIPS 2018), which removes the scale invariance of ReLU/BatchNorm networks from the plot.
* :func:`top_eigen_direction` — the unit eigenvector of the largest Hessian eigenvalue ``λ₁``, along which
  ``f(α) ≈ L_S(w) + α gᵀv + ½ λ₁ α²``.

:mod:`flatbma.plotting` draws the values.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from enum import Enum
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call

from flatbma import progress
from flatbma.bn import eval_mode
from flatbma.checks import check_finite_vector, parse_choice
from flatbma.errors import FlatbmaError, suggest
from flatbma.flatness.hvp import (
    HVPMethod,
    LossFn,
    ParamSelection,
    _reiterable,
    _unpack,
    hvp_fn,
    nonzero_checked,
)
from flatbma.flatness.lanczos import default_basis_size, lanczos
from flatbma.types import Batch, Params

__all__ = [
    "BiasBNPolicy",
    "EigenDirection",
    "LandscapeBand",
    "loss_along",
    "loss_along_samples",
    "loss_surface",
    "posterior_landscape",
    "random_direction",
    "top_eigen_direction",
]

_NORM_EPS = 1e-10  # as in Li et al.'s code: d · ‖w‖ / (‖d‖ + 1e-10)


class BiasBNPolicy(str, Enum):
    """What a filter-normalized direction holds for one-dimensional tensors (biases, BatchNorm).

    ``ZERO``: nothing (the paper's plots, ``ignore='biasbn'`` in its code); ``WEIGHTS``: ``d = w``, so moving
    along ``d`` rescales them.
    """

    ZERO = "zero"
    WEIGHTS = "weights"


class EigenDirection(NamedTuple):
    """The top Hessian eigenpair as a direction.

    Attributes:
        eigenvalue: ``λ₁`` of ``∇²L_S(w)``.
        direction: the unit eigenvector ``v`` (``Σ_k ‖v_k‖² = 1``) by parameter name, signed so that
            its entry of largest magnitude is positive.
    """

    eigenvalue: float
    direction: Params


class LandscapeBand(NamedTuple):
    """Mean and standard deviation (unbiased; 0 for one sample) of the loss curves of the samples."""

    mean: Tensor
    std: Tensor


# --------------------------------------------------------------------------------------------------
# directions


def random_direction(
    point: nn.Module | Mapping[str, Tensor],
    params: Sequence[str] | None = None,
    *,
    seed: int = 0,
    filter_normalized: bool = True,
    bias_bn: BiasBNPolicy | str = BiasBNPolicy.ZERO,
) -> Params:
    """A random direction ``d ~ N(0, I)`` in the space of the chosen parameters, filter-normalized.

    With ``filter_normalized``, every filter ``i`` of a tensor with two or more dimensions is rescaled,
    ``d[i] ← d[i] · ‖w[i]‖ / (‖d[i]‖ + 1e-10)``, and one-dimensional tensors follow ``bias_bn``.

    Args:
        point: the weights the direction is normalized to: a module (its parameters) or a tensor dict such as a
            posterior sample; a sample also holds buffers, so name the parameters with ``params``.
        params: names of the tensors of ``point`` to include; ``None``: a module's trainable parameters, a dict's
            floating-point tensors.
        seed: seeds the CPU generator that draws ``d``, so the direction is the same on every device.
        filter_normalized: apply filter normalization.
        bias_bn: :class:`BiasBNPolicy` for one-dimensional tensors under filter normalization.

    Returns:
        ``d`` by name, each tensor shaped like, and on the device and dtype of, its weights.

    Raises:
        FlatbmaError: on unknown names or tensors that are not floating point.
    """
    policy = parse_choice(BiasBNPolicy, bias_bn, "bias_bn")
    weights = _direction_point(point, params)
    g = torch.Generator().manual_seed(int(seed))
    out: Params = {}
    for name, w in weights.items():
        d = torch.randn(w.shape, generator=g, dtype=torch.float64)
        w64 = w.detach().to(device="cpu", dtype=torch.float64)
        if filter_normalized:
            if w.dim() <= 1:
                d = torch.zeros_like(d) if policy is BiasBNPolicy.ZERO else w64.clone()
            else:
                rows_d, rows_w = d.reshape(d.shape[0], -1), w64.reshape(w.shape[0], -1)
                scale = rows_w.norm(dim=1) / (rows_d.norm(dim=1) + _NORM_EPS)
                d = (rows_d * scale[:, None]).reshape(w.shape)
        out[name] = d.to(device=w.device, dtype=w.dtype)
    return out


def _direction_point(point: nn.Module | Mapping[str, Tensor], params: Sequence[str] | None) -> Params:
    if isinstance(point, nn.Module):
        available = {k: v.detach() for k, v in point.named_parameters()}
        default = [k for k, v in point.named_parameters() if v.requires_grad]
        what = "parameter of the model"
    elif isinstance(point, Mapping):
        available = {k: v.detach() for k, v in point.items() if isinstance(v, Tensor)}
        default = [k for k, v in available.items() if v.is_floating_point()]
        what = "tensor of the given weights"
    else:
        raise FlatbmaError(
            f"the point of a direction must be a module or a dict of tensors, not {type(point).__name__}"
        )
    if isinstance(params, str):
        raise FlatbmaError(f"params must be a list of parameter names, not the string {params!r}")
    names = default if params is None else list(params)
    if not names:
        raise FlatbmaError("the direction has no tensor: choose at least one parameter (params=...)")
    for k in names:
        if k not in available:
            raise FlatbmaError(f"params: {k!r} is not a {what}.{suggest(k, available)}")
        if not available[k].is_floating_point():
            raise FlatbmaError(f"params: {k!r} is not floating point ({available[k].dtype})")
    return {k: available[k] for k in dict.fromkeys(names)}


def top_eigen_direction(
    model: nn.Module,
    data: Iterable[Batch] | Batch,
    params: ParamSelection = None,
    weights: Mapping[str, Tensor] | None = None,
    *,
    loss_fn: LossFn | None = None,
    tol: float = 1e-4,
    max_iter: int = 100,
    seed: int = 0,
    hvp: HVPMethod | str = HVPMethod.DOUBLE_BACKWARD,
) -> EigenDirection:
    """The eigenvector of the largest eigenvalue ``λ₁`` of ``∇²L_S(w)``, by :func:`~flatbma.flatness.lanczos`.

    ``model``, ``data``, ``params``, ``weights``, ``loss_fn`` and ``hvp`` are as in :func:`~flatbma.flatness.hvp_fn`;
    Lanczos runs to the relative residual ``tol`` within ``max_iter`` products, from a start vector drawn from
    ``seed``. The eigenvector's error is about ``tol · λ₁ / (λ₁ − λ₂)``: lower ``tol`` when the top eigenvalues are
    close.

    Returns:
        :class:`EigenDirection`, the unit eigenvector keyed by parameter name, in the parameters' dtype.
    """
    op = hvp_fn(model, data, loss_fn=loss_fn, params=params, weights=weights, hvp=hvp)
    result = lanczos(
        nonzero_checked(op),
        op.dim,
        1,
        tol=tol,
        max_iter=max_iter,
        eps=op.eps,
        generator=torch.Generator().manual_seed(seed),
        device=op.device,
        dtype=torch.float64,
        basis_size=default_basis_size(1),
    )
    v = result.eigenvectors[0]
    v = v / torch.linalg.vector_norm(v)
    if v[v.abs().argmax()] < 0:
        v = -v
    direction = {k: t.to(op.dtype).clone() for k, t in op.unflatten(v).items()}
    return EigenDirection(float(result.eigenvalues[0]), direction)


# --------------------------------------------------------------------------------------------------
# losses along directions


def loss_along(
    model: nn.Module,
    data: Iterable[Batch] | Batch,
    weights: Mapping[str, Tensor] | None,
    direction: Mapping[str, Tensor],
    alphas: Sequence[float] | Tensor,
    *,
    loss_fn: LossFn | None = None,
) -> Tensor:
    """``f(α) = L_S(w + α d)`` for every ``α`` (see the module docstring).

    Args:
        model: the module, called as ``functional_call(model, weights, (x,))`` in eval mode.
        data: a DataLoader, a re-iterable of ``(x, y)`` batches, or one batch. It is read once.
        weights: parameters and/or buffers ``w`` by module name (e.g. a posterior sample); tensors not
            given keep the model's own values; ``None`` for the model as it is.
        direction: ``d`` by parameter name (e.g. from :func:`random_direction`).
        alphas: the steps ``α``.
        loss_fn: ``loss_fn(logits, y)`` returning the mean loss of a batch; cross-entropy when ``None``.

    Returns:
        ``(len(alphas),)`` float64 tensor on the CPU.
    """
    a = check_finite_vector(alphas, "alphas")
    return _grid_losses(model, data, [weights or {}], [direction], a[:, None], loss_fn)[0]


def loss_surface(
    model: nn.Module,
    data: Iterable[Batch] | Batch,
    weights: Mapping[str, Tensor] | None,
    d1: Mapping[str, Tensor],
    d2: Mapping[str, Tensor],
    alphas: Sequence[float] | Tensor,
    betas: Sequence[float] | Tensor,
    *,
    loss_fn: LossFn | None = None,
) -> Tensor:
    """``f(α, β) = L_S(w + α d₁ + β d₂)`` on the grid ``alphas × betas`` (arguments as in :func:`loss_along`).

    Returns:
        ``(len(alphas), len(betas))`` float64 CPU tensor with ``surface[i, j] = f(alphas[i], betas[j])``.
    """
    a, b = check_finite_vector(alphas, "alphas"), check_finite_vector(betas, "betas")
    grid = torch.stack(torch.meshgrid(a, b, indexing="ij"), dim=-1).reshape(-1, 2)
    return _grid_losses(model, data, [weights or {}], [d1, d2], grid, loss_fn)[0].reshape(len(a), len(b))


def loss_along_samples(
    model: nn.Module,
    data: Iterable[Batch] | Batch,
    samples: Sequence[Mapping[str, Tensor]],
    direction: Mapping[str, Tensor],
    alphas: Sequence[float] | Tensor,
    *,
    loss_fn: LossFn | None = None,
) -> Tensor:
    """``L_S(w_m + α d)`` for every sample ``w_m`` and step ``α``: a ``(S, len(alphas))`` float64 CPU tensor.

    Every sample moves along the same ``d``; the data is read once for all of them.
    """
    if not samples:
        raise FlatbmaError("a posterior landscape needs at least one sample (eval.flatness_samples >= 1)")
    a = check_finite_vector(alphas, "alphas")
    return _grid_losses(model, data, list(samples), [direction], a[:, None], loss_fn)


def posterior_landscape(
    model: nn.Module,
    data: Iterable[Batch] | Batch,
    samples: Sequence[Mapping[str, Tensor]],
    direction: Mapping[str, Tensor],
    alphas: Sequence[float] | Tensor,
    *,
    loss_fn: LossFn | None = None,
) -> LandscapeBand:
    """Mean ± standard deviation over samples of :func:`loss_along_samples` (unbiased std; 0 for one sample).

    The direction is usually normalized to one point, e.g. ``random_direction(samples[0], names)``.
    """
    losses = loss_along_samples(model, data, samples, direction, alphas, loss_fn=loss_fn)
    std = losses.std(dim=0, unbiased=True) if losses.shape[0] > 1 else torch.zeros(losses.shape[1], dtype=losses.dtype)
    return LandscapeBand(losses.mean(dim=0), std)


def _check_direction(model: nn.Module, direction: Mapping[str, Tensor], base: Mapping[str, Tensor], label: str) -> None:
    if not direction:
        raise FlatbmaError(f"{label} is empty: it needs at least one parameter tensor")
    named = dict(model.named_parameters())
    for k, d in direction.items():
        if k not in named:
            raise FlatbmaError(f"{label} has a tensor {k!r} that is not a parameter of the model.{suggest(k, named)}")
        if d.shape != base[k].shape:
            raise FlatbmaError(
                f"{label}[{k!r}] has shape {tuple(d.shape)} but the weights have shape {tuple(base[k].shape)}"
            )


@torch.no_grad()
def _grid_losses(
    model: nn.Module,
    data: Iterable[Batch] | Batch,
    bases: Sequence[Mapping[str, Tensor]],
    directions: Sequence[Mapping[str, Tensor]],
    coefficients: Tensor,
    loss_fn: LossFn | None,
) -> Tensor:
    """``L_S(w_s + Σ_k c[p, k] d_k)`` for every base ``s`` and row ``p`` of ``coefficients``: ``(S, P)``.

    One pass over the data; batch losses are weighted by batch size.
    """
    loss_fn = loss_fn if loss_fn is not None else F.cross_entropy
    batches = _reiterable(data)
    own = {**{k: v.detach() for k, v in model.named_buffers()}, **{k: v.detach() for k, v in model.named_parameters()}}
    fulls, moved_dirs = [], []
    for base in bases:
        for k in base:
            if k not in own:
                raise FlatbmaError(
                    f"weights has a tensor {k!r} that the model does not have.{suggest(k, own)} "
                    "Pass the weights of this model (parameters and buffers by module name)."
                )
        full = {**own, **{k: v.detach() for k, v in base.items()}}
        for j, d in enumerate(directions):
            _check_direction(model, d, full, "direction" if len(directions) == 1 else f"d{j + 1}")
        fulls.append(full)
        moved_dirs.append(
            [{k: t.to(device=full[k].device, dtype=full[k].dtype) for k, t in d.items()} for d in directions]
        )
    names = list(dict.fromkeys(k for d in directions for k in d))
    coeffs = coefficients.tolist()
    totals = torch.zeros(len(fulls), len(coeffs), dtype=torch.float64)
    n = 0
    with eval_mode(model):
        for batch in batches:
            x, y = _unpack(batch)
            nb = x.shape[0]
            if nb == 0:
                continue
            for s, (full, dirs) in enumerate(zip(fulls, moved_dirs)):
                device = full[names[0]].device
                xb, yb = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                for p, c in enumerate(coeffs):
                    moved = dict(full)
                    for k in names:
                        t = full[k]
                        for ck, d in zip(c, dirs):
                            if k in d and ck != 0.0:
                                t = t + ck * d[k]
                        moved[k] = t
                    totals[s, p] += float(loss_fn(functional_call(model, moved, (xb,)), yb)) * nb
                    progress.current().tick()
            n += nb
    if n == 0:
        raise FlatbmaError("the data for the landscape is empty (no batch with at least one example)")
    return totals / n
