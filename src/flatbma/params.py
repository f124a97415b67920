"""Helpers for parameters held as ``dict[str, Tensor]``.

Models are called functionally with :func:`torch.func.functional_call`; parameters are flattened to
one vector only where linear algebra needs it (SWAG deviations, Lanczos).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call

from flatbma import packed
from flatbma.errors import FlatbmaError, suggest
from flatbma.precision import GradientOverflow, Precision, all_finite, as_float32, autocast, loss_scale
from flatbma.types import Batch, Params


def trainable_params(model: nn.Module) -> Params:
    """Detached copies of the parameters with ``requires_grad=True``, keyed by module name.

    Frozen parameters are left out (they stay at the module's values): that is how a Bayesian subset is expressed.
    """
    return {k: v.detach().clone() for k, v in model.named_parameters() if v.requires_grad}


def model_buffers(model: nn.Module) -> Params:
    """Detached copies of the module's buffers (BatchNorm running statistics), keyed by name."""
    return {k: v.detach().clone() for k, v in model.named_buffers()}


def load_into(model: nn.Module, weights: Mapping[str, Tensor]) -> nn.Module:
    """Copy ``weights`` (tensors by module name) into ``model``'s own parameters and buffers, in place; return it.

    The inverse of :func:`trainable_params` and :func:`model_buffers`; ``weights`` may be a posterior's mean
    (:meth:`flatbma.predictor.BMA.mean`), a sample, or ``{**state.params, **state.buffers}``. Tensors it does not
    name keep their values.

    Raises:
        FlatbmaError: a name the module does not have, or a tensor of another shape.
    """
    own = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    for name, value in weights.items():
        if name not in own:
            raise FlatbmaError(
                f"load_into: the module has no parameter or buffer {name!r}.{suggest(name, own)} Pass weights of "
                "this module, by the names of its named_parameters() and named_buffers()"
            )
        if tuple(value.shape) != tuple(own[name].shape):
            raise FlatbmaError(
                f"load_into: {name!r} has shape {tuple(value.shape)} but the module's is {tuple(own[name].shape)}"
            )
    with torch.no_grad():
        for name, value in weights.items():
            own[name].copy_(value)
    return model


@dataclass
class _Holder:
    """What a predictor holding a module knows of it (:func:`hold`): its name and the posterior mean's fingerprint."""

    name: str
    mean: tuple[tuple[str, float, float], ...] | None = None


_HELD: weakref.WeakKeyDictionary[nn.Module, _Holder] = weakref.WeakKeyDictionary()


def _fingerprint(model: nn.Module) -> tuple[tuple[str, float, float], ...]:
    """``(name, Σv, Σv²)`` in float64 of every parameter and buffer: whether the module's weights changed."""
    with torch.no_grad():
        own = {**dict(model.named_parameters()), **dict(model.named_buffers())}
        return tuple(
            (k, float(v.double().sum()), float(v.double().square().sum()))
            for k, v in own.items()
            if v.is_floating_point() and v.device.type != "meta"
        )


def hold(model: nn.Module, name: str, *, mean_loaded: bool = False) -> None:
    """Record that a predictor of method ``name`` holds ``model``; ``mean_loaded``: it holds the posterior's weights.

    Read by :func:`held_weights_note`; the record goes with the module (a weak reference).
    """
    holder = _HELD.get(model)
    if holder is None or holder.name != name:
        holder = _HELD[model] = _Holder(name)
    if mean_loaded:
        holder.mean = _fingerprint(model)


def held_weights_note(model: nn.Module) -> str | None:
    """Why measuring ``model``'s own weights may not be what is meant, or ``None``.

    A note when a predictor holds ``model`` (:func:`hold`) but not the posterior mean last written into it.
    """
    holder = _HELD.get(model)
    if holder is None or (holder.mean is not None and holder.mean == _fingerprint(model)):
        return None
    return (
        f"the module belongs to a {holder.name} predictor (BMA) but does not hold its posterior mean "
        "(fit_posterior(..., load_into=False), or weights changed since): its own weights are measured; pass "
        "weights=bma.mean() or a sample (bma.samples[i]) to measure the posterior's, or call bma.load_into()"
    )


def clone(params: Mapping[str, Tensor]) -> Params:
    """Deep copy of a tensor dict."""
    return {k: v.detach().clone() for k, v in params.items()}


def detached(params: Mapping[str, Tensor]) -> Mapping[str, Tensor]:
    """``params`` without autograd history: the same tensors (packing kept) when none requires grad."""
    if isinstance(params, packed.Packed):
        return params if not params.flat.requires_grad else params.layout.lazy(params.flat.detach())
    if not any(v.requires_grad for v in params.values()):
        return dict(params)
    return {k: v.detach() for k, v in params.items()}


def add(a: Mapping[str, Tensor], b: Mapping[str, Tensor], alpha: float = 1.0) -> Mapping[str, Tensor]:
    """``a + alpha * b`` for every key of ``b``, keeping ``a``'s other keys (a ``Packed`` result if both are packed)."""
    packed_a = packed.buffer(a)
    packed_b = packed.buffer(b) if packed_a is not None else None
    if packed_b is not None and packed_b[0] == packed_a[0]:
        return packed_a[0].lazy(packed_a[1] + alpha * packed_b[1])
    out = dict(a)
    for k, v in b.items():
        out[k] = a[k] + alpha * v
    return out


def scale(a: Mapping[str, Tensor], factor: float) -> Mapping[str, Tensor]:
    """``factor * a`` (one tensor operation, and a :class:`~flatbma.packed.Packed` result, when ``a`` is packed)."""
    found = packed.buffer(a)
    if found is not None:
        layout, flat = found
        return layout.lazy(flat * factor)
    return {k: v * factor for k, v in a.items()}


def dot(a: Mapping[str, Tensor], b: Mapping[str, Tensor]) -> Tensor:
    """Euclidean inner product ``Σ_k ⟨a_k, b_k⟩`` over the keys of ``a``."""
    return sum(((a[k] * b[k]).sum() for k in a), start=torch.zeros((), device=_device(a)))


def global_norm(tensors: Mapping[str, Tensor]) -> Tensor:
    """``‖t‖₂`` of all tensors concatenated."""
    if not tensors:
        return torch.zeros(())
    norms = torch._foreach_norm(list(tensors.values()))
    return torch.linalg.vector_norm(torch.stack(norms))


def flatten(params: Mapping[str, Tensor]) -> Tensor:
    """Concatenate all tensors into one vector (in key order)."""
    return torch.cat([v.reshape(-1) for v in params.values()])


def unflatten(vector: Tensor, like: Mapping[str, Tensor]) -> Params:
    """Inverse of :func:`flatten`: split ``vector`` into tensors shaped like ``like``."""
    out, offset = {}, 0
    for k, v in like.items():
        n = v.numel()
        out[k] = vector[offset : offset + n].view_as(v)
        offset += n
    if offset != vector.numel():
        raise ValueError(f"vector has {vector.numel()} entries but the template needs {offset}")
    return out


def _device(params: Mapping[str, Tensor]) -> torch.device:
    return next(iter(params.values())).device if params else torch.device("cpu")


def value_and_grad(
    fn: Callable[[Params], tuple[Tensor, Tensor]], params: Mapping[str, Tensor]
) -> tuple[Tensor, Tensor, Params]:
    """Detached ``(loss, aux) = fn(params)`` and the gradient of ``loss`` w.r.t. every tensor of ``params``."""
    leaves = {k: v.detach().requires_grad_(True) for k, v in params.items()}
    loss, aux = fn(leaves)
    grads = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
    out = {k: torch.zeros_like(v) if g is None else g for (k, v), g in zip(leaves.items(), grads)}
    return loss.detach(), aux.detach(), out


@dataclass(frozen=True)
class Objective:
    """The data term: a model called functionally and a mean loss over a mini-batch.

    Attributes:
        model: the template module; parameters not passed keep their values, its train/eval mode applies.
        loss_fn: ``loss_fn(logits, labels)`` returning the mean loss; cross-entropy by default.
        num_data: size ``n`` of the training set (scales KL terms and SG-MCMC potentials).
        reduce_grads: optional hook applied to every gradient dict (data-parallel all-reduce).
        precision: ``fp32``, or ``bf16``/``fp16`` autocast of the forward pass with float32 logits and loss.
    """

    model: nn.Module
    loss_fn: Callable[[Tensor, Tensor], Tensor] = F.cross_entropy
    num_data: int = 1
    reduce_grads: Callable[[Params], Params] | None = None
    precision: Precision = Precision.FP32

    def logits(self, weights: Mapping[str, Tensor], x: Tensor) -> Tensor:
        """``f(x; weights)``: the model called with ``weights`` (parameters and/or buffers), under :attr:`precision`."""
        with autocast(self.precision, x.device):
            out = functional_call(self.model, dict(weights), (x,))
        return as_float32(out)

    def loss(self, params: Mapping[str, Tensor], buffers: Mapping[str, Tensor], batch: Batch):
        """Return ``(L_B(params), logits)``; in train mode BatchNorm updates ``buffers`` in place."""
        x, y = batch
        logits = self.logits({**params, **buffers}, x)
        return self.loss_fn(logits, y), logits

    def value_and_grad(
        self,
        params: Mapping[str, Tensor],
        buffers: Mapping[str, Tensor],
        batch: Batch,
        *,
        update_buffers: bool = True,
    ) -> tuple[Tensor, Tensor, Params]:
        """Loss, logits and (reduced) gradient at ``params`` on the batch ``(x, y)``.

        BatchNorm updates ``buffers`` in place in train mode if ``update_buffers``, else a throw-away copy (e.g. a
        SAM step's second pass). Under a loss scale ``S`` (:func:`flatbma.precision.scaling`) the gradient of
        ``S·L`` is divided by ``S`` after the reduction (exact, a power of two); the loss and gradient returned are
        those of ``L``.

        Raises:
            GradientOverflow: under a loss scale, when the reduced gradient is not finite (on every process).
        """
        bufs = buffers if update_buffers else clone(buffers)
        scale = loss_scale()
        if scale is None:
            loss, logits, grads = value_and_grad(lambda p: self.loss(p, bufs, batch), params)
        else:
            loss, logits, grads = value_and_grad(lambda p: _scaled(self.loss(p, bufs, batch), scale), params)
            loss = loss / scale
        if self.reduce_grads is not None:
            grads = self.reduce_grads(grads)
        if scale is not None:
            grads = {k: g / scale for k, g in grads.items()}
            if not all_finite(list(grads.values())):
                raise GradientOverflow(loss, logits)
        return loss, logits, grads


def _scaled(loss_and_logits: tuple[Tensor, Tensor], scale: Tensor) -> tuple[Tensor, Tensor]:
    loss, logits = loss_and_logits
    return loss * scale, logits
