"""The predictives of the network linearized at the posterior mean ``w̄`` (Laplace's ``glm`` and ``probit``).

:class:`Linearized` (MC-GLM, ``f(x; w̄) + J(x)Δ_m`` averaged like samples) and :class:`Probit`
(deterministic) take one per-example Jacobian ``J(x)`` of the logits per input batch; the BMA
(:mod:`flatbma.predict`) takes either in place of weight samples.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call

from flatbma import jacobians
from flatbma.errors import FlatbmaError
from flatbma.precision import full_precision
from flatbma.types import Params, Posterior, Predictive, State

__all__ = ["JACOBIAN_CHUNK", "Linearized", "LinearizedPredictive", "Probit", "linearized_predictions"]


JACOBIAN_CHUNK = 32
"""Examples per vectorized Jacobian call of the linearized predictives (bounds their peak memory)."""


class LinearizedPredictive:
    """A predictive of the network linearized at the posterior mean ``w̄`` (:class:`Linearized`, :class:`Probit`).

    ``log_probs(model, x)`` gives ``[M, B, C]`` per-"sample" log-probabilities, averaged like samples'
    (:func:`flatbma.predict.log_mean_exp`); ``len`` is ``M`` and ``[:m]`` keeps the first ``m``.
    """

    mean: Mapping[str, Tensor]
    names: tuple[str, ...]

    def __len__(self) -> int:
        raise NotImplementedError

    def __getitem__(self, index: slice) -> LinearizedPredictive:
        raise NotImplementedError

    def log_probs(self, model: nn.Module, x: Tensor) -> Tensor:
        """``[M, B, C]`` log-probabilities of the input batch ``x`` (the model in its prediction mode)."""
        raise NotImplementedError

    def _logits_and_jacobian(self, model: nn.Module, x: Tensor) -> tuple[Tensor, Params]:
        """``f(x; w̄)`` ``[B, C]`` and the per-example Jacobians ``{name: [B, C, *shape]}`` over :attr:`names`."""
        mean = dict(self.mean)

        def fn(params: Params, inputs: Tensor) -> Tensor:
            return functional_call(model, {**mean, **params}, (inputs,))

        at = {k: mean[k] for k in self.names}
        # the linearization stays float32 under a caller's autocast (flatbma.precision): J Σ Jᵀ is a closed form
        with torch.enable_grad(), full_precision(x.device):  # torch.func differentiates under an outer no_grad too
            jac = jacobians.jacobian(fn, at, x, chunk=JACOBIAN_CHUNK)
        with torch.no_grad(), full_precision(x.device):
            logits = functional_call(model, mean, (x,))
        return logits, {k: v.detach() for k, v in jac.items()}


@dataclass(frozen=True)
class Linearized(LinearizedPredictive):
    """The MC-GLM predictive (Immer, Korzepa & Bauer, AISTATS 2021) of ``M`` weight samples.

    ``log p(y|x) = log (1/M) Σ_m softmax(f(x; w̄) + J(x)Δ_m)_y`` with ``Δ_m = w_m − w̄`` over the trained
    parameters and ``J(x) = ∂f(x; w)/∂w`` at ``w̄``: the BMA of the GLM whose Laplace posterior the samples are.
    ``J(x)`` is computed once per batch; each sample then costs one contraction ``Σ_name J[name] · Δ_m[name]``.

    Attributes:
        mean: ``w̄`` with its buffers (the BatchNorm statistics every linearized logit uses).
        deltas: ``Δ_m`` per sample, over the trained parameter names.
    """

    mean: Mapping[str, Tensor]
    deltas: Sequence[Mapping[str, Tensor]]

    @property
    def names(self) -> tuple[str, ...]:  # type: ignore[override]
        """The trained parameters the samples move (the keys of ``Δ_m``)."""
        return tuple(self.deltas[0]) if self.deltas else ()

    def __len__(self) -> int:
        return len(self.deltas)

    def __getitem__(self, index: slice) -> Linearized:
        return replace(self, deltas=list(self.deltas[index]))

    def log_probs(self, model: nn.Module, x: Tensor) -> Tensor:
        """``log_softmax(f(x; w̄) + J(x)Δ_m)`` for every sample: ``[M, B, C]``."""
        logits, jac = self._logits_and_jacobian(model, x)
        out = logits.unsqueeze(0).expand(len(self.deltas), -1, -1).clone()
        for name, j in jac.items():
            stacked = torch.stack([d[name].reshape(-1) for d in self.deltas]).to(j.dtype)  # [M, n]
            out += torch.einsum("bcn,mn->mbc", j.reshape(*j.shape[:2], -1), stacked)
        return F.log_softmax(out, dim=-1)


@dataclass(frozen=True)
class Probit(LinearizedPredictive):
    """The probit approximation of the GLM predictive (MacKay 1992; Daxberger et al. 2021).

    ``p(y|x) = softmax(κ ⊙ f(x; w̄))`` with ``κ_c = (1 + π/8 · σ²_c)^{−½}`` and ``σ²_c = (J(x) Σ J(x)ᵀ)_cc``,
    the variance of logit ``c`` under the posterior covariance ``Σ``. Deterministic: ``len`` 1.

    Attributes:
        mean: ``w̄`` with its buffers.
        names: the trained parameters (those ``Σ`` is over).
        variance: ``variance(J) -> σ²`` ``[B, C]`` for Jacobians ``J[name]`` ``[B, C, *shape]``
            (a posterior's :attr:`~flatbma.types.Capabilities.functional_variance` at its state).
    """

    mean: Mapping[str, Tensor]
    names: tuple[str, ...]
    variance: Callable[[Params], Tensor]

    def __len__(self) -> int:
        return 1

    def __getitem__(self, index: slice) -> Probit:
        return self

    def log_probs(self, model: nn.Module, x: Tensor) -> Tensor:
        """``log_softmax(κ ⊙ f(x; w̄))``: ``[1, B, C]``."""
        logits, jac = self._logits_and_jacobian(model, x)
        kappa = torch.rsqrt(1 + math.pi / 8 * self.variance(jac).to(torch.float64))
        return F.log_softmax(logits * kappa.to(logits.dtype), dim=-1).unsqueeze(0)


def linearized_names(method: Posterior, state: State, names: Sequence[str]) -> list[str]:
    """The trained ``names`` a linearized predictive differentiates: those the posterior has a variance for.

    ``names`` in order, less those :attr:`~flatbma.types.Posterior.marginal_variance` leaves out (held at the mean,
    e.g. all but the classifier's in last-layer Laplace): their ``Δ_m`` is 0, their Jacobian only costs memory.
    """
    if method.marginal_variance is None:
        return list(names)
    held = method.marginal_variance(state)
    return [k for k in names if k in held]


def linearized_predictions(
    predictive: Predictive | str,
    mean: Mapping[str, Tensor],
    samples: Sequence[Mapping[str, Tensor]],
    names: Sequence[str],
    variance: Callable[[Params], Tensor] | None = None,
) -> LinearizedPredictive:
    """The ``GLM`` or ``PROBIT`` predictive (:class:`flatbma.types.Predictive`) around ``mean``.

    ``mean`` is ``w̄`` with its buffers (BatchNorm statistics recomputed once, at ``w̄``, by the caller); ``glm``
    takes the posterior's ``samples`` (``Δ_m = w_m − w̄`` over the trained ``names``), ``probit`` its ``variance``
    ``J -> diag(JΣJᵀ)`` (the posterior's functional variance at its state).

    Raises:
        FlatbmaError: ``samples`` (for ``glm``) or ``variance`` (for ``probit``) missing, or another predictive.
    """
    predictive = Predictive(predictive)
    if predictive is Predictive.GLM:
        if not samples:
            raise FlatbmaError("the GLM predictive needs at least one posterior sample (num_samples >= 1)")
        return Linearized(mean=mean, deltas=[{k: w[k] - mean[k] for k in names} for w in samples])
    if predictive is Predictive.PROBIT:
        if variance is None:
            raise FlatbmaError("the probit predictive needs the posterior's functional variance (diag JΣJᵀ)")
        return Probit(mean=mean, names=tuple(names), variance=variance)
    raise FlatbmaError(f"predictive {predictive.value!r} is not linearized: average the samples themselves")
