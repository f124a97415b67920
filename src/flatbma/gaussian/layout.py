"""The layout of the variational parameters ``θ``: named sections, the packed ``[K+2, d]`` matrix, SWAG's ``θ``.

Variational parameters are a ``dict[str, Tensor]`` whose keys are ``"<section>/<name>"`` for every
trained parameter ``<name>``; the low-rank plus diagonal Gaussian has the sections :data:`PREFIXES`
(``mean/`` of shape ``S``, ``log_std/`` of shape ``S``, ``factor/`` of shape ``[K, *S]``). Packed
(:mod:`flatbma.packed`) in :func:`theta_layout`, the whole ``θ`` is one ``[K+2, d]`` matrix
``[μ; log σ; L]`` on which the samplers, Fisher products and KL gradients work without copies.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from flatbma import packed
from flatbma.errors import FlatbmaError
from flatbma.packed import Layout
from flatbma.params import flatten
from flatbma.types import Params

PREFIXES = ("mean", "log_std", "factor")
"""The sections of the low-rank plus diagonal Gaussian's ``θ``: ``μ``, ``log σ`` and ``L``."""

MIN_VARIANCE = 1e-30
"""SWAG variances below this (round-off can make them ≤ 0) are raised to it before taking logs."""

KIND = "lowrank"
"""``Layout.kind`` of :func:`theta_layout`."""


def factor_scale(k: int) -> float:
    """``c = 1/√(2(K−1))``: the scale of the rank-K factor in ``Σ = ½(diag σ² + LLᵀ/(K−1)) = diag(σ²/2) + (cL)(cL)ᵀ``.

    SWAG's covariance (Maddox et al. 2019): the deviation matrix enters with ``1/(K−1)``, the whole with ``½``.
    """
    return 1.0 / math.sqrt(2.0 * (k - 1))


def section(theta: Mapping[str, Tensor], prefix: str) -> Params:
    """The tensors of ``theta`` under ``"<prefix>/"``, keyed by parameter name in sorted order.

    The sorted order makes noise draws, reductions and dense layouts independent of the order of
    ``theta``'s keys, which a checkpoint round trip does not preserve.
    """
    p = prefix + "/"
    return {k[len(p) :]: theta[k] for k in sorted(theta) if k.startswith(p)}


def is_theta(params: Mapping[str, Tensor]) -> bool:
    """Whether ``params`` are variational parameters (``"/"``-prefixed keys; module parameter names have none)."""
    return bool(params) and all("/" in k for k in params)


def check_sections(theta: Mapping[str, Tensor], prefixes: Sequence[str], method: str) -> Params:
    """Check that ``theta`` holds exactly ``prefix/<name>`` for every prefix and the same names.

    Returns:
        The ``mean`` section (the first prefix), keyed by parameter name.
    """
    parts = {p: section(theta, p) for p in prefixes}
    names = set(parts[prefixes[0]])
    known = sum(len(v) for v in parts.values())
    if not names or known != len(theta) or any(set(v) != names for v in parts.values()):
        raise FlatbmaError(
            f"{method}: variational parameters must be {', '.join(p + '/<name>' for p in prefixes)} for the "
            f"same parameter names; got keys {sorted(theta)[:6]}..."
        )
    return parts[prefixes[0]]


def rank_of(theta: Mapping[str, Tensor]) -> int:
    """``K``, the number of factor columns."""
    return next(iter(section(theta, "factor").values())).shape[0]


def theta_layout(theta: Mapping[str, Tensor]) -> Layout:
    """The packed layout of ``θ`` (:mod:`flatbma.packed`): one ``[K+2, d]`` matrix.

    Row 0 holds ``μ``, row 1 ``log σ`` and rows ``2..K+1`` the factor ``L`` (row ``k+2`` = column ``k`` of ``L``);
    parameter ``<name>`` owns the same columns in every row, in sorted name order, so ``[log σ; L]`` (``[K+1, d]``,
    for the Fisher algebra) and ``L`` (``[K, d]``, for the sampler) are contiguous blocks used without copies.
    """
    mean = section(theta, "mean")
    k = rank_of(theta)
    d = sum(v.numel() for v in mean.values())
    keys, shapes, strides, offsets = [], [], [], []
    for row, prefix in enumerate(("mean", "log_std")):
        offset = row * d
        for n, v in mean.items():
            keys.append(f"{prefix}/{n}")
            shapes.append(v.shape)
            strides.append(packed.contiguous_strides(v.shape))
            offsets.append(offset)
            offset += v.numel()
    offset = 2 * d
    for n, v in mean.items():
        keys.append(f"factor/{n}")
        shapes.append(torch.Size((k, *v.shape)))
        strides.append((d, *packed.contiguous_strides(v.shape)))
        offsets.append(offset)
        offset += v.numel()
    return Layout(tuple(keys), tuple(shapes), tuple(strides), tuple(offsets), (k + 2, d), kind=KIND)


def packed_rows(theta: Mapping[str, Tensor]) -> Tensor | None:
    """The ``[K+2, d]`` buffer of a ``θ`` packed in :func:`theta_layout`, else ``None``."""
    return packed.flat_of(theta, kind=KIND)


def rows(theta: Mapping[str, Tensor]) -> Tensor:
    """``θ`` (or a gradient with its keys) as its ``[K+2, d]`` matrix ``[μ; log σ; L]`` (:func:`theta_layout`).

    The packed buffer itself (no copy) when ``theta`` is packed, else a new matrix.
    """
    matrix = packed_rows(theta)
    if matrix is not None:
        return matrix
    mean, log_std, factor = section(theta, "mean"), section(theta, "log_std"), section(theta, "factor")
    k = rank_of(theta)
    return torch.cat(
        [
            torch.cat([v.reshape(1, -1) for v in mean.values()], dim=1),
            torch.cat([v.reshape(1, -1) for v in log_std.values()], dim=1),
            torch.cat([v.reshape(k, -1) for v in factor.values()], dim=1),
        ]
    )


def blocks(theta: Mapping[str, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """``(μ [d], log σ [d], L [K, d])`` in sorted name order: the rows of :func:`rows`."""
    matrix = rows(theta)
    return matrix[0], matrix[1], matrix[2:]


def from_rows(matrix: Tensor, like: Mapping[str, Tensor]) -> Mapping[str, Tensor]:
    """The ``θ``-keyed mapping (e.g. a gradient) of a ``[K+2, d]`` matrix, packed (:func:`theta_layout` of ``like``).

    ``matrix`` should be a freshly computed tensor: it becomes the buffer of the returned
    :class:`~flatbma.packed.Packed` mapping.
    """
    layout = packed.layout_of(like, kind=KIND)
    if layout is None:
        layout = theta_layout(like)
    return layout.lazy(matrix)


def names_and_shapes(theta: Mapping[str, Tensor]) -> tuple[list[str], list[torch.Size]]:
    """The parameter names (sorted) and shapes of ``θ``, from its layout when packed (no views made)."""
    layout = packed.layout_of(theta, kind=KIND)
    if layout is not None:
        count = len(layout.keys) // 3
        return [k[len("mean/") :] for k in layout.keys[:count]], list(layout.shapes[:count])
    mean = section(theta, "mean")
    return list(mean), [v.shape for v in mean.values()]


# ---------------------------------------------------------------------------------------------------
# θ of a SWAG posterior


def _as_vector(x: Tensor | Mapping[str, Tensor], like: Mapping[str, Tensor], what: str) -> Tensor:
    if isinstance(x, Mapping):
        missing = [k for k in like if k not in x]
        if missing:
            raise FlatbmaError(f"init_from_swag: the SWAG {what} lacks parameters {missing[:5]}")
        return flatten({k: x[k] for k in like})
    return x.reshape(-1)


def _as_deviations(x: Tensor | Mapping[str, Tensor], like: Mapping[str, Tensor]) -> Tensor:
    if isinstance(x, Mapping):
        missing = [k for k in like if k not in x]
        if missing:
            raise FlatbmaError(f"init_from_swag: the SWAG deviations lack parameters {missing[:5]}")
        return torch.cat([x[k].reshape(x[k].shape[0], -1) for k in like], dim=1)
    if x.dim() != 2:
        raise FlatbmaError(f"init_from_swag: deviations must be a [K, d] matrix, got shape {tuple(x.shape)}")
    return x


def init_from_swag(
    mean: Tensor | Mapping[str, Tensor],
    variance: Tensor | Mapping[str, Tensor],
    deviations: Tensor | Mapping[str, Tensor],
    like: Mapping[str, Tensor],
    *,
    scale: float = 1.0,
) -> Params:
    """Variational parameters ``θ`` (``mean/``, ``log_std/``, ``factor/``) whose ``q_θ`` is the SWAG Gaussian.

    SWAG's covariance (Maddox et al. 2019) ``scale · ½(diag σ²_SWAG + D Dᵀ/(K−1))``, ``D ∈ R^{d×K}`` with columns
    ``w_k − w̄``, has this family's shape: ``μ = w̄``, ``σ = √(scale·σ²_SWAG)``, ``L = √scale · D`` reproduce it
    exactly (variances below :data:`MIN_VARIANCE` are raised to it). Pass the result to a low-rank posterior's
    ``init`` in place of the model weights, with the method's ``rank`` equal to ``K``.

    Args:
        mean: SWAG mean ``w̄`` — a flat ``[d]`` vector (in ``like``'s key order) or a dict by name.
        variance: SWAG diagonal variance ``σ²_SWAG``, same forms.
        deviations: ``[K, d]`` matrix whose rows are the deviations, or a dict of ``[K, *shape]``.
        like: the model weights by name (shapes and order).
        scale: SWAG's covariance scale.
    """
    if not isinstance(scale, (int, float)) or not 0 < scale < float("inf"):
        raise FlatbmaError(f"init_from_swag: scale must be a positive number (got {scale!r})")
    mu = _as_vector(mean, like, "mean")
    var = _as_vector(variance, like, "variance")
    dev = _as_deviations(deviations, like)
    d = sum(v.numel() for v in like.values())
    k = dev.shape[0]
    if mu.numel() != d or var.numel() != d or dev.shape[1] != d:
        raise FlatbmaError(
            f"init_from_swag: the model has {d} weights but mean/variance/deviations have "
            f"{mu.numel()}/{var.numel()}/{dev.shape[1]}"
        )
    if k < 2:
        raise FlatbmaError(f"init_from_swag: SWAG needs at least 2 deviation columns (got {k})")
    theta: Params = {}
    offset = 0
    for name, v in like.items():
        n = v.numel()
        sl = slice(offset, offset + n)
        theta[f"mean/{name}"] = mu[sl].reshape(v.shape).clone()
        theta[f"log_std/{name}"] = 0.5 * torch.log(scale * var[sl].clamp_min(MIN_VARIANCE)).reshape(v.shape)
        theta[f"factor/{name}"] = math.sqrt(scale) * dev[:, sl].reshape(k, *v.shape).clone()
        offset += n
    return theta
