"""Adaptive SAM (Kwon et al., ICML 2021)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from flatbma.errors import FlatbmaError
from flatbma.optim.ascent import TINY, check_radius
from flatbma.params import global_norm
from flatbma.types import AscentSpace, Params


@dataclass(frozen=True)
class ASAM:
    """ASAM ascent step with the element-wise normalization operator ``T_w = |w| + η``.

    ``ε = ρ T_w² g / ‖T_w g‖₂`` — the maximizer of the linearized loss over the ellipsoid
    ``‖T_w⁻¹ ε‖ ≤ ρ``, which makes the sharpness invariant to parameter re-scaling.

    Attributes:
        space: :attr:`~flatbma.types.AscentSpace.WEIGHTS`: the step perturbs weights.
        rho: radius ρ in the normalized space (ASAM's usual value is 10× SAM's).
        eta: η, keeps zero weights perturbable; ``eta=0`` gives ``T_w = |w|`` exactly.
    """

    space: ClassVar[AscentSpace] = AscentSpace.WEIGHTS

    rho: float = 0.5
    eta: float = 0.01

    def __post_init__(self) -> None:
        check_radius(self.rho)
        if not self.eta >= 0:
            raise FlatbmaError(f"eta must be >= 0 (ASAM's offset in T_w = |w| + eta), got {self.eta!r}")

    @torch.no_grad()
    def perturb(self, params: Mapping[str, Tensor], grads: Mapping[str, Tensor]) -> Params:
        """Return ``ε = ρ T² g / ‖T g‖``."""
        t = {k: params[k].abs() + self.eta for k in grads}
        tg = {k: t[k] * grads[k] for k in grads}
        scale = self.rho / (global_norm(tg) + TINY)
        return {k: t[k] * tg[k] * scale for k in grads}
