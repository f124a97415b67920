"""Posterior families. Each module has ``build(objective, optimizer, ascent=None, *, ...)``."""

from flatbma.posteriors import point

__all__ = ["point"]
