"""Low-rank plus diagonal Gaussian variational inference (the SWAG covariance shape, trained by VI).

``q_θ(w) = N(μ, Σ)`` with ``Σ = ½(diag σ² + L Lᵀ / (K − 1))``, ``L ∈ R^{d×K}``, sampled as

    ``w = μ + (1/√2)(σ ⊙ z₁ + L z₂ / √(K − 1))``,  ``z₁ ~ N(0, I_d)``, ``z₂ ~ N(0, I_K)`` (mean 0),

exactly the SWAG sampler (Maddox et al. 2019), so a SWAG posterior can initialize it
(:func:`init_from_swag`). Layout of ``θ`` for every trainable parameter ``<name>`` of shape ``S``:
``"mean/<name>"`` (``μ``, shape ``S``), ``"log_std/<name>"`` (``log σ``, shape ``S``) and
``"factor/<name>"`` of shape ``[K, *S]``: row ``k`` of the factor block is the part of column ``k`` of
``L`` that belongs to ``<name>``. Keeping the factor per parameter (rather than one flat ``[d, K]``
matrix) keeps ``θ`` a dict of named tensors, so optimizers, checkpoints and Bayesian-subset
selection work unchanged; :func:`dense_covariance` assembles ``Σ`` (parameters in sorted name order)
where linear algebra needs it. ``z₂`` is shared by all parameters (one global ``L``).

The prior is ``p = N(0, s² I)``; its KL is computed in ``O(dK²)`` with the matrix determinant lemma.
Built with an ascent step this is F-low-rank-VI (Nguyen et al., NeurIPS 2023).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch
from torch import Tensor

from flatbma import packed
from flatbma.errors import FlatbmaError
from flatbma.packed import Layout
from flatbma.params import Objective, flatten
from flatbma.posteriors import gaussian_vi
from flatbma.posteriors.gaussian_vi import (
    GaussianNoise,
    check_sections,
    section,
    standard_normal,
    standard_normal_like,
)
from flatbma.types import Ascent, GradientTransformation, Params, Posterior, State

PREFIXES = ("mean", "log_std", "factor")
MIN_VARIANCE = 1e-30
"""SWAG variances below this (round-off can make them ≤ 0) are raised to it before taking logs."""


def rank_of(theta: Mapping[str, Tensor]) -> int:
    """``K``, the number of factor columns."""
    return next(iter(section(theta, "factor").values())).shape[0]


_KIND = "lowrank"
"""``Layout.kind`` of :func:`theta_layout`."""


def theta_layout(theta: Mapping[str, Tensor]) -> Layout:
    """The packed layout of ``θ`` (:mod:`flatbma.packed`): one ``[K+2, d]`` matrix.

    Row 0 holds ``μ``, row 1 ``log σ`` and rows ``2..K+1`` the factor ``L`` (row ``k+2`` = column ``k`` of
    ``L``); parameter ``<name>`` owns the same columns in every row, in sorted name order. So
    ``[log σ; L]`` is the contiguous ``[K+1, d]`` block the Fisher algebra works on and ``L`` the
    ``[K, d]`` matrix the sampler multiplies, without any copy.
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
    return Layout(tuple(keys), tuple(shapes), tuple(strides), tuple(offsets), (k + 2, d), kind=_KIND)


def packed_rows(theta: Mapping[str, Tensor]) -> Tensor | None:
    """The ``[K+2, d]`` buffer of a ``θ`` packed in :func:`theta_layout`, else ``None``."""
    return packed.flat_of(theta, kind=_KIND)


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
    layout = packed.layout_of(like, kind=_KIND)
    if layout is None:
        layout = theta_layout(like)
    return layout.lazy(matrix)


_NOISE_LAYOUTS: dict[int, tuple[Layout, Layout]] = {}
"""``id(θ layout) -> (θ layout, z₁ layout)``; the entry keeps the θ layout alive, so its id is not reused."""


def _noise_layout(theta: Mapping[str, Tensor]) -> Layout | None:
    """The layout of ``z₁`` (keys: parameter names) for a packed ``θ``: row 0 of its buffer, cached."""
    layout = packed.layout_of(theta, kind=_KIND)
    if layout is None:
        return None
    cached = _NOISE_LAYOUTS.get(id(layout))
    if cached is not None and cached[0] is layout:
        return cached[1]
    count = len(layout.keys) // 3  # the mean/ entries come first and tile row 0
    z_layout = Layout(
        tuple(k[len("mean/") :] for k in layout.keys[:count]),
        layout.shapes[:count],
        layout.strides[:count],
        layout.offsets[:count],
        (layout.shape[1],),
    )
    if len(_NOISE_LAYOUTS) >= 8:
        _NOISE_LAYOUTS.clear()
    _NOISE_LAYOUTS[id(layout)] = (layout, z_layout)
    return z_layout


def _names_and_shapes(theta: Mapping[str, Tensor]) -> tuple[list[str], list[torch.Size]]:
    """The parameter names (sorted) and shapes of ``θ``, from its layout when packed (no views made)."""
    layout = packed.layout_of(theta, kind=_KIND)
    if layout is not None:
        count = len(layout.keys) // 3
        return [k[len("mean/") :] for k in layout.keys[:count]], list(layout.shapes[:count])
    mean = section(theta, "mean")
    return list(mean), [v.shape for v in mean.values()]


def _flat_noise(z1: Mapping[str, Tensor], names: list[str], batch: torch.Size) -> Tensor:
    """``z₁`` as ``[*batch, d]`` in ``names`` order: its buffer when packed that way, else concatenated."""
    flat = packed.flat_of(z1, names) if not batch else None
    if flat is not None:
        return flat.view(-1)
    return torch.cat([z1[n].reshape(*batch, -1) for n in names], dim=-1)


def sample_weights(theta: Mapping[str, Tensor], z1: Mapping[str, Tensor], z2: Tensor) -> Params:
    """``w = μ + (1/√2)(σ ⊙ z₁ + L z₂ / √(K−1))`` by parameter name, differentiable in ``θ``.

    Args:
        theta: variational parameters (layout in the module docstring).
        z1: ``N(0, I)`` noise shaped like the weights, by name; may carry leading sample dimensions.
        z2: ``N(0, I_K)`` noise of shape ``[K]``, or ``[*batch, K]`` matching ``z1``'s leading dimensions.
    """
    names, shapes = _names_and_shapes(theta)
    k = z2.shape[-1]
    c = 1.0 / math.sqrt(2.0 * (k - 1))
    batch = z2.shape[:-1]
    # One flat [K, d] pass instead of one small product per tensor: a few large kernels (and as many in
    # the backward pass) for the ~100 BatchNorm and classifier tensors of a transfer subset.
    mu, log_std, factor = blocks(theta)
    noise = _flat_noise(z1, names, batch)
    flat = mu + math.sqrt(0.5) * torch.exp(log_std) * noise + c * (z2 @ factor)
    pieces = flat.split([shape.numel() for shape in shapes], dim=-1)
    return {n: piece.view(*batch, *shape) for n, piece, shape in zip(names, pieces, shapes, strict=True)}


reparameterize = sample_weights


def theta_of(state: State) -> Params:
    """The Gaussian ``q_θ`` of a low-rank VI (or FP-BMA) state: its ``θ`` (:attr:`Posterior.gaussian`)."""
    return {k: v.detach().clone() for k, v in state.params.items()}


# ---------------------------------------------------------------------------------------------------
# the covariance in whitened form (Woodbury), shared by the closed-form KL gradient and FP-BMA's Fisher


class LowRankGeometry(NamedTuple):
    """``Σ = A + UᵀU`` (``U`` stored ``[K, d]``) and the Woodbury quantities of its Fisher.

    Attributes:
        a: ``diag A = σ²/2``, shape ``[d]``.
        u: ``U = L/√(2(K−1))``, shape ``[K, d]``.
        c: ``1/√(2(K−1))``.
        cs: ``c A^{-1/2}``, shape ``[d]`` (maps ``V`` to the whitened ``Ṽ = cVA^{-1/2}``).
        ut: whitened factor ``Ũᵀ = U A^{-1/2}``, shape ``[K, d]``.
        cap: the capacitance ``C = I + ŨᵀŨ``.
        c_inv: ``C⁻¹``.
        pt: ``C⁻¹Ũᵀ`` (``= ŨᵀT`` with ``T = I − ŨC⁻¹Ũᵀ = A^{1/2}Σ⁻¹A^{1/2}``), shape ``[K, d]``.
        e: ``I − C⁻¹ = ŨᵀTŨ``.
        w: ``diag(ŨC⁻¹Ũᵀ) = 1 − diag T``, shape ``[d]``.
    """

    a: Tensor
    u: Tensor
    c: float
    cs: Tensor
    ut: Tensor
    cap: Tensor
    c_inv: Tensor
    pt: Tensor
    e: Tensor
    w: Tensor


_GEOMETRY_CACHE: list[tuple[tuple, list[Tensor], LowRankGeometry]] = []
"""The last :func:`geometry` (one entry): an FP-BMA step needs it at the same ``θ`` twice, for the
ascent's Fisher solve and for the closed-form KL gradient."""


def geometry(theta: Mapping[str, Tensor], dtype: torch.dtype | None = None, *, cache: bool = True) -> LowRankGeometry:
    """The Woodbury quantities of ``q_θ``'s covariance, computed in ``dtype`` (default: ``θ``'s).

    The last result is reused when called again on the same storages at the same versions (an in-place
    update bumps a tensor's version; the cached entry holds references, so a storage address cannot be
    reused while it is cached). Inputs that require gradients bypass the cache, and so does
    ``cache=False`` (for a fixed second Gaussian, such as a prior, that must not evict ``θ``'s entry).
    """
    if not cache:
        return _geometry(*blocks(theta)[1:], dtype)
    matrix = packed_rows(theta)
    tensors = (
        [matrix] if matrix is not None else [*section(theta, "log_std").values(), *section(theta, "factor").values()]
    )
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return _geometry(*blocks(theta)[1:], dtype)
    key = (dtype, tuple((t.data_ptr(), t._version, t.shape, t.dtype, t.device) for t in tensors))
    if _GEOMETRY_CACHE and _GEOMETRY_CACHE[0][0] == key:
        return _GEOMETRY_CACHE[0][2]
    matrix = matrix if matrix is not None else rows(theta)
    result = _geometry(matrix[1], matrix[2:], dtype)
    _GEOMETRY_CACHE[:] = [(key, tensors, result)]
    return result


def _geometry(log_std: Tensor, factor: Tensor, dtype: torch.dtype | None) -> LowRankGeometry:
    """:class:`LowRankGeometry` of ``log σ`` (``[d]``) and ``L`` (``[K, d]``)."""
    k = factor.shape[0]
    c = 1.0 / math.sqrt(2.0 * (k - 1))
    s = log_std.to(dtype)
    a = 0.5 * torch.exp(2 * s)
    inv_sqrt_a = math.sqrt(2.0) * torch.exp(-s)
    u = c * factor.to(s.dtype)
    ut = u * inv_sqrt_a
    eye = torch.eye(k, dtype=u.dtype, device=u.device)
    cap = eye + ut @ ut.T
    c_inv = torch.cholesky_inverse(torch.linalg.cholesky(cap))
    pt = c_inv @ ut
    return LowRankGeometry(a, u, c, c * inv_sqrt_a, ut, cap, c_inv, pt, eye - c_inv, (ut * pt).sum(0))


def _diag_and_factor_blocks(theta: Mapping[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """``Σ = diag(a) + U Uᵀ`` with ``a = σ²/2`` and ``U = L / √(2(K−1))``, per parameter block."""
    log_std, factor = section(theta, "log_std"), section(theta, "factor")
    k = rank_of(theta)
    c = 1.0 / math.sqrt(2.0 * (k - 1))
    a = {n: 0.5 * torch.exp(2 * v).reshape(-1) for n, v in log_std.items()}
    u = {n: c * f.reshape(k, -1) for n, f in factor.items()}
    return a, u


def kl_divergence(theta: Mapping[str, Tensor], prior_std: float) -> Tensor:
    """``KL(N(μ, Σ) ‖ N(0, s² I))`` in ``O(dK²)``.

    ``KL = ½[(tr Σ + ‖μ‖²)/s² − d + d log s² − log det Σ]`` with ``Σ = A + U Uᵀ``, ``A = diag(σ²/2)``,
    ``U = L/√(2(K−1))``; ``tr Σ = Σ a_i + ‖U‖²_F`` and, by the matrix determinant lemma,
    ``log det Σ = Σ log a_i + log det(I_K + Uᵀ A⁻¹ U)``.
    """
    mean, log_std = section(theta, "mean"), section(theta, "log_std")
    a, u = _diag_and_factor_blocks(theta)
    k = rank_of(theta)
    ref = next(iter(mean.values()))
    capacitance = torch.eye(k, dtype=ref.dtype, device=ref.device)
    trace = sq_mean = logdet_a = torch.zeros((), dtype=ref.dtype, device=ref.device)
    d = 0
    for name, mu in mean.items():
        capacitance = capacitance + (u[name] / a[name]) @ u[name].T
        trace = trace + a[name].sum() + (u[name] ** 2).sum()
        sq_mean = sq_mean + (mu**2).sum()
        logdet_a = logdet_a + (2 * log_std[name] - math.log(2.0)).sum()
        d += mu.numel()
    # The capacitance is symmetric positive definite (≥ I); slogdet's LU is as accurate here as a
    # Cholesky factorization and, on small matrices, far cheaper with multi-threaded LAPACK builds.
    logdet = logdet_a + torch.linalg.slogdet(capacitance)[1]
    s2 = prior_std**2
    return 0.5 * ((trace + sq_mean) / s2 - d + d * math.log(s2) - logdet)


def dense_covariance(theta: Mapping[str, Tensor]) -> Tensor:
    """``Σ = ½(diag σ² + L Lᵀ/(K−1))`` as a dense ``[d, d]`` matrix.

    Rows follow ``flatten(section(theta, "mean"))``: parameters in sorted name order. For tests and
    small models only (``O(d²)`` memory).
    """
    a, u = _diag_and_factor_blocks(theta)
    names = list(section(theta, "mean"))
    a_vec = torch.cat([a[n] for n in names])
    u_mat = torch.cat([u[n] for n in names], dim=1)  # [K, d]
    return torch.diag(a_vec) + u_mat.T @ u_mat


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
    """Variational parameters whose ``q_θ`` is the SWAG Gaussian (Maddox et al. 2019).

    SWAG's covariance is ``scale · ½(diag σ²_SWAG + D Dᵀ/(K−1))`` with deviation matrix ``D ∈ R^{d×K}``
    (columns ``w_k − w̄``); the same shape as this family, so ``μ = w̄``, ``σ = √(scale·σ²_SWAG)`` and
    ``L = √scale · D`` reproduce it exactly (variances below :data:`MIN_VARIANCE` are raised to it).
    Pass the result to the posterior's ``init`` in place of the model weights; the method's ``rank``
    must equal ``K``.

    Args:
        mean: SWAG mean ``w̄`` — a flat ``[d]`` vector (in ``like``'s key order) or a dict by name.
        variance: SWAG diagonal variance ``σ²_SWAG``, same forms.
        deviations: ``[K, d]`` matrix whose rows are the deviations, or a dict of ``[K, *shape]``.
        like: the model weights by name (shapes and order).
        scale: SWAG's covariance scale.

    Returns:
        ``θ`` with ``mean/``, ``log_std/`` and ``factor/`` entries.
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


@dataclass(frozen=True)
class LowRankGaussian:
    """The low-rank plus diagonal family as a :class:`~flatbma.posteriors.gaussian_vi.ReparameterizedFamily`.

    Attributes:
        rank: ``K``.
        init_std: initial marginal standard deviation.
        prior_std: ``s``.
    """

    rank: int
    init_std: float
    prior_std: float

    def init_theta(self, params: Params, generator: torch.Generator) -> Params:
        """``μ = w₀``, ``σ = init_std``, ``L_ik ~ N(0, init_std²(K−1)/K)``.

        Then ``E[Σ] = init_std² I``. The factor starts random, not at 0: ``L = 0`` is a stationary point
        of the expected objective (``E[z₂] = 0`` makes the expected gradient in ``L`` vanish there).
        """
        k = self.rank
        c = self.init_std * math.sqrt((k - 1) / k)
        theta = {f"mean/{n}": v for n, v in params.items()}
        theta.update({f"log_std/{n}": torch.full_like(v, math.log(self.init_std)) for n, v in params.items()})
        for n, v in params.items():
            z = torch.randn((k, *v.shape), generator=generator, device=generator.device, dtype=v.dtype)
            theta[f"factor/{n}"] = c * z.to(v.device)
        return theta

    def check_theta(self, theta: Mapping[str, Tensor]) -> None:
        """Require the ``mean/``, ``log_std/``, ``factor/`` layout with ``K = rank``."""
        mean = check_sections(theta, PREFIXES, "lowrank-vi")
        factor = section(theta, "factor")
        for n, mu in mean.items():
            if factor[n].shape != (self.rank, *mu.shape):
                raise FlatbmaError(
                    f"method.rank is {self.rank} but the given factor/{n} has shape {tuple(factor[n].shape)} "
                    f"(expected {(self.rank, *mu.shape)}); set method.rank to the SWAG rank"
                )

    def noise(self, theta: Mapping[str, Tensor], generator: torch.Generator | None) -> GaussianNoise:
        """``z₁ ~ N(0, I_d)`` (by parameter name, in sorted order), ``z₂ ~ N(0, I_K)``."""
        layout = _noise_layout(theta)
        if layout is None:
            z1 = standard_normal_like(section(theta, "mean"), generator)
        else:
            matrix = packed_rows(theta)
            z1 = standard_normal(layout, matrix.dtype, matrix.device, generator)
        ref = next(iter(z1.values()))
        device = generator.device if generator is not None else ref.device
        z2 = torch.randn(self.rank, generator=generator, device=device, dtype=ref.dtype).to(ref.device)
        return GaussianNoise(z1, z2)

    def reparameterize(self, theta: Mapping[str, Tensor], noise: GaussianNoise) -> Params:
        """:func:`sample_weights`."""
        return sample_weights(theta, noise.z1, noise.z2)

    def pullback(self, theta: Mapping[str, Tensor], noise: GaussianNoise, grads: Mapping[str, Tensor]) -> Params:
        """``(∂w/∂θ)ᵀ g`` for ``w = sample_weights(θ, z₁, z₂)``, in closed form (no autograd graph).

        ``w`` is linear in ``μ``, ``σ`` and ``L``: ``∂/∂μ = g``, ``∂/∂log σ = g ⊙ σ ⊙ z₁/√2`` and
        ``∂/∂L_k = c·z₂ₖ·g`` with ``c = 1/√(2(K−1))`` — one flat pass over all tensors, returned packed
        like ``θ`` (:func:`theta_layout`).
        """
        names, _ = _names_and_shapes(theta)
        k = noise.z2.shape[-1]
        c = 1.0 / math.sqrt(2.0 * (k - 1))
        _, log_std, _ = blocks(theta)
        g = torch.cat([grads[n].reshape(-1) for n in names])
        z1 = _flat_noise(noise.z1, names, torch.Size())
        out = torch.empty((k + 2, g.numel()), dtype=g.dtype, device=g.device)
        out[0] = g
        torch.mul(math.sqrt(0.5) * torch.exp(log_std) * z1, g, out=out[1])
        torch.outer(c * noise.z2.to(g.dtype), g, out=out[2:])
        return from_rows(out, theta)

    def layout(self, theta: Mapping[str, Tensor]) -> Layout:
        """:func:`theta_layout`: how a state's ``θ`` (and its optimizer moments) are packed."""
        return theta_layout(theta)

    def kl_grad(self, theta: Mapping[str, Tensor]) -> Mapping[str, Tensor]:
        """``∇_θ KL(q_θ ‖ N(0, s²I))`` in closed form, packed like ``θ`` (:func:`theta_layout`).

        For ``Σ = A + UUᵀ`` (``A = diag(σ²/2)``, ``U = L/√(2(K−1))``): ``∇_μ KL = μ/s²``,
        ``∇_logσ KL = σ²/(2s²) − σ²⊙diag(Σ⁻¹)/2`` and ``∇_L KL = (L/s² − Σ⁻¹L)/(2(K−1))`` (``L`` as
        ``d×K``), with ``diag Σ⁻¹`` and ``Σ⁻¹L`` from the Woodbury quantities of :func:`geometry` —
        a few flat operations instead of differentiating :func:`kl_divergence` through its per-parameter loop.
        """
        mu, _, factor = blocks(theta)
        geo = geometry(theta, torch.float64)
        s2 = self.prior_std**2
        out = torch.empty((factor.shape[0] + 2, mu.numel()), dtype=mu.dtype, device=mu.device)
        torch.div(mu, s2, out=out[0])
        # σ²(Σ⁻¹)_ii/2 = 1 − wᵢ;  Σ⁻¹L/(2(K−1)) = c·C⁻¹ŨᵀA^{-1/2} (as rows of the [K, d] layout)
        out[1] = geo.a / s2 - (1 - geo.w)
        torch.sub(factor * (geo.c**2 / s2), (geo.pt * geo.cs).to(mu.dtype), out=out[2:])
        return from_rows(out, theta)

    def kl(self, theta: Mapping[str, Tensor]) -> Tensor:
        """:func:`kl_divergence` with ``s = prior_std``."""
        return kl_divergence(theta, self.prior_std)


def build(
    objective: Objective,
    optimizer: GradientTransformation,
    ascent: Ascent | None = None,
    *,
    rank: int = 5,
    num_mc_samples: int = 1,
    init_std: float = 1e-3,
    prior_std: float = 1.0,
    kl_weight: float = 1.0,
) -> Posterior:
    """Low-rank plus diagonal Gaussian VI, or its flat-seeking variant with an ascent step.

    Minimizes ``E_{z₁,z₂}[L_B(w(θ, z))] + κ·KL(q_θ ‖ N(0, s²I)) / n`` over ``θ = (μ, log σ, L)`` with
    ``optimizer`` (``n = objective.num_data``); with an ascent step each sampled ``w`` is perturbed
    by ``ε = ascent.perturb(w, ∇L_B(w))`` and ``∇L_B(w + ε)`` is back-propagated to ``θ`` (see
    :mod:`flatbma.posteriors.gaussian_vi`). ``init`` also accepts a ``θ`` from :func:`init_from_swag`.

    The expected gradient in ``L`` is second order (``∝ H L`` by Stein's lemma) while its single-sample
    noise is first order, so under Adam, which normalizes every coordinate, ``L`` diffuses by about
    ``lr·√t`` in absolute units; prefer a smaller Adam learning rate than for mean-field VI (on digits
    3e-3 rather than 1e-2) or SGD.

    Args:
        objective: model and mini-batch loss.
        optimizer: optimizer of ``θ`` (Adam is the usual choice).
        ascent: ascent step for the flat-seeking variant, or ``None``.
        rank: ``K ≥ 2``, the number of factor columns.
        num_mc_samples: Monte-Carlo samples ``M`` per step (their gradients are averaged).
        init_std: initial marginal standard deviation of every weight.
        prior_std: prior standard deviation ``s``.
        kl_weight: ``κ`` (1 is the ELBO; smaller values temper the KL).
    """
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 2:
        raise FlatbmaError(
            f"method.rank must be an integer >= 2 (got {rank!r}): Σ = ½(diag σ² + LLᵀ/(K−1)) needs K ≥ 2"
        )
    gaussian_vi.check_options(
        num_mc_samples=num_mc_samples, init_std=init_std, prior_std=prior_std, kl_weight=kl_weight
    )
    family = LowRankGaussian(rank=rank, init_std=float(init_std), prior_std=float(prior_std))
    posterior = gaussian_vi.build(
        objective, optimizer, ascent, family, num_mc_samples=num_mc_samples, kl_weight=float(kl_weight)
    )
    return replace(posterior, gaussian=theta_of)
