"""Accuracy of FisherBall's conjugate-gradient Fisher solve, block by block, against a dense solve.

For small low-rank plus diagonal Gaussians (``d`` up to 300) the damped natural gradient
``x = (F + λB)⁺ g`` is computed densely — the covariance Fisher assembled column by column, the pseudo-
inverse applied to ``g`` with its rotation component removed, the mean block ``Σ g_μ`` — and compared
with :func:`flatbma.optim.fisher_ball.natural_gradient` for fixed iteration counts and for residual
tolerances (with a cap). Printed: the worst cosine over the grid of every block (mean, log σ, factor L)
and the CG iterations used; the ``auto`` rows are FisherBall's default ``precision: auto`` (``f32``: the
problems solved on float32 operands, where ``float32_error`` ≤ ``cg_tol``), the others float64. The grid:
factor/σ ratios 0.01–3; σ spread over e^[−8, −1], e^[−6, −3] or constant; single-sample reparameterized
gradients (the FP-BMA case: ``g_logσ ∝ σ``) and Gaussian ones; and "heterogeneous" problems whose factor/σ
ratio and gradient scale vary by e^(±1.5) per coordinate, with σ at a floor for 29 of 30 coordinates (a
fitted SWAG prior with ``prior.min_std``).

    python bench/fisher_ball_cg.py [--seeds 3] [--damping 0.01]
"""

from __future__ import annotations

import argparse
import math
import statistics

import torch

from flatbma.gaussian import dense_covariance, geometry
from flatbma.optim.fisher_ball import (
    _rotation,
    covariance_fisher_product,
    damping_scale,
    float32_error,
    natural_gradient,
    solve_covariance_fisher,
)

FIXED = (1, 2, 3, 4, 6, 8, 12)
TOLERANCES = ((1e-2, 20), (3e-3, 20), (1e-3, 20), (1e-3, 30))
BLOCKS = ("mean", "log_std", "factor")


def problem(d: int, k: int, ratio: float, seed: int, kind: str) -> tuple[dict, dict]:
    """``θ = (μ, log σ, L)`` with factor entries ~ ``ratio·σ`` and a gradient, in double precision.

    ``kind``: ``"<sigma>/<gradient>"`` with sigma ``wide`` (log σ ~ U[−8, −1]), ``mid`` (U[−6, −3]),
    ``flat`` (−4) or ``hetero`` (floored at 0.01 but for 1 in 30, per-coordinate ratio and gradient scale
    times e^(1.5·N(0, 1))), gradient ``reparam`` (one reparameterized sample) or ``gauss``.
    """
    g = torch.Generator().manual_seed(seed)
    sigma_kind, grad_kind = kind.split("/")
    if sigma_kind == "hetero":
        log_std = torch.full((d,), math.log(0.01), dtype=torch.float64)
        log_std[: max(d // 30, 1)] += 3 * torch.rand(max(d // 30, 1), generator=g, dtype=torch.float64)
        coord = ratio * torch.exp(1.5 * torch.randn(d, generator=g, dtype=torch.float64))
        scale = torch.exp(1.5 * torch.randn(d, generator=g, dtype=torch.float64))
    else:
        lo, hi = {"wide": (-8, -1), "mid": (-6, -3), "flat": (-4, -4)}[sigma_kind]
        log_std = torch.rand(d, generator=g, dtype=torch.float64) * (hi - lo) + lo
        coord, scale = torch.full((d,), ratio, dtype=torch.float64), torch.ones(d, dtype=torch.float64)
    sigma = log_std.exp()
    theta = {
        "mean/w": torch.randn(d, generator=g, dtype=torch.float64),
        "log_std/w": log_std,
        "factor/w": torch.randn(k, d, generator=g, dtype=torch.float64) * sigma * coord,
    }
    if grad_kind == "gauss":
        grads = {key: torch.randn(v.shape, generator=g, dtype=torch.float64) * scale for key, v in theta.items()}
    else:  # w = μ + (σ⊙z₁ + Lz₂/√(K−1))/√2: pull a data gradient g_w back to θ
        g_w = torch.randn(d, generator=g, dtype=torch.float64) * scale
        z1 = torch.randn(d, generator=g, dtype=torch.float64)
        z2 = torch.randn(k, generator=g, dtype=torch.float64)
        grads = {
            "mean/w": g_w,
            "log_std/w": g_w * sigma * z1 / math.sqrt(2),
            "factor/w": z2[:, None] * g_w[None] / math.sqrt(2 * (k - 1)),
        }
    return theta, grads


def dense_natural_gradient(theta: dict, grads: dict, damping: float) -> dict[str, torch.Tensor]:
    """``Σ g_μ`` and ``(F_cov + λB)⁺ P g_cov`` (``P`` removes the rotations of L), by dense algebra."""
    geo = geometry(theta, torch.float64, cache=False)
    k, d = geo.u.shape
    n = (k + 1) * d
    columns = torch.eye(n, dtype=torch.float64).reshape(n, k + 1, d)
    fisher = torch.stack([covariance_fisher_product(geo, e).reshape(-1) for e in columns], dim=1)
    matrix = fisher + damping * torch.diag(damping_scale(geo).reshape(-1))
    g_cov = torch.cat([grads["log_std/w"][None], grads["factor/w"]])
    g_cov = g_cov - torch.cat([torch.zeros(1, d, dtype=torch.float64), _rotation(geo.u, g_cov[1:]) @ geo.u])
    x = (torch.linalg.pinv(matrix, hermitian=True) @ g_cov.reshape(-1)).reshape(k + 1, d)
    return {"mean": dense_covariance(theta) @ grads["mean/w"], "log_std": x[0], "factor": x[1:]}


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """Cosine of two tensors (1 when both vanish)."""
    na, nb = float(a.norm()), float(b.norm())
    return 1.0 if na == nb == 0 else float((a * b).sum()) / (na * nb + 1e-300)


def grid(seeds: int) -> list[tuple[int, int, float, int, str]]:
    """``(d, K, ratio, seed, kind)`` of every problem measured."""
    cases = []
    for d, k in ((12, 2), (30, 3), (60, 5), (200, 5), (100, 10)):
        for kind in ("wide/reparam", "mid/reparam", "flat/reparam", "wide/gauss", "flat/gauss"):
            cases += [(d, k, r, s, kind) for r in (0.01, 0.03, 0.1, 0.3, 1.0, 3.0) for s in range(seeds)]
    for d, k in ((30, 5), (300, 5)):
        cases += [(d, k, r, s, "hetero/reparam") for r in (0.01, 0.1, 0.3, 1.0, 3.0) for s in range(seeds)]
    return cases


def measure(seeds: int, damping: float) -> dict[str, dict]:
    """Worst cosine per block and iterations per solver setting, over :func:`grid`."""
    settings = {f"fixed {n}": (n, 0.0, "float64") for n in FIXED}
    settings.update({f"tol {tol:g}, cap {cap}": (cap, tol, "float64") for tol, cap in TOLERANCES})
    settings.update({f"tol {tol:g}, cap {cap}, auto": (cap, tol, "auto") for tol, cap in TOLERANCES})
    out = {name: {"worst": dict.fromkeys(BLOCKS, 1.0), "where": {}, "iterations": []} for name in settings}
    for d, k, ratio, seed, kind in grid(seeds):
        theta, grads = problem(d, k, ratio, seed, kind)
        exact = dense_natural_gradient(theta, grads, damping)
        geo = geometry(theta, torch.float64, cache=False)
        g_cov = torch.cat([grads["log_std/w"][None], grads["factor/w"]])
        g_cov = g_cov - torch.cat([torch.zeros(1, d, dtype=torch.float64), _rotation(geo.u, g_cov[1:]) @ geo.u])
        for name, (cap, tol, precision) in settings.items():
            x, _ = natural_gradient(theta, grads, damping=damping, cg_iters=cap, cg_tol=tol, precision=precision)
            record = out[name]
            single = precision == "auto" and tol > 0 and float32_error(geo, damping) <= tol
            work = torch.float32 if single else None
            record["iterations"].append(
                solve_covariance_fisher(geo, g_cov, damping=damping, cg_iters=cap, cg_tol=tol, dtype=work).iterations
            )
            record["float32"] = record.get("float32", 0) + single
            for block in BLOCKS:
                c = cosine(x[f"{block}/w"], exact[block])
                if c < record["worst"][block]:
                    record["worst"][block] = c
                    record["where"][block] = f"d={d} K={k} factor/σ={ratio:g} {kind} seed {seed}"
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--damping", type=float, default=1e-2)
    args = parser.parse_args()
    print(f"{len(grid(args.seeds))} problems, damping {args.damping:g}; worst cosine to the dense solve")
    print(f"{'solver':<26}{'mean':>8}{'log σ':>8}{'L':>8}{'iters median':>14}{'max':>6}{'f32':>5}  worst case (log σ)")
    for name, record in measure(args.seeds, args.damping).items():
        w, its = record["worst"], record["iterations"]
        print(
            f"{name:<26}{w['mean']:>8.3f}{w['log_std']:>8.3f}{w['factor']:>8.3f}"
            f"{statistics.median(its):>14g}{max(its):>6}{record.get('float32', 0):>5}"
            f"  {record['where'].get('log_std', '')}"
        )


if __name__ == "__main__":
    main()
