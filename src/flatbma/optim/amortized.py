"""The second pass of any ascent step, taken only every ``k`` steps and on a fraction of the batch.

:class:`Amortized` wraps any ascent step (SAM, ASAM, FisherSAM on weights, FisherBall on a variational posterior's
``θ``) and takes its second forward/backward pass only at every ``ascent_every``-th step, reusing in between what
the last one learned (derivation: docs/methods.md §4.5).

**LookSAM** (Liu et al., CVPR 2022, Algorithm 1). With ``g = ∇L_B(w)`` and SAM's ``g_s = ∇L_B(w + ε)``, the part
of ``g_s`` orthogonal to ``g`` is stored at the steps ``t ≡ 0 (mod k)`` and reused at the ``k − 1`` in between:

    ``g_v = g_s − (gᵀg_s / ‖g‖²)·g``,        ``g̃ = g + α·(‖g‖/‖g_v‖)·g_v``,

with ``α = reuse_alpha``, over the whole parameter vector.

**Any ascent step: the dual metric.** Each step maximizes the linearized loss over a ball ``εᵀMε ≤ ρ²`` of its own
metric ``M``, so the split is made orthogonal in ``⟨a, b⟩_* = aᵀM⁻¹b`` (no solve, since ``M⁻¹g ∝ ε``); the dual
norms are read off the step, ``ε(a)ᵀa = ρ‖a‖_*``, and ``‖g‖_*`` is carried to a reuse step by ``‖g‖/‖g₀‖``
(``g₀`` the first-pass gradient of the ascent step):

    ``g_v = g_s − (εᵀg_s / εᵀg₀)·g₀``,        ``g̃ = g + α·(‖g‖/‖g₀‖)·(ε(g₀)ᵀg₀ / ε(g_v)ᵀg_v)·g_v``,

with one stored scalar beside ``g_v``; for SAM this is LookSAM's formula exactly. For FisherBall the split is the
``F⁻¹``-orthogonal one, and the KL gradient is added after, unchanged.

**Batch fraction** (ESAM, Du et al., ICLR 2022). With ``ascent_fraction = f < 1`` the second pass runs on the first
``⌈f·B⌉`` examples of the batch (at least two), a fixed subset: random as the loader shuffles, exact on resumption.

**State.** The memory (cycle position, ``g_v`` and its scale) lives in the method state's ``aux``
(:data:`flatbma.optim.ascent.MEMORY`), updated in place, so a run resumed mid-cycle continues bit-identically. With
``ascent_every = 1`` and ``ascent_fraction = 1`` the descent gradients are exactly the wrapped step's.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum

import torch
from torch import Tensor

from flatbma import packed
from flatbma.checks import check_int, check_number, parse_choice
from flatbma.errors import FlatbmaError
from flatbma.optim.ascent import Gradient, ascended, has_memory, needs_sample
from flatbma.params import add
from flatbma.types import Ascent, AscentSpace, Batch, Params, ascent_space


class Reuse(str, Enum):
    """What :class:`Amortized` does at the steps without a second pass (strings and members are both accepted)."""

    ORTHOGONAL = "orthogonal"
    """LookSAM: add the stored component ``g_v`` of the last perturbed gradient, rescaled (module docstring)."""
    NONE = "none"
    """Descend along the plain gradient ``g`` (periodic SAM, "SAM-k")."""


POSITION = "position"
"""Memory key: steps since the last second pass, ``0 ≤ position < ascent_every`` (0: this step takes it)."""
SCALE = "scale"
"""Memory key: ``ε(g₀)ᵀg₀ / (‖g₀‖·ε(g_v)ᵀg_v)``, which times ``‖g‖`` is the ratio ``‖g‖_*/‖g_v‖_*`` of a reuse step."""
ORTHOGONAL = "orthogonal/"
"""Memory key prefix of the stored ``g_v`` (one tensor per key of the gradient)."""


@dataclass(frozen=True)
class Amortized:
    """An ascent step whose second pass runs every ``ascent_every`` steps, on a fraction of the batch.

    ``Amortized(SAM(0.05), ascent_every=5)`` is LookSAM; ``Amortized(FisherBall(), ascent_every=5)`` is
    FP-BMA with the θ-space analogue (module docstring). It is itself an ascent step (``space`` and ``perturb``
    are the wrapped step's); its memory (:meth:`init`) is kept in the family's state.

    Attributes:
        ascent: the wrapped ascent step.
        ascent_every: ``k ≥ 1``: the second pass runs at steps ``0, k, 2k, …`` of the run.
        reuse: what the steps in between descend along (:class:`Reuse`; its name is accepted).
        reuse_alpha: ``α ≥ 0`` of :attr:`Reuse.ORTHOGONAL`.
        ascent_fraction: ``f ∈ (0, 1]``: the second pass runs on the first ``⌈f·B⌉`` examples of the batch (≥ 2).
    """

    ascent: Ascent
    ascent_every: int = 1
    reuse: Reuse = Reuse.ORTHOGONAL
    reuse_alpha: float = 0.7
    ascent_fraction: float = 1.0

    def __post_init__(self) -> None:
        if self.ascent is None or not hasattr(self.ascent, "perturb"):
            raise FlatbmaError(
                f"Amortized needs an ascent step to amortize (SAM, ASAM, FisherSAM, FisherBall), got {self.ascent!r}"
            )
        if has_memory(self.ascent):
            raise FlatbmaError("Amortized wraps a plain ascent step, not another Amortized one: give its options once")
        if needs_sample(self.ascent):
            raise FlatbmaError(
                "the score direction's step comes from the drawn sample, not from a first pass: there is no second "
                "pass to amortize (it costs one forward/backward already); leave out ascent_every and its options"
            )
        check_int(
            self.ascent_every,
            f"ascent_every must be an integer >= 1 (the second pass runs every k steps), got {self.ascent_every!r}",
            minimum=1,
        )
        object.__setattr__(self, "reuse", parse_choice(Reuse, self.reuse, "reuse"))
        check_number(
            self.reuse_alpha,
            f"reuse_alpha must be a number >= 0 (LookSAM's weight of the reused direction), got {self.reuse_alpha!r}",
            low=0,
            high=math.inf,
            high_open=True,
        )
        check_number(
            self.ascent_fraction,
            f"ascent_fraction must be a number in (0, 1] (the share of the batch the second pass sees), "
            f"got {self.ascent_fraction!r}",
            low=0,
            low_open=True,
            high=1,
        )

    @property
    def space(self) -> AscentSpace:
        """Where the wrapped step acts (weights or ``θ``)."""
        return ascent_space(self.ascent)

    def perturb(self, params: Mapping[str, Tensor], grads: Mapping[str, Tensor]) -> Mapping[str, Tensor]:
        """The wrapped step's ``ε`` (used at the steps that take the second pass)."""
        return self.ascent.perturb(params, grads)

    def init(self, params: Mapping[str, Tensor]) -> Params:
        """The memory for gradients shaped like ``params``: position 0 and, for the orthogonal reuse, ``g_v = 0``."""
        ref = next(iter(params.values()))
        memory = {POSITION: torch.zeros((), dtype=torch.int64, device=ref.device)}
        if self.reuse is Reuse.ORTHOGONAL:
            memory[SCALE] = torch.zeros((), dtype=ref.dtype, device=ref.device)
            memory.update({ORTHOGONAL + k: v for k, v in packed.zeros_like(params).items()})
        return memory

    def descent_gradient(
        self,
        gradient: Gradient,
        params: Mapping[str, Tensor],
        batch: Batch,
        grads: Mapping[str, Tensor],
        memory: Mapping[str, Tensor] | None,
    ) -> Mapping[str, Tensor]:
        """The descent gradient at ``params`` given the first pass's ``grads``; ``memory`` is updated in place.

        At a step of the cycle's start: the wrapped step's ``g_s`` (its second pass, on the batch fraction),
        storing ``g_v`` and its scale; at the others: ``g`` or ``g + α(‖g‖/‖g₀‖)(ε(g₀)ᵀg₀ / ε(g_v)ᵀg_v)g_v``
        (module docstring).
        """
        if memory is None or POSITION not in memory:
            raise FlatbmaError(
                "an Amortized ascent step keeps a memory in the method's state, and this method passed none: "
                "build the method through a posterior family (flatbma.posteriors) rather than calling the step alone"
            )
        position = memory[POSITION]
        at = int(position) % self.ascent_every
        position.fill_((at + 1) % self.ascent_every)
        if at == 0:
            return self._ascend(gradient, params, batch, grads, memory)
        if self.reuse is Reuse.NONE:
            return grads
        return self._reuse(grads, memory)

    def _ascend(
        self,
        gradient: Gradient,
        params: Mapping[str, Tensor],
        batch: Batch,
        grads: Mapping[str, Tensor],
        memory: Mapping[str, Tensor],
    ) -> Mapping[str, Tensor]:
        eps, g_s = ascended(gradient, params, self._part(batch), self.ascent, grads)
        if self.reuse is Reuse.ORTHOGONAL:
            with torch.no_grad():
                along = float(_dot(eps, grads))  # ε(g₀)ᵀg₀ = ρ‖g₀‖_*
                c = float(_dot(eps, g_s)) / along if along > 0 else 0.0
                g_v = add(g_s, grads, -c)  # g_s − (εᵀg_s/εᵀg₀)·g₀: εᵀg_v = 0
                dual_v = float(_dot(self.ascent.perturb(params, g_v), g_v))  # ρ‖g_v‖_*
                norm = math.sqrt(float(_dot(grads, grads)))
                scale = along / (norm * dual_v) if along > 0 and dual_v > 0 else 0.0
                memory[SCALE].fill_(scale if math.isfinite(scale) else 0.0)
                keys = list(g_v)
                stored, fresh = packed.coalesce(keys, {k: memory[ORTHOGONAL + k] for k in keys}, g_v)
                torch._foreach_copy_(stored, fresh)
        return g_s

    @torch.no_grad()
    def _reuse(self, grads: Mapping[str, Tensor], memory: Mapping[str, Tensor]) -> Mapping[str, Tensor]:
        scale = float(memory[SCALE])
        if not scale > 0 or self.reuse_alpha == 0:
            return grads  # no stored direction (g_v = 0, or one the ascent's metric does not see)
        ratio = math.sqrt(float(_dot(grads, grads))) * scale  # ≈ ‖g‖_* / ‖g_v‖_*
        g_v = {k: memory[ORTHOGONAL + k] for k in grads}
        return add(grads, g_v, self.reuse_alpha * ratio)

    def _part(self, batch: Batch) -> Batch:
        """The first ``⌈f·B⌉`` examples of ``batch``, at least two (BatchNorm in train mode needs two)."""
        if self.ascent_fraction == 1:
            return batch
        x, y = batch
        n = min(len(x), max(2, math.ceil(self.ascent_fraction * len(x) - 1e-9)))
        return x[:n], y[:n]


def _dot(a: Mapping[str, Tensor], b: Mapping[str, Tensor]) -> Tensor:
    """``Σ_k ⟨a_k, b_k⟩`` over the keys of ``b``: one product when both are packed alike (:mod:`flatbma.packed`)."""
    xs, ys = packed.coalesce(list(b), a, b)
    return torch.stack([torch.vdot(x.reshape(-1), y.reshape(-1)) for x, y in zip(xs, ys, strict=True)]).sum()
