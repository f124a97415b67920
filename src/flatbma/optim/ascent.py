"""The shared perturb-then-descend logic of the sharpness-aware family.

Every flat-seeking method — SAM, ASAM, Fisher-SAM on a point estimate, the F-variants of the
posterior families, FP-BMA on variational parameters — takes the descent gradient at a perturbed
point ``params + ε`` where ``ε = ascent.perturb(params, g)``. This module holds that two-pass step once;
the ascent steps differ only in ``perturb``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import Tensor

from flatbma.checks import check_number
from flatbma.params import Objective, add
from flatbma.types import Ascent, Batch, Params

TINY = 1e-12
"""Added to norms before dividing, so that a zero gradient gives a zero perturbation."""


def check_radius(rho: float, name: str = "rho") -> None:
    """Raise a :class:`FlatbmaError` unless ``rho`` is a positive finite number."""
    message = f"{name} must be a positive number (the ascent radius), got {rho!r}"
    check_number(rho, message, low=0, low_open=True, high=math.inf, high_open=True)


def sharpness_aware_value_and_grad(
    objective: Objective,
    params: Mapping[str, Tensor],
    buffers: Mapping[str, Tensor],
    batch: Batch,
    ascent: Ascent | None,
) -> tuple[Tensor, Tensor, Params]:
    """Loss and logits at ``w`` and the descent gradient ``∇L_B(w + ε)``.

    First pass: ``g = ∇L_B(w)`` (BatchNorm running statistics are updated here, once). Without an
    ascent step the result is ``g``. Otherwise ``ε = ascent.perturb(w, g)`` and the second pass
    returns ``∇L_B(w + ε)`` on the same batch with the running statistics left untouched (Foret et
    al. 2021).

    Returns:
        ``(L_B(w), logits at w, gradient)``.
    """
    loss, logits, grads = objective.value_and_grad(params, buffers, batch)
    if ascent is None:
        return loss, logits, grads
    eps = ascent.perturb(params, grads)
    with torch.no_grad():
        perturbed = add(params, eps)
    _, _, grads = objective.value_and_grad(perturbed, buffers, batch, update_buffers=False)
    return loss, logits, grads
