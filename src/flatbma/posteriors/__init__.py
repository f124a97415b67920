"""Posterior families. Each module has ``build(objective, optimizer, ascent=None, *, ...)``."""

from flatbma.posteriors import bsam, ensemble, gaussian_vi, lowrank_vi, mc_dropout, mfvi, point, sgld, swag

__all__ = ["bsam", "ensemble", "gaussian_vi", "lowrank_vi", "mc_dropout", "mfvi", "point", "sgld", "swag"]
