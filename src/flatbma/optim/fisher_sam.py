"""Fisher SAM (Kim et al., ICML 2022)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from flatbma.errors import FlatbmaError
from flatbma.optim.ascent import TINY, check_radius
from flatbma.params import dot
from flatbma.types import AscentSpace, Params


@dataclass(frozen=True)
class FisherSAM:
    """Fisher-SAM ascent step with the diagonal data Fisher ``F = 1 + η g⊙g``.

    ``ε = ρ F⁻¹g / √(gᵀF⁻¹g)``: the maximizer of the linearized loss over the Fisher ellipsoid
    ``εᵀFε ≤ ρ²`` (so ``εᵀFε = ρ²`` exactly), i.e. SAM in the information geometry.

    Attributes:
        space: :attr:`~flatbma.types.AscentSpace.WEIGHTS`: the step perturbs weights.
        rho: radius ρ of the Fisher ball.
        eta: η, weight of the empirical Fisher ``g⊙g``; ``eta=0`` recovers SAM.
    """

    space: ClassVar[AscentSpace] = AscentSpace.WEIGHTS

    rho: float = 0.1
    eta: float = 1.0

    def __post_init__(self) -> None:
        check_radius(self.rho)
        if not self.eta >= 0:
            raise FlatbmaError(f"eta must be >= 0 (Fisher-SAM's weight in F = 1 + eta g²), got {self.eta!r}")

    @torch.no_grad()
    def perturb(self, params: Mapping[str, Tensor], grads: Mapping[str, Tensor]) -> Params:
        """Return ``ε = ρ F⁻¹g / √(gᵀF⁻¹g)``."""
        fg = {k: g / (1 + self.eta * g * g) for k, g in grads.items()}
        quad = dot(fg, grads)
        scale = self.rho / (quad.sqrt() + TINY)
        return {k: v * scale for k, v in fg.items()}
