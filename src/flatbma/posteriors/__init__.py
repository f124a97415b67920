"""Posterior families. Each module has ``build(objective, optimizer, ascent=None, *, ...)``.

``laplace`` is a point estimate's MAP phase followed by a curvature pass (:mod:`flatbma.curvature`).
``fp_bma`` is low-rank VI composed with the Fisher-ball ascent (:class:`flatbma.optim.FisherBall`);
it adds the builder with a low-rank Gaussian prior. ``gaussian_vi`` is the reparameterized-VI
machinery the VI families share; ``members`` the layout, initializations and seeds of the independent
components of ``multi`` (a mixture of any family; ``ensemble`` is ``multi`` of point estimates);
``gaussians`` what the layers above ask of a posterior's Gaussian (:attr:`~flatbma.types.Capabilities.gaussian`).
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
