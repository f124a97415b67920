"""A posterior's Gaussian (:attr:`~flatbma.types.Capabilities.gaussian`) as the layers above use it, never by its keys.

A low-rank plus diagonal Gaussian posterior gives its ``θ`` (the layout of :mod:`flatbma.gaussian`); a mixture of
them (:mod:`flatbma.posteriors.multi`) gives every member's ``θ_m`` under that member's prefix. The experiment layer
reads no key of ``θ`` or of a state itself, only these functions.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace

import torch
from torch import Tensor

from flatbma.errors import FlatbmaError
from flatbma.gaussian import kl_lowrank, marginal_variance, scale_covariance
from flatbma.posteriors.lowrank_vi import fixed
from flatbma.posteriors.members import member, prefixed_members, unprefixed
from flatbma.types import Params, Posterior, State

__all__ = ["components", "covariance_trace", "floored", "kl_moved", "rescaled", "start"]


def components(theta: Mapping[str, Tensor]) -> list[Params]:
    """The ``θ`` of each component: a mixture's members' ``θ_m`` (member-prefixed), in member order; else ``[θ]``."""
    held = prefixed_members(dict(theta))
    return [dict(theta)] if held is None else [member(m, dict(theta)) for m in held]


def start(posterior: Posterior, state: State) -> list[Params] | None:
    """Copies of the Gaussians of ``posterior`` at ``state`` (one per component, :func:`components`), to compare later.

    ``None`` when the posterior has no Gaussian or the state holds none yet (SWAG's, formed from snapshots, does not
    exist in a fresh state; a variational family's does).
    """
    if posterior.can.gaussian is None:
        return None
    try:
        theta = posterior.can.gaussian(state)
    except FlatbmaError:
        return None
    return [{k: v.detach().clone() for k, v in c.items()} for c in components(theta)]


def kl_moved(posterior: Posterior, state: State, begin: list[Params]) -> float:
    """``KL(q_T ‖ q_0)`` of the Gaussian at ``state`` from ``begin`` (:func:`start`); a mixture's: the member mean.

    Raises:
        FlatbmaError: the posterior has no Gaussian.
    """
    if posterior.can.gaussian is None:
        raise FlatbmaError("the posterior has no Gaussian to compare with its start")
    end = components(posterior.can.gaussian(state))
    kls = [float(kl_lowrank({k: v.detach() for k, v in e.items()}, b)) for e, b in zip(end, begin, strict=True)]
    return sum(kls) / len(kls)


def floored(theta: Mapping[str, Tensor], min_std: float) -> Params:
    """``θ`` (a Gaussian's, or a mixture's: every member's) with every ``log_std/`` entry clamped at ``log min_std``."""
    floor = math.log(min_std)
    return {k: v.clamp_min(floor) if unprefixed(k).startswith("log_std/") else v for k, v in theta.items()}


def covariance_trace(posterior: Posterior, state: State) -> float:
    """``tr Σ`` of the posterior's Gaussian at ``state`` (its closed-form marginal variances, summed in float64).

    Raises:
        FlatbmaError: the posterior has no Gaussian.
    """
    theta = _gaussian(posterior, state)
    return float(sum(v.to(torch.float64).sum() for v in marginal_variance(theta).values()))


def rescaled(posterior: Posterior, state: State, factor: float) -> tuple[Posterior, State]:
    """``N(μ, factor·Σ)`` of the posterior's Gaussian at ``state``, as a posterior to measure (not to train).

    The scaled ``θ`` (:func:`flatbma.gaussian.scale_covariance`) is sampled by the low-rank family's sampler, with
    ``state``'s buffers and ``posterior``'s prediction mode (:func:`flatbma.posteriors.lowrank_vi.fixed`).

    Raises:
        FlatbmaError: the posterior has no Gaussian.
        ValueError: ``factor`` is not finite and positive.
    """
    fixed_posterior, fixed_state = fixed(scale_covariance(_gaussian(posterior, state), factor), state.buffers)
    return replace(fixed_posterior, predict_mode=posterior.predict_mode), fixed_state


def _gaussian(posterior: Posterior, state: State) -> Params:
    if posterior.can.gaussian is None:
        raise FlatbmaError("the posterior has no low-rank plus diagonal Gaussian (its gaussian is None)")
    return posterior.can.gaussian(state)
