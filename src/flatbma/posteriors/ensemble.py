"""Deep ensembles (Lakshminarayanan et al., NeurIPS 2017) and F-ensembles (Nguyen et al. 2023).

``M`` independently initialized networks trained on the same data; the BMA is their uniform mixture
``p(y|x) = (1/M) Σ_m softmax(f(x; w_m))``. It is :mod:`flatbma.posteriors.multi` of point estimates
(:mod:`flatbma.posteriors.point`), its number of members spelled ``size``, whose members are read as
samples of the posterior rather than as its closed form (:func:`build`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from flatbma.checks import check_int
from flatbma.family import Family, always
from flatbma.params import Objective
from flatbma.posteriors import multi, point
from flatbma.posteriors.members import check_member_memory, unequal_members
from flatbma.types import Ascent, GradientTransformation, Posterior


@dataclass(frozen=True)
class Options:
    """A deep ensemble's options (:func:`build`).

    Attributes:
        size: number of members ``M`` (``members`` in a config section: its alias).
        seed: seed of the members' initializations; ``None`` draws it from the global generator.
    """

    size: int = 5
    seed: int | None = None


def build(
    objective: Objective, optimizer: GradientTransformation, ascent: Ascent | None = None, **options
) -> Posterior:
    """A deep ensemble of ``size`` members, each trained like :func:`flatbma.posteriors.point.build`.

    Every member ``m`` takes the step ``w^m_{t+1} = opt(w^m_t, ∇L_B(w^m_t + ε^m_t))`` with
    ``ε^m_t = ascent.perturb(w^m_t, ∇L_B(w^m_t))`` on the same mini-batch ``B`` (``ε = 0`` without an
    ascent step; with SAM this is the F-ensemble of Nguyen et al. 2023). Diversity comes from the
    independent initializations (and dropout masks, if any); the data order is shared.

    It is the mixture ``multi.build(objective, point.build(objective, optimizer, ascent), members=size,
    seed=seed, seed_single=True)`` (:func:`flatbma.posteriors.multi.build`) without its ``mean`` and
    ``marginal_variance``; so, from there:

    * Initialization: member 0 is the given ``params``; member ``m ≥ 1`` re-initializes every fully
      trainable module of ``objective.model`` (and its BatchNorm statistics) under a seed drawn from
      ``seed`` (``None``: one integer drawn from torch's global generator at ``init``, so that runs with
      different seeds have different members, as their member 0 differs), drawn on CPU copies
      (:func:`~flatbma.posteriors.members.member_initializations`); the template module is not touched.
    * State layout: ``params["member<m>/<name>"]``, ``buffers["member<m>/<name>"]`` (each member keeps
      its own BatchNorm statistics) and ``aux["member<m>/optimizer/<key>"]`` (each its own momentum), and
      ``aux["member<m>/ascent/<key>"]`` (its own ascent memory: :func:`flatbma.posteriors.point.init_aux`).
    * Randomness of a step (dropout masks): ``update`` draws one integer ``s_t`` from torch's global
      generator and runs member ``m``'s step with the global generators seeded by a hash of ``(s_t, m)``
      (restored afterwards), so member ``m``'s draws do not depend on the other members — also for
      ``size == 1`` (``seed_single``), which ``multi`` would otherwise run as the point estimate itself, on
      the global generators: ensemble runs of one member have always been seeded like any member, and stay so.
    * ``update`` reports the mean member loss and, as logits, the ensemble's predictive log-probabilities
      ``log (1/M) Σ_m softmax(f(x; w^m))``. ``sample(state, n, generator)`` of a whole state returns the
      first ``min(n, size)`` members, each once (a point member gives its one point; a BMA over the whole
      ensemble needs ``n >= size``); the members' weights do not depend on the generator.
    * The members are the posterior's independent components (:attr:`Capabilities.members` ``= size``):
      ``split``, ``update`` and ``sample`` act on the members a state holds, which is what
      ``train.parallel: members`` spreads over processes.

    Mean and width: the members are read as ``M`` samples of the posterior — draws from the distribution
    of the trained networks over initializations, each in its own basin — not as a posterior whose
    closed form is the mixture of ``M`` Dirac masses, which is what ``multi`` of points reports (its
    ``mean`` the member average ``(1/M) Σ_m w_m``, its ``marginal_variance`` their population variance,
    divided by ``M``). An average of weights across basins is no network the ensemble holds or would
    sample (the hidden units of independently trained networks are not aligned: their weight average
    is typically a network of high loss), so there is no
    posterior mean to give in closed form, as for SG-MCMC (:attr:`~flatbma.types.Posterior.mean`). Without
    those hooks the evaluation does what it has always done for ensembles: the width is the unbiased
    variance over the BMA's distinct samples, divided by ``S − 1`` (:mod:`flatbma.flatness.width`), and
    the weights "at the mean" (``lambda1_at_mean``, :meth:`BMA.mean <flatbma.predictor.BMA.mean>`) are the
    average of the BMA's samples (:func:`flatbma.predictor.posterior_mean`) — an estimate labelled as
    such, measured where the members' average lies, not a property of any member.

    Args:
        objective: model and mini-batch loss.
        optimizer: the descent step of every member.
        ascent: the ascent step (SAM for F-ensembles), or ``None``.
        options: the fields of :class:`Options`.

    Raises:
        FlatbmaError: ``size < 1`` or a ``seed`` that is not a non-negative integer or ``None``.
    """
    o = Options(**options)
    check_int(
        o.size, f"method.size must be an integer >= 1 (the number of ensemble members), got {o.size!r}", minimum=1
    )
    members = point.build(objective, optimizer, ascent)
    mixture = multi.build(objective, members, members=o.size, seed=o.seed, seed_single=True)
    return replace(mixture, mean=None, marginal_variance=None)


FAMILY = Family(
    build, Options, check=check_member_memory, needs_weights=always, aliases={"members": "size"}, advice=unequal_members
)
"""Deep ensembles, and of SAM-trained members F-ensembles (:mod:`flatbma.methods`); ``members`` spells ``size``."""
