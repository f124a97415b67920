"""Bayesian SAM (bSAM; Möllenhoff & Khan, "SAM as an Optimal Relaxation of Bayes", ICLR 2023).

A diagonal Gaussian ``q(w) = N(m, diag(1/(N s)))`` trained by the paper's Algorithm 1 (docs/methods.md §4.4):

    ``w = m + e``,  ``e ~ N(0, diag(1/(N s)))``               noisy weights
    ``g = ∇L_B(w)``                                            gradient at the noisy weights
    ``ε = ρ g / s``                                            preconditioned SAM ascent
    ``g_ε = ∇L_B(m + ε)``                                      gradient at the perturbed mean
    ``g_m ← β₁ g_m + (1 − β₁)(g_ε + δ m)``                     momentum
    ``s ← β₂ s + (1 − β₂)(√s ⊙ |g| + δ + γ)``                  precision
    ``m ← m − α_t g_m / s``

elementwise, where ``N = data_factor · objective.num_data`` (the authors use 4 on augmented CIFAR), ``δ = λ₀ / N``
for the prior ``N(0, I/λ₀)``, ``γ`` the damping and ``α_t = optimizer.learning_rate(step)``, the only thing bSAM
takes from ``optimizer``; ``ρ`` is its own ascent step. The mean is updated with the new ``s``. BatchNorm statistics
are updated by the first (noisy) pass only. ``θ = {"mean/<name>": m, "precision/<name>": s}``; ``aux`` holds the
momentum ``"bsam/momentum/<name>"`` (:class:`Momentum`) and the noise seed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, NamedTuple

import torch
from torch import Tensor

from flatbma.checks import check_number
from flatbma.errors import FlatbmaError
from flatbma.family import Family, Section
from flatbma.gaussian import check_sections, is_theta, section, standard_normal_like
from flatbma.named import entries, nest, part, typed
from flatbma.params import Objective, clone
from flatbma.rng import SEED_KEY, new_seed, seeded_generator
from flatbma.types import Ascent, Batch, GradientTransformation, Params, Posterior, State, StepOutput

PREFIXES = ("mean", "precision")
NAME = "bsam"
"""The component bSAM keeps its :class:`Momentum` under in ``aux`` (:mod:`flatbma.named`): ``bsam/momentum/<name>``."""


class Momentum(NamedTuple):
    """bSAM's own state (component :data:`NAME` of ``aux``): ``momentum``, ``g_m`` by weight name."""

    momentum: dict[str, Tensor]


def _check(name: str, value: float, low: float, high: float = float("inf"), *, closed_low: bool) -> None:
    bound = f"in [{low}, {high})" if closed_low else f"in ({low}, {high})"
    message = f"method.{name} must be a number {bound} (got {value!r})"
    check_number(value, message, low=low, low_open=not closed_low, high=high, high_open=True)


def posterior_std(theta: Mapping[str, Tensor], num_data: float) -> Params:
    """``σ = 1/√(N s)`` by parameter name, with ``N`` the effective data-set size."""
    return {k: torch.rsqrt(num_data * s) for k, s in section(theta, "precision").items()}


@dataclass(frozen=True)
class Options:
    """bSAM's options (:func:`build`); the defaults are those of the paper's Algorithm 1 and the authors' CIFAR-10 run.

    Attributes:
        rho: ``ρ``, the SAM radius in the precision-scaled ascent ``ε = ρ g / s`` (0 gives the noisy
            natural-gradient update without SAM).
        prior_precision: ``λ₀`` of the prior ``N(0, I/λ₀)``; ``δ = λ₀/N``.
        beta1: momentum ``β₁`` of the gradient.
        beta2: decay ``β₂`` of the precision.
        damping: ``γ > 0``, added to the precision update (keeps ``s`` away from 0).
        init_precision: ``s₀``, the initial precision scale (posterior variance ``1/(N s₀)``).
        data_factor: multiplies ``objective.num_data`` to give ``N`` (augmentation heuristic).
    """

    rho: float = 0.01
    prior_precision: float = 10.0
    beta1: float = 0.9
    beta2: float = 0.999
    damping: float = 0.1
    init_precision: float = 1.0
    data_factor: float = 1.0


def build(
    objective: Objective, optimizer: GradientTransformation, ascent: Ascent | None = None, **options
) -> Posterior:
    """Bayesian SAM (Möllenhoff & Khan 2023, Algorithm 1); the update is in the module docstring.

    The authors' CIFAR-10 learning rate is ``α = 0.5`` with a cosine schedule. ``s`` only decays from ``s₀``
    at rate ``1 − β₂``, so early steps are ``≈ α(1 − β₁)·g/s₀``-sized: short runs need a larger ``α``.

    Raises:
        FlatbmaError: an ``ascent``, an optimizer without ``learning_rate``, or an option out of range.
    """
    o = Options(**options)
    if ascent is not None:
        raise FlatbmaError("bsam has its own SAM-type ascent step (set method.rho); it takes no separate ascent")
    learning_rate = getattr(optimizer, "learning_rate", None)
    if not callable(learning_rate):
        raise FlatbmaError(f"bsam needs an optimizer with a learning_rate(step) schedule, got {type(optimizer)}")
    _check("rho", o.rho, 0.0, closed_low=True)
    _check("prior_precision", o.prior_precision, 0.0, closed_low=True)
    _check("beta1", o.beta1, 0.0, 1.0, closed_low=True)
    _check("beta2", o.beta2, 0.0, 1.0, closed_low=True)
    _check("damping", o.damping, 0.0, closed_low=False)
    _check("init_precision", o.init_precision, 0.0, closed_low=False)
    _check("data_factor", o.data_factor, 0.0, closed_low=False)
    n_eff = float(o.data_factor) * objective.num_data
    return Posterior(
        init=partial(init, options=o),
        update=partial(update, options=o, objective=objective, learning_rate=learning_rate, num_data=n_eff),
        sample=partial(sample, num_data=n_eff),
        recompute_bn=True,
        mean=mean,
        marginal_variance=partial(marginal_variance, num_data=n_eff),
    )


def init(params: Params, buffers: Params, *, options: Options) -> State:
    """``θ = (m = w, s = s₀)`` (or ``params`` itself when it is a ``θ``), zero momentum and the noise seed."""
    seed = new_seed()
    if is_theta(params):
        theta = clone(params)
        check_sections(theta, PREFIXES, "bsam")
    else:
        theta = {f"mean/{k}": v.detach().clone() for k, v in params.items()}
        theta.update({f"precision/{k}": torch.full_like(v, float(options.init_precision)) for k, v in params.items()})
    m = section(theta, "mean")
    aux = nest(NAME, entries(Momentum({k: torch.zeros_like(v) for k, v in m.items()})))
    aux[SEED_KEY] = seed.to(next(iter(m.values())).device)
    return State(params=theta, buffers=clone(buffers), aux=aux)


def update(
    state: State,
    batch: Batch,
    *,
    options: Options,
    objective: Objective,
    learning_rate: Callable[[int], float],
    num_data: float,
) -> tuple[State, StepOutput]:
    """One step of Algorithm 1 (the module docstring), in place, with ``N = num_data``."""
    o = options
    delta = float(o.prior_precision) / num_data
    m, prec = section(state.params, "mean"), section(state.params, "precision")
    std = posterior_std(state.params, num_data)
    device = next(iter(m.values())).device
    z = standard_normal_like(m, seeded_generator(state.aux[SEED_KEY], state.step, device))
    with torch.no_grad():
        noisy = {k: m[k] + std[k] * z[k] for k in m}
    loss, logits, g = objective.value_and_grad(noisy, state.buffers, batch)
    with torch.no_grad():
        perturbed = {k: m[k] + o.rho * g[k] / prec[k] for k in m}
    _, _, g_eps = objective.value_and_grad(perturbed, state.buffers, batch, update_buffers=False)
    lr = learning_rate(state.step)
    momentum = typed(Momentum, part(NAME, state.aux)).momentum
    with torch.no_grad():
        for k in m:
            gm = momentum[k]
            gm.mul_(o.beta1).add_(g_eps[k] + delta * m[k], alpha=1 - o.beta1)
            s = prec[k]
            target = s.sqrt() * g[k].abs() + (delta + o.damping)
            s.mul_(o.beta2).add_(target, alpha=1 - o.beta2)
            m[k].addcdiv_(gm, s, value=-lr)
    return replace(state, step=state.step + 1), StepOutput(loss, logits)


@torch.no_grad()
def sample(state: State, n: int, generator: torch.Generator | None = None, *, num_data: float) -> list[Params]:
    """``n`` draws ``w = m + z/√(N s)``, ``z ~ N(0, I)``, with the buffers."""
    m = section(state.params, "mean")
    std = posterior_std(state.params, num_data)
    out = []
    for _ in range(n):
        z = standard_normal_like(m, generator)
        out.append({**{k: m[k] + std[k] * z[k] for k in m}, **clone(state.buffers)})
    return out


def mean(state: State) -> Params:
    """``m``, with the buffers."""
    return {**{k: v.detach().clone() for k, v in section(state.params, "mean").items()}, **clone(state.buffers)}


def marginal_variance(state: State, *, num_data: float) -> Params:
    """``1/(N s)``, exactly the sampler's."""
    return {k: v.detach() ** 2 for k, v in posterior_std(state.params, num_data).items()}


def advice(method: Section, prior: bool, diagnostics: Mapping[str, Any]) -> str:
    """What to change when bSAM's BMA is worse than its mean (:attr:`Family.advice`): a larger data factor."""
    factor = method.options["data_factor"]
    return f"data_factor: {factor * 10:g} (now {factor:g})"


FAMILY = Family(build, Options, advice=advice)
"""Bayesian SAM (:mod:`flatbma.methods`)."""
