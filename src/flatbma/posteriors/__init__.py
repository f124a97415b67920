"""Posterior families. Each module has ``build(objective, optimizer, ascent=None, *, ...)``.

Not families of their own: ``gaussian_vi``, the reparameterized-VI step the VI families share; ``members``, the
layout, initializations and seeds of the components of ``multi`` (``ensemble`` is ``multi`` of point estimates);
``gaussians``, what the layers above ask of a posterior's Gaussian. ``fp_bma`` is low-rank VI with the Fisher-ball
ascent (:class:`flatbma.optim.FisherBall`), plus the builder with a low-rank Gaussian prior.
"""

from flatbma.posteriors import (
    bsam,
    ensemble,
    fp_bma,
    gaussian_vi,
    gaussians,
    ivon,
    laplace,
    lowrank_vi,
    mc_dropout,
    members,
    mfvi,
    multi,
    point,
    sgld,
    swag,
)

__all__ = [
    "bsam",
    "ensemble",
    "fp_bma",
    "gaussian_vi",
    "gaussians",
    "ivon",
    "laplace",
    "lowrank_vi",
    "mc_dropout",
    "members",
    "mfvi",
    "multi",
    "point",
    "sgld",
    "swag",
]
