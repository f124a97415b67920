"""The largest eigenvalues of a symmetric operator, and of the training-loss Hessian.

* :func:`lanczos` — Lanczos with full reorthogonalization (Gram–Schmidt twice). After ``m`` products with ``A`` it
  holds an orthonormal basis ``V_m`` of the Krylov space ``span{v, Av, …, A^{m−1}v}`` and ``T_m = V_mᵀ A V_m``; the
  Ritz pairs ``(θ_i, V_m s_i)`` have residuals ``β_m |e_mᵀ s_i|``, and the test
  ``β_m |e_mᵀ s_i| ≤ tol · max(|θ_i|, √eps · max_j |θ_j|)`` on the ``k`` largest bounds their relative error by
  ``tol`` (docs/methods.md §8.2). An invariant Krylov space (``β_m`` at rounding level) is left from a new random
  vector orthogonal to the basis; an eigenvalue of multiplicity > 1 inside a non-invariant Krylov space is seen
  once (:func:`power_iteration` finds every copy). ``basis_size`` bounds the basis by thick restarts. The basis is
  in ``dtype``, ``α``, ``β``, ``T`` and the Ritz values in float64; eigenvalues are resolved to
  ``max(tol, ~√d · eps_dtype)`` relative to ``‖A‖``.
* :func:`power_iteration` — the reference: power iteration with deflation by projection, as in PyHessian
  (Yao et al., 2020).

Lanczos (1950); Paige (1972); Parlett, *The Symmetric Eigenvalue Problem* (1998), §13;
Giraud, Langou & Rozložník (2005) on Gram–Schmidt twice; Wu & Simon (2000) on thick restart.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from enum import Enum

import torch
from torch import Tensor, nn

from flatbma.checks import parse_choice
from flatbma.errors import FlatbmaError, FlatbmaWarning
from flatbma.flatness.hvp import HVPMethod, LossFn, ParamSelection, hvp_fn, nonzero_checked
from flatbma.precision import outside_autocast
from flatbma.types import Batch

__all__ = [
    "ConvergenceWarning",
    "EigenMethod",
    "EigenResult",
    "default_basis_size",
    "hessian_eigenvalues",
    "lanczos",
    "lanczos_tridiagonal",
    "power_iteration",
]

Matvec = Callable[[Tensor], Tensor]

_EPS64 = torch.finfo(torch.float64).eps


def _breakdown(dim: int, eps: float) -> float:
    """``β ≤ 10 √d eps ‖T‖``: the Krylov space is invariant up to the precision of the products."""
    return 10.0 * math.sqrt(dim) * eps


class ConvergenceWarning(FlatbmaWarning):
    """An iterative solver stopped at its iteration limit before meeting its tolerance."""


class EigenMethod(str, Enum):
    """Eigensolver of :func:`hessian_eigenvalues` (strings and members are both accepted)."""

    LANCZOS = "lanczos"
    POWER = "power"


@dataclass(frozen=True)
class EigenResult:
    """The ``k`` largest eigenpairs found by an iterative solver.

    Attributes:
        eigenvalues: ``(k,)`` float64, descending.
        eigenvectors: ``(k, d)`` orthonormal rows, in the order of ``eigenvalues`` (in the dtype of
            the solver's vectors); ``None`` from :func:`lanczos` with ``vectors=False``.
        residuals: ``(k,)`` residual norms ``‖A y_i − θ_i y_i‖`` of the unit vectors ``y_i`` (Lanczos: the estimate
            ``β_m |e_mᵀ s_i|``; power iteration: that of the deflated operator).
        num_matvecs: operator products used.
        converged: whether every residual met the tolerance.
        converged_each: ``(k,)`` bool, whether each eigenvalue met it (``converged`` is their conjunction).
    """

    eigenvalues: Tensor
    eigenvectors: Tensor | None
    residuals: Tensor
    num_matvecs: int
    converged: bool
    converged_each: Tensor


@outside_autocast  # a caller's autocast would cast the basis' products: its orthogonality would be lost
def lanczos(
    matvec: Matvec,
    dim: int,
    k: int,
    *,
    tol: float = 1e-4,
    max_iter: int = 100,
    eps: float = _EPS64,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float64,
    warn: bool = True,
    basis_size: int | None = None,
    vectors: bool = True,
) -> EigenResult:
    """The ``k`` largest (algebraic) eigenpairs of a symmetric operator by Lanczos (module docstring).

    Memory: the basis, ``m × d`` in ``dtype`` with ``m ≤ basis_size`` rows (grown as needed), besides ``matvec``'s.

    Thick restart (``basis_size`` reached before convergence): the ``ℓ = k + ⌈(basis_size − k)/2⌉ − 1`` largest
    Ritz vectors ``Y = V_m S_ℓ`` replace the basis in place, followed by the pending vector ``v_{m+1}``, and ``T``
    restarts as the arrowhead ``[[Θ_ℓ, σ], [σᵀ, ·]]`` with ``σ = β_m S_ℓᵀ e_m``, so ``A V = V T + β v eᵀ`` and the
    residual estimate ``β |e_mᵀ s_i|`` still hold (to ``dtype``'s precision).

    Args:
        matvec: ``v ↦ A v`` on vectors of length ``dim`` in ``dtype``.
        dim: dimension ``d``.
        k: number of eigenpairs, ``1 ≤ k ≤ d``.
        tol: relative residual tolerance.
        max_iter: maximum number of products (capped at ``d`` when the basis is not bounded).
        eps: relative precision of ``matvec`` (its dtype's machine epsilon); sets the tolerance floor ``√eps`` and
            the breakdown threshold ``β ≤ 10 √d eps ‖T‖`` below which the Krylov space counts as invariant.
        generator: CPU generator for the start vector(s).
        device: where the basis lives.
        dtype: of the basis vectors; float32 suffices (half the memory) when ``matvec`` computes in float32.
        warn: issue a :class:`ConvergenceWarning` when some eigenvalue misses the tolerance.
        basis_size: most basis vectors held at once (``≥ k + 2``), restarting when full; ``None``: unbounded.
        vectors: form the Ritz vectors (``k × d`` more memory); ``False`` returns ``eigenvectors=None``.
    """
    _check_solver_args(dim, k, tol, max_iter)
    if max_iter < k:
        raise FlatbmaError(f"max_iter must be >= k for Lanczos (got max_iter={max_iter}, k={k})")
    if basis_size is not None and (not isinstance(basis_size, int) or basis_size < k + 2):
        raise FlatbmaError(f"basis_size must be an integer >= k + 2 = {k + 2} (got {basis_size!r})")
    rows = dim if basis_size is None else min(basis_size, dim)
    products = min(max_iter, dim) if rows == dim else max_iter
    rows = min(rows, products)  # the basis never needs more rows than there are products
    keep = k + (rows - k + 1) // 2 - 1  # Ritz vectors kept by a restart (1 ≤ rows − keep)
    floor, breakdown = math.sqrt(eps), _breakdown(dim, eps)
    basis = torch.empty(min(rows, max(2 * k, 32)), dim, dtype=dtype, device=device)
    basis[0] = _random_unit(dim, generator, basis.device, dtype)
    t = torch.zeros(basis.shape[0], basis.shape[0], dtype=torch.float64)  # T = Vᵀ A V: its leading m × m block
    prev: float | Tensor = 0.0  # the couplings of the newest vector: β to the one before, or σ after a restart
    m, scale = 1, 0.0
    for count in range(1, products + 1):
        alpha, w = _lanczos_step(matvec, basis[:m], prev)
        beta = _norm(w)
        t[m - 1, m - 1] = alpha
        scale = max(scale, abs(alpha), beta)
        theta, s = torch.linalg.eigh(t[:m, :m])
        residuals = beta * s[-1].abs()
        top = torch.arange(m - 1, max(m - 1 - k, -1), -1)  # the k largest Ritz values, descending
        invariant = beta <= breakdown * scale
        if m >= k:
            bound = tol * torch.clamp(theta[top].abs(), min=floor * float(theta.abs().max()))
            # an invariant Krylov space makes every residual vanish but says nothing about the
            # eigenvalues outside it (repeated ones): go on from a new direction before stopping
            each = (residuals[top] <= bound) & (not invariant) if m < dim else torch.ones(len(top), dtype=torch.bool)
            converged = bool(each.all())
            if converged or count == products:
                break
        if invariant:  # restart orthogonally to the basis; the dropped coupling is below precision
            w = _random_unit(dim, generator, basis.device, dtype)
            _orthogonalize(w, basis[:m])
            beta, w = 0.0, w / torch.linalg.vector_norm(w)
        else:
            w = w / beta
        if m == rows:  # thick restart: the `keep` largest Ritz vectors, then w
            _rotate(basis[:m], s[:, m - keep :])
            prev = beta * s[-1, m - keep :]
            t.zero_()
            t[:keep, :keep] = torch.diag(theta[m - keep :])
            t[keep, :keep] = t[:keep, keep] = prev
            m = keep
        else:
            if m == basis.shape[0]:  # grow geometrically: no rows × d allocation up front
                basis = torch.cat([basis, torch.empty(min(m, rows - m), dim, dtype=dtype, device=basis.device)])
                t = torch.block_diag(t, torch.zeros(basis.shape[0] - m, basis.shape[0] - m, dtype=torch.float64))
            t[m - 1, m] = t[m, m - 1] = prev = beta
        basis[m] = w
        del w  # not alive during the next product, whose transient memory is the peak
        m += 1
    dev = basis.device
    ritz = s[:, top].to(device=dev, dtype=dtype).T @ basis[:m] if vectors else None
    result = EigenResult(theta[top].to(dev), ritz, residuals[top].to(dev), count, converged, each.to(dev))
    if not converged and warn:
        _warn_unconverged("Lanczos", result, max_iter)
    return result


def _rotate(basis: Tensor, s: Tensor) -> None:
    """``basis[:ℓ] ← sᵀ basis`` in place for ``s`` (``m × ℓ``, float64), a block of columns at a time.

    Each block is multiplied in float64 and rounded once to the basis's dtype; temporaries are ~1 MiB, not ``ℓ × d``.
    """
    sT = s.T.to(basis.device)
    width = max(1, (1 << 17) // basis.shape[0])
    for c in range(0, basis.shape[1], width):
        block = basis[:, c : c + width]
        block[: s.shape[1]] = sT @ block.to(torch.float64)


@outside_autocast
def power_iteration(
    matvec: Matvec,
    dim: int,
    k: int,
    *,
    tol: float = 1e-4,
    max_iter: int = 100,
    eps: float = _EPS64,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
) -> EigenResult:
    """The ``k`` largest (algebraic) eigenpairs by power iteration with deflation — the reference.

    Each eigenpair comes from iterating ``v ← P B v / ‖P B v‖``, ``P`` projecting out the eigenvectors found so
    far, until the residual ``‖P A v − θv‖`` (``θ = vᵀAv``) meets :func:`lanczos`'s tolerance. ``B = A`` finds
    eigenvalues by *magnitude*, the largest algebraic ones while they are non-negative; the first negative one is
    ``λ_min``, deflated, and the search goes on with the positive semi-definite ``B = A − λ_min I``.

    Arguments as :func:`lanczos`'s (``matvec`` on float64 vectors), except that ``max_iter`` counts products *per
    eigenpair*.
    """
    _check_solver_args(dim, k, tol, max_iter)
    dev = torch.device(device) if device is not None else torch.device("cpu")
    count, shift, scale, floor = 0, 0.0, 0.0, math.sqrt(eps)
    deflate: list[Tensor] = []
    pairs: list[tuple[float, Tensor, float, bool]] = []
    while len(pairs) < k and len(deflate) < dim:
        theta, y, res, ok, n = _power(matvec, dim, deflate, shift, tol, floor, scale, max_iter, generator, dev)
        count += n
        scale = max(scale, abs(theta))
        deflate.append(y)
        if theta < 0 and shift == 0.0:
            shift = -theta  # λ_min: from now on iterate with A − λ_min I
        else:
            pairs.append((theta, y, res, ok))
    if len(pairs) < k:  # every direction was deflated before k were accepted: only λ_min is left
        pairs.append((-shift, deflate[-1], 0.0, True))
    pairs.sort(key=lambda p: -p[0])
    converged = all(p[3] for p in pairs)
    result = EigenResult(
        torch.tensor([p[0] for p in pairs], dtype=torch.float64, device=dev),
        torch.stack([p[1] for p in pairs]),
        torch.tensor([p[2] for p in pairs], dtype=torch.float64, device=dev),
        count,
        converged,
        torch.tensor([p[3] for p in pairs], dtype=torch.bool, device=dev),
    )
    if not converged:
        _warn_unconverged("power iteration", result, max_iter)
    return result


def _power(
    matvec: Matvec,
    dim: int,
    found: list[Tensor],
    shift: float,
    tol: float,
    floor: float,
    scale: float,
    max_iter: int,
    generator: torch.Generator | None,
    device: torch.device,
) -> tuple[float, Tensor, float, bool, int]:
    """One deflated power iteration on ``A + shift·I``: ``(θ, v, ‖Av − θv‖, converged, products)``."""
    deflate = torch.stack(found) if found else None
    w = _random_unit(dim, generator, device)
    for i in range(max_iter):
        if deflate is not None:
            _orthogonalize(w, deflate)
        v = w / torch.linalg.vector_norm(w)
        av = matvec(v).to(torch.float64)
        theta = float(v @ av)
        if deflate is not None:  # the residual of the deflated operator P A P: errors of the
            _orthogonalize(av, deflate)  # eigenvectors found before are theirs, not this one's
        res = float(torch.linalg.vector_norm(av - theta * v))
        if res <= tol * max(abs(theta), floor * max(scale, abs(theta))):
            return theta, v, res, True, i + 1
        w = av + shift * v
    return theta, v, res, False, max_iter


def _lanczos_step(matvec: Matvec, basis: Tensor, prev: float | Tensor) -> tuple[float, Tensor]:
    """``α_j = v_jᵀ A v_j`` and ``w = A v_j − α_j v_j − Σ_i T_ij v_i`` reorthogonalized against ``basis``.

    ``basis`` holds ``v_0 … v_j`` as rows (``v_j`` last). ``prev`` is ``β_{j−1}`` (``T``'s coupling of
    ``v_j`` to ``v_{j−1}``), or after a thick restart the couplings ``σ`` of ``v_j`` to all rows before it.
    """
    v = basis[-1]
    w = matvec(v).to(basis.dtype)
    alpha = _dot(v, w)
    w -= alpha * v
    if isinstance(prev, Tensor):
        w -= basis[:-1].T @ prev.to(device=w.device, dtype=w.dtype)
    elif basis.shape[0] > 1:
        w -= prev * basis[-2]
    _orthogonalize(w, basis)
    return alpha, w


_BLOCK = 1 << 16  # entries per block of _dot and _norm: float64 temporaries of 0.5 MiB


def _dot(a: Tensor, b: Tensor) -> float:
    """``aᵀb`` accumulated in float64, a block of :data:`_BLOCK` at a time (no float64 copy of a whole vector)."""
    if a.dtype == torch.float64 and b.dtype == torch.float64:
        return float(a @ b)
    if a.numel() <= _BLOCK:
        return float(a.to(torch.float64) @ b.to(torch.float64))
    total = torch.zeros((), dtype=torch.float64, device=a.device)
    for c in range(0, a.numel(), _BLOCK):
        total += a[c : c + _BLOCK].to(torch.float64) @ b[c : c + _BLOCK].to(torch.float64)
    return float(total)


def _norm(a: Tensor) -> float:
    """``‖a‖`` accumulated in float64, by blocks as in :func:`_dot`."""
    if a.numel() <= _BLOCK or a.dtype == torch.float64:
        return float(torch.linalg.vector_norm(a, dtype=torch.float64))
    parts = torch.stack(
        [torch.linalg.vector_norm(a[c : c + _BLOCK], dtype=torch.float64) for c in range(0, a.numel(), _BLOCK)]
    )
    return float(torch.linalg.vector_norm(parts))


def lanczos_tridiagonal(
    matvec: Matvec, start: Tensor, num_steps: int, *, eps: float = _EPS64, dtype: torch.dtype = torch.float64
) -> tuple[Tensor, Tensor]:
    """``num_steps`` Lanczos steps from ``start`` (full reorthogonalization, no restart).

    Stops early when the Krylov space is invariant (``β ≤ 10 √d eps ‖T‖``, ``eps`` the relative
    precision of ``matvec``). Returns the tridiagonal ``T = Vᵀ A V`` (float64, ``m × m`` with
    ``m ≤ num_steps``) and the basis ``V`` (``m × d`` rows in ``dtype``), with ``V[0] = start/‖start‖``.
    """
    dim = start.numel()
    m_max = min(num_steps, dim)
    basis = torch.empty(m_max, dim, dtype=dtype, device=start.device)
    basis[0] = start.to(torch.float64) / _norm(start)
    alphas: list[float] = []
    betas: list[float] = []
    scale, breakdown = 0.0, _breakdown(dim, eps)
    for j in range(m_max):
        alpha, w = _lanczos_step(matvec, basis[: j + 1], betas[j - 1] if j > 0 else 0.0)
        beta = _norm(w)
        alphas.append(alpha)
        scale = max(scale, abs(alpha), beta)
        if j + 1 == m_max or beta <= breakdown * scale:
            break
        betas.append(beta)
        basis[j + 1] = w / beta
    return _tridiagonal(alphas, betas), basis[: len(alphas)]


def _orthogonalize(w: Tensor, basis: Tensor) -> None:
    """Project the rows of ``basis`` (orthonormal) out of ``w`` in place, twice."""
    for _ in range(2):
        w -= basis.T @ (basis @ w)


def _tridiagonal(alphas: list[float], betas: list[float]) -> Tensor:
    m = len(alphas)
    t = torch.diag(torch.tensor(alphas, dtype=torch.float64))
    if m > 1:
        off = torch.tensor(betas[: m - 1], dtype=torch.float64)
        t += torch.diag(off, 1) + torch.diag(off, -1)
    return t


def _random_unit(
    dim: int, generator: torch.Generator | None, device: torch.device, dtype: torch.dtype = torch.float64
) -> Tensor:
    v = torch.randn(dim, dtype=torch.float64, generator=generator)
    return (v / torch.linalg.vector_norm(v)).to(device=device, dtype=dtype)


def _check_solver_args(dim: int, k: int, tol: float, max_iter: int) -> None:
    if not isinstance(k, int) or k < 1:
        raise FlatbmaError(f"k must be a positive integer (got {k!r})")
    if k > dim:
        raise FlatbmaError(
            f"k={k} eigenvalues were asked for but the Hessian has only {dim} parameters (its dimension): "
            f"use k <= {dim}"
        )
    if not tol > 0:
        raise FlatbmaError(f"tol must be > 0 (got {tol!r})")
    if not isinstance(max_iter, int) or max_iter < 1:
        raise FlatbmaError(f"max_iter must be a positive integer (got {max_iter!r})")


def _warn_unconverged(name: str, result: EigenResult, max_iter: int) -> None:
    rel = result.residuals / result.eigenvalues.abs().clamp_min(torch.finfo(torch.float64).tiny)
    warnings.warn(
        f"{name} did not converge within max_iter={max_iter} (largest relative residual "
        f"{float(rel.max()):.2e}); raise max_iter or tol",
        ConvergenceWarning,
        stacklevel=3,
    )


def default_basis_size(k: int) -> int:
    """Lanczos vectors held at once for ``k`` Hessian eigenvalues: ``max(8, k + 3)``.

    A thick restart then keeps at least ``k + 1`` Ritz vectors and adds at least two new directions per cycle.
    """
    return max(8, k + 3)


def hessian_eigenvalues(
    model: nn.Module,
    data: Iterable[Batch] | Batch,
    k: int = 5,
    *,
    loss_fn: LossFn | None = None,
    params: ParamSelection = None,
    weights: Mapping[str, Tensor] | None = None,
    tol: float = 1e-4,
    max_iter: int = 100,
    method: EigenMethod | str = EigenMethod.LANCZOS,
    seed: int = 0,
    hvp: HVPMethod | str = HVPMethod.DOUBLE_BACKWARD,
    basis_size: int | str | None = "auto",
    chunk_size: int | str | None = "auto",
) -> Tensor:
    """The ``k`` largest eigenvalues of the Hessian of the mean training loss ``L_S`` at ``w``.

    ``λ_1 ≥ … ≥ λ_k`` of ``∇²L_S(w)`` over the chosen parameters, by :func:`lanczos` or the reference
    :func:`power_iteration` on :func:`~flatbma.flatness.hvp_fn` products. ``tol`` bounds each eigenvalue's relative
    error; those below ``√ε`` (of the parameters' dtype) times ``λ_1`` in magnitude get an absolute bound instead.

    Args:
        model: the module (see :func:`~flatbma.flatness.hvp_fn`).
        data: ``(x, y)`` (or dict) batches of the training data, or one batch.
        k: number of eigenvalues.
        loss_fn: mean loss ``loss_fn(logits, y)``; cross-entropy when ``None``.
        params: the parameters of the Hessian (a dict, a list of names, or all trainable ones).
        weights: parameters and buffers at which to evaluate, e.g. a posterior sample.
        tol: relative residual tolerance.
        max_iter: maximum number of Hessian-vector products (Lanczos) or per eigenvalue (power).
        method: :class:`EigenMethod`.
        seed: seed of the random start vector(s).
        hvp: :class:`~flatbma.flatness.HVPMethod`.
        basis_size: most Lanczos vectors held at once; ``"auto"``: :func:`default_basis_size`; ``None``: unbounded.
        chunk_size: most examples per gradient graph (:func:`~flatbma.flatness.hvp_fn`).

    Returns:
        ``(k,)`` float64 tensor, descending, on the parameters' device.

    Raises:
        FlatbmaError: on bad input (``k`` above the parameter count, empty data, unused parameters, a zero Hessian).
    """
    method = parse_choice(EigenMethod, method, "method")
    _check_solver_args(math.inf, k, tol, max_iter)
    op = hvp_fn(model, data, loss_fn=loss_fn, params=params, weights=weights, hvp=hvp, chunk_size=chunk_size)
    options = {}
    if method is EigenMethod.LANCZOS:
        rows = default_basis_size(k) if basis_size == "auto" else basis_size
        options = {"dtype": op.dtype, "vectors": False, "basis_size": rows}
    solver = lanczos if method is EigenMethod.LANCZOS else power_iteration
    result = solver(
        nonzero_checked(op),
        op.dim,
        k,
        tol=tol,
        max_iter=max_iter,
        eps=op.eps,
        generator=torch.Generator().manual_seed(seed),
        device=op.device,
        **options,
    )
    return result.eigenvalues
