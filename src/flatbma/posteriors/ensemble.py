"""Deep ensembles (Lakshminarayanan et al., NeurIPS 2017) and F-ensembles (Nguyen et al. 2023).

``M`` independently initialized networks trained on the same data; the BMA is their uniform mixture
``p(y|x) = (1/M) Σ_m softmax(f(x; w_m))``. It is :mod:`flatbma.posteriors.multi` of point estimates
(:mod:`flatbma.posteriors.point`) whose members are read as samples of the posterior, not as its closed form.
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
    ``ε^m_t = ascent.perturb(w^m_t, ∇L_B(w^m_t))`` on the same mini-batch ``B`` (``ε = 0`` without an ascent; with
    SAM this is the F-ensemble). It is ``multi.build(objective, point.build(objective, optimizer, ascent),
    members=size, seed=seed, seed_single=True)`` (:func:`flatbma.posteriors.multi.build`: initializations, the
    ``member<m>/`` state, per-member randomness, ``split``) without ``mean`` and ``marginal_variance``: the members
    are samples from separate basins, whose weight average is typically a high-loss network (docs/methods.md §3.6).
    ``sample(state, n, generator)`` returns the first ``min(n, size)`` members, whatever the generator.

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
