"""Sharpness-aware minimization (Foret et al., ICLR 2021)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from flatbma.optim.ascent import TINY, check_radius
from flatbma.params import global_norm
from flatbma.types import AscentSpace, Params


@dataclass(frozen=True)
class SAM:
    """SAM ascent step: ``ε = ρ g / ‖g‖₂`` (the first-order solution of ``max_{‖ε‖≤ρ} L(w+ε)``).

    Attributes:
        space: :attr:`~flatbma.types.AscentSpace.WEIGHTS`: the step perturbs weights.
        rho: neighbourhood radius ρ.
    """

    space: ClassVar[AscentSpace] = AscentSpace.WEIGHTS

    rho: float = 0.05

    def __post_init__(self) -> None:
        check_radius(self.rho)

    @torch.no_grad()
    def perturb(self, params: Mapping[str, Tensor], grads: Mapping[str, Tensor]) -> Params:
        """Return ``ε = ρ g / ‖g‖``."""
        scale = self.rho / (global_norm(grads) + TINY)
        return {k: g * scale for k, g in grads.items()}
