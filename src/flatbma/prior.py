"""The ``prior`` section of a two-stage run, parsed once: the first stage's method, epochs, optimizer and floor.

:func:`flatbma.fit_posterior` (``prior=``) and ``flatbma train`` run it, refusing a learning rate the KL to the
fitted prior makes diverge (:func:`check_lr_with_prior`). Methods are known through the registry
(:attr:`~flatbma.family.Family.gaussian`, :meth:`~flatbma.methods.MethodConfig.takes_prior`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from flatbma.checks import check_positive
from flatbma.errors import FlatbmaError
from flatbma.methods import METHODS, MethodConfig, parse_method, prior_methods
from flatbma.optim.config import OptimConfig, Optimizer
from flatbma.options import parse_dataclass, plain, plain_values

RANK_OPTION = "rank"
"""The family option holding the number ``K`` of low-rank columns of every Gaussian posterior (SWAG, low-rank VI,
FP-BMA); a second stage started at the fitted posterior (``prior.init``) must have the first stage's ``K``."""


@dataclass(frozen=True)
class PriorConfig:
    """The first stage of a two-stage run: a Gaussian posterior fitted on the run's (target) data.

    It becomes the prior ``p`` in ``KL(q_θ ‖ p)`` and the run's initialization: SWAG → FP-BMA with the SWAG prior
    → BMA (Lim et al., UAI 2025; docs/methods.md §6).
    The stage trains into ``<output_dir>/prior``, reused when finished with the same config.

    Attributes:
        method: the first stage's method, a low-rank plus diagonal Gaussian, e.g. ``{name: swag, rank: 5}``.
            For a mixture the first stage is a mixture of it with the run's members and seed, one prior per
            member (:meth:`~flatbma.methods.MethodConfig.first_stage`).
        epochs: training epochs of the first stage.
        optim: the first stage's optimizer; the run's ``optim`` section when ``None``.
        init: start the run's method at the fitted posterior (its ``method.rank`` must then equal the first
            stage's, which needs a low-rank part); otherwise only the prior is used.
        min_std: floor of the fitted Gaussian's diagonal standard deviations ``σ`` (prior and start), which keeps
            SGD on the KL stable (:func:`flatbma.prior.sgd_stability_bound`; why: docs/methods.md §6).
    """

    method: MethodConfig
    epochs: int = 10
    optim: OptimConfig | None = None
    init: bool = True
    min_std: float = 0.01

    def __post_init__(self) -> None:
        check_positive("prior.epochs", self.epochs)
        check_positive("prior.min_std", self.min_std)

    def to_dict(self) -> dict[str, Any]:
        """The resolved section."""
        return {
            "method": plain_values(self.method.to_dict()),
            "epochs": self.epochs,
            "optim": plain(self.optim) if self.optim is not None else None,
            "init": self.init,
            "min_std": self.min_std,
        }


@dataclass(frozen=True)
class _PriorSection:
    """The keys of the ``prior`` section: ``method`` and ``optim`` as written (parsed later), the others typed."""

    method: Any = None
    epochs: int = PriorConfig.epochs
    optim: Any = None
    init: bool = PriorConfig.init
    min_std: float = PriorConfig.min_std


def gaussian_methods() -> list[str]:
    """Names of the methods whose posterior is a low-rank plus diagonal Gaussian (a ``prior`` stage)."""
    return [name for name, spec in METHODS.items() if spec.family.gaussian]


def parse_prior(data: Any, method: MethodConfig) -> PriorConfig | None:
    """Parse the ``prior`` section (``None`` or absent: a one-stage run) for the run's ``method``."""
    if data is None:
        return None
    rest = parse_dataclass(_PriorSection, data, "prior") if isinstance(data, dict) else None  # unknown keys
    if rest is None or rest.method is None:
        raise FlatbmaError(
            "prior must be a mapping with a 'method' key, e.g. prior: {method: {name: swag, rank: 5}, epochs: 10}"
        )
    spec = METHODS[method.name]
    if spec.family.prior_refusal is not None:
        raise FlatbmaError(f"method {method.name!r} takes no prior section: {spec.family.prior_refusal}")
    inner = method.component()  # a mixture's members' method (multi: method.of), else the method itself
    if inner is None:
        raise FlatbmaError("method.of must name the members' method, e.g. of: {name: fp-bma} (see 'flatbma methods')")
    key = "method" if inner is method else "method.of"
    if not method.takes_prior():
        raise FlatbmaError(
            f"{key} {inner.name!r} takes no Gaussian prior, so the prior section does not apply to it: use one of "
            f"{', '.join(prior_methods())} or remove the prior section"
        )
    stage = parse_method(rest.method, "prior.method")
    if not METHODS[stage.name].family.gaussian:
        raise FlatbmaError(not_gaussian_message(stage.name))
    optim = parse_dataclass(OptimConfig, rest.optim, "prior.optim") if rest.optim is not None else None
    ranks = (inner.options.get(RANK_OPTION), stage.options.get(RANK_OPTION))
    if rest.init and RANK_OPTION not in stage.options:  # a Gaussian family without a rank is diagonal (IVON)
        raise FlatbmaError(
            f"prior.init starts {method.name} at the fitted prior, but prior.method {stage.name!r} fits a diagonal "
            "Gaussian (no low-rank factor to start from): set prior.init: false (its posterior is then the prior only)"
        )
    if rest.init and None not in ranks and ranks[0] != ranks[1]:
        raise FlatbmaError(
            f"prior.init starts {method.name} at the fitted prior, so {key}.rank ({ranks[0]}) must equal "
            f"prior.method.rank ({ranks[1]}): set both to the same K, or prior.init: false"
        )
    return PriorConfig(method=stage, epochs=rest.epochs, optim=optim, init=rest.init, min_std=rest.min_std)


def not_gaussian_message(name: str) -> str:
    """The error for a ``prior.method`` whose posterior is no low-rank plus diagonal Gaussian."""
    return (
        f"prior.method {name!r} is not a low-rank plus diagonal Gaussian posterior, so it cannot serve as "
        f"a prior: use one of {', '.join(gaussian_methods())}"
    )


def sgd_stability_bound(
    num_data: int, min_std: float, kl_weight: float, *, momentum: float = 0.0, nesterov: bool = False
) -> float:
    """The largest SGD learning rate at which descent on ``κ·KL(q ‖ p)/n`` in ``μ`` does not diverge.

    With the prior ``p = N(μ_p, Σ_p)``, ``Σ_p = ½(diag σ² + LLᵀ/(K−1)) ⪰ ½ s² I`` (``s = min_std``), the KL's
    Hessian in ``μ`` is ``(κ/n)Σ_p⁻¹`` with ``λ_max ≤ 2κ/(n s²)`` (equality once more than ``K`` coordinates sit
    at the floor). On a quadratic of curvature ``λ``, heavy-ball SGD with momentum ``β`` (PyTorch's convention)
    is stable iff ``lr·λ < 2(1 + β)``, Nesterov's iff ``lr·λ < 2(1 + β)/(1 + 2β)``, so the bound is

        ``n s²/κ · (1 + β)``  (heavy ball),  ``n s²/κ · (1 + β)/(1 + 2β)``  (Nesterov),

    ``n s²/κ`` for ``β = 0`` and ``∞`` for ``κ = 0``. Weight decay and the data loss add curvature, not counted.
    """
    if kl_weight <= 0:
        return math.inf
    factor = (1 + momentum) / (1 + 2 * momentum) if nesterov else 1 + momentum
    return factor * num_data * min_std**2 / kl_weight


def check_lr_with_prior(prior: PriorConfig, optim: OptimConfig, method: MethodConfig, num_data: int) -> None:
    """Refuse an SGD learning rate that the KL to the fitted prior makes diverge (before stage 1 trains).

    The bound is :func:`sgd_stability_bound` for ``n = num_data``, ``prior.min_std``, ``κ`` the method's (or a
    mixture's members') ``kl_weight`` and the run's momentum, checked against the peak ``optim.lr``; Adam is
    not checked.
    """
    o = optim
    component = method.component()
    assert component is not None  # parse_prior refuses a mixture without members' method
    kl_weight = float(component.options["kl_weight"])
    bound = sgd_stability_bound(num_data, prior.min_std, kl_weight, momentum=o.momentum, nesterov=o.nesterov)
    if o.name is Optimizer.SGD and o.lr > bound:
        factor = "(1+m)/(1+2m)" if o.nesterov else "(1+m)"
        raise FlatbmaError(
            f"optim.lr={o.lr:g} is above {bound:.3g} = {factor}·n·prior.min_std²/kl_weight (n={num_data}, "
            f"m=optim.momentum={o.momentum:g}), where SGD on the KL to the fitted prior diverges: lower "
            "optim.lr, raise prior.min_std, or use optim.name=adam"
        )
