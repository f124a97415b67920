"""Hessian-vector products of the mean training loss, as a linear operator on flat vectors.

Over 500 lines on purpose: the operator, its two product modes and the leaner second-order graphs are correct only
together, under the conditions the operator sets up (eval mode, the chosen parameters differentiated).

For batches ``B_j`` of sizes ``n_j`` (``n = Σ_j n_j``) and a loss function that returns the *mean* loss of a batch,

    L_S(w) = Σ_j (n_j / n) · L_{B_j}(w),        H v = Σ_j (n_j / n) · ∇²L_{B_j}(w) v,

accumulated batch by batch and within a batch over chunks (:func:`hvp_fn`), each with its own gradient graph, with
the model in eval mode (docs/methods.md §8.1). A chunk's product is ``"double_backward"``, ``∇_w ⟨∇_w L_B(w), v⟩``
(one batch's graphs are built once and reused), or ``"func"``, ``jvp(grad(L_B), (w,), (v,))`` with :mod:`torch.func`.
Double backward runs a convolution whose weight is not chosen through :class:`_FrozenWeightConv` and an eval-mode
BatchNorm as an affine map (:func:`_affine_batch_norm`): the same function to rounding, leaner second-order graphs.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from enum import Enum
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call
from torch.nn.modules.batchnorm import _BatchNorm

from flatbma import progress
from flatbma.bn import eval_mode
from flatbma.checks import parse_choice
from flatbma.errors import FlatbmaError, FlatbmaWarning, suggest
from flatbma.params import flatten, held_weights_note, unflatten
from flatbma.precision import full_precision
from flatbma.types import TARGET_KEYS, Batch, Params, split_batch

__all__ = ["CPU_CHUNK_SIZE", "HVPMethod", "HessianOperator", "ParamSelection", "hvp_fn", "nonzero_checked"]

ParamSelection = Mapping[str, Tensor] | Sequence[str] | None
"""Which parameters the Hessian is taken over: a dict ``name -> value`` (the point), a list of
names, or ``None`` for every parameter of the model with ``requires_grad=True``."""

LossFn = Callable[[Tensor, Tensor], Tensor]


class HVPMethod(str, Enum):
    """How one Hessian-vector product is computed (strings and members are both accepted)."""

    DOUBLE_BACKWARD = "double_backward"
    FUNC = "func"

    @classmethod
    def parse(cls, value: HVPMethod | str) -> HVPMethod:
        """Return the member for ``value`` or raise a :class:`FlatbmaError` naming the choices."""
        return parse_choice(cls, value, "hvp")


class HessianOperator:
    """``v ↦ ∇²L_S(w) v`` on flat vectors of the chosen parameters; build it with :func:`hvp_fn`.

    Vectors are flat in the key order of :attr:`point` (:func:`flatbma.params.flatten`); a product is computed
    in the parameters' dtype and returned in the input vector's dtype, so callers may keep float64 vectors.

    Attributes:
        point: the chosen parameters ``w`` (detached), by module name.
        dim: number of scalar parameters ``d``.
        method: the :class:`HVPMethod` in use.
        chunk_size: most examples per gradient graph (``None``: a whole batch); see :func:`hvp_fn`.
        num_products: how many products have been evaluated so far.
    """

    def __init__(
        self,
        model: nn.Module,
        data: Iterable[Batch] | Batch,
        *,
        loss_fn: LossFn | None = None,
        params: ParamSelection = None,
        weights: Mapping[str, Tensor] | None = None,
        hvp: HVPMethod | str = HVPMethod.DOUBLE_BACKWARD,
        chunk_size: int | str | None = "auto",
    ) -> None:
        self.model = model
        self.method = HVPMethod.parse(hvp)
        self.loss_fn = loss_fn if loss_fn is not None else F.cross_entropy
        self.point, self.fixed = _resolve_weights(model, params, weights)
        if not weights and not isinstance(params, Mapping):
            note = held_weights_note(model)  # a predictor's module that does not hold the posterior mean
            if note is not None:
                warnings.warn(FlatbmaWarning(note), stacklevel=3)
        self.dim = sum(v.numel() for v in self.point.values())
        self.num_products = 0
        self._data = _reiterable(data)
        self._dtype = next(iter(self.point.values())).dtype
        self._leaves = {k: v.detach().requires_grad_(True) for k, v in self.point.items()}
        self.chunk_size = _chunk_size(chunk_size, self.device)
        self._cached: list[tuple[int, list[Tensor], list[int]]] | None = None
        fast = self.method is HVPMethod.DOUBLE_BACKWARD
        self._frozen_convs = _frozen_convolutions(model, self.point) if fast else []
        self._batch_norms = _eval_batch_norms(model) if fast else []
        with full_precision(self.device):  # never under a caller's autocast (flatbma.precision)
            self._check_first_batch()

    @property
    def device(self) -> torch.device:
        """Device of the chosen parameters; batches are moved there."""
        return next(iter(self.point.values())).device

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the products are computed in (that of the parameters)."""
        return self._dtype

    @property
    def eps(self) -> float:
        """Machine epsilon of the dtype the products are computed in."""
        return torch.finfo(self._dtype).eps

    def flatten(self, tensors: Mapping[str, Tensor]) -> Tensor:
        """Flat vector of ``tensors`` in the operator's key order."""
        return flatten({k: tensors[k] for k in self.point})

    def unflatten(self, vector: Tensor) -> Params:
        """Split a flat vector into tensors shaped like :attr:`point`."""
        return unflatten(vector, self.point)

    def __call__(self, vector: Tensor) -> Tensor:
        """Return ``H v`` for a flat vector ``v`` of length :attr:`dim`."""
        if vector.shape != (self.dim,):
            raise ValueError(f"expected a flat vector of shape ({self.dim},), got {tuple(vector.shape)}")
        v = self.unflatten(vector.to(device=self.device, dtype=self._dtype))
        # never under a caller's autocast: Lanczos needs float32/float64 products (flatbma.precision)
        with eval_mode(self.model), full_precision(self.device):
            if self._cached is not None:
                out = self._cached_product(v)
            else:
                out = self._accumulated_product(v)
        self.num_products += 1
        return out.to(vector.dtype)

    def _tick(self) -> None:
        """A chunk of a product done: a long phase of products (Lanczos, Hutchinson) prints while it runs."""
        progress.current().tick(f"Hessian-vector product {self.num_products + 1}")

    # -- products -----------------------------------------------------------------------------

    def _batch_loss(self, p: Mapping[str, Tensor], x: Tensor, y: Tensor) -> Tensor:
        with _lean_second_order(self._frozen_convs, self._batch_norms):
            return self.loss_fn(functional_call(self.model, {**self.fixed, **p}, (x,)), y)

    def _accumulated_product(self, v: Params) -> Tensor:
        total = torch.zeros(self.dim, device=self.device, dtype=self._dtype)
        n = 0
        for x, y in self._chunks():
            nb = x.shape[0]
            if nb == 0:
                continue
            if self.method is HVPMethod.FUNC:
                hv = self._func_product(v, x, y)
            else:
                hv = self._double_backward_product(v, x, y)
            total.add_(hv, alpha=float(nb))
            n += nb
            self._tick()
        if n == 0:
            raise FlatbmaError(_EMPTY)
        return total / n

    def _func_product(self, v: Params, x: Tensor, y: Tensor) -> Tensor:
        grad_fn = torch.func.grad(lambda p: self._batch_loss(p, x, y))
        with torch.enable_grad():
            _, hv = torch.func.jvp(grad_fn, (self.point,), (v,))
        return self.flatten(hv)

    def _double_backward_product(self, v: Params, x: Tensor, y: Tensor) -> Tensor:
        with torch.enable_grad():
            grads, idx = self._gradient_graph(x, y)
            return self._backward_through(grads, idx, v, retain_graph=False)

    def _cached_product(self, v: Params) -> Tensor:
        if len(self._cached) == 1:  # one graph: its product, as is
            _, grads, idx = self._cached[0]
            return self._backward_through(grads, idx, v, retain_graph=True)
        total = torch.zeros(self.dim, device=self.device, dtype=self._dtype)
        for nb, grads, idx in self._cached:  # the same sum as _accumulated_product's
            total.add_(self._backward_through(grads, idx, v, retain_graph=True), alpha=float(nb))
            self._tick()
        return total / sum(nb for nb, _, _ in self._cached)

    def _gradient_graph(self, x: Tensor, y: Tensor) -> tuple[list[Tensor], list[int]]:
        """``∇_w L_B(w)`` with its graph; only the entries that depend on ``w`` (``idx``) are kept."""
        leaves = list(self._leaves.values())
        loss = self._batch_loss(self._leaves, x, y)
        if not loss.requires_grad:
            return [], []
        grads = torch.autograd.grad(loss, leaves, create_graph=True, allow_unused=True)
        idx = [i for i, g in enumerate(grads) if g is not None and g.requires_grad]
        return [grads[i] for i in idx], idx

    def _backward_through(self, grads: list[Tensor], idx: list[int], v: Params, *, retain_graph: bool) -> Tensor:
        leaves = list(self._leaves.values())
        if not grads:
            return torch.zeros(self.dim, device=self.device, dtype=self._dtype)
        vs = list(v.values())
        with torch.enable_grad():
            hv = torch.autograd.grad(
                grads, leaves, grad_outputs=[vs[i] for i in idx], retain_graph=retain_graph, allow_unused=True
            )
        return torch.cat([(torch.zeros_like(p) if h is None else h).reshape(-1) for p, h in zip(leaves, hv)])

    # -- data -------------------------------------------------------------------------------------

    def _batches(self) -> Iterator[Batch]:
        for batch in self._data:
            x, y = _unpack(batch)
            yield x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    def _chunks(self) -> Iterator[Batch]:
        """The batches, each split into ``⌈n_b / chunk_size⌉`` chunks of as equal sizes as possible."""
        for x, y in self._batches():
            if self.chunk_size is None or x.shape[0] <= self.chunk_size:
                yield x, y
                continue
            parts = -(-x.shape[0] // self.chunk_size)
            yield from zip(torch.tensor_split(x, parts), torch.tensor_split(y, parts))

    def _check_first_batch(self) -> None:
        """Fail early on empty data or parameters the loss does not depend on; cache a single batch."""
        batch = next((b for b in self._batches() if b[0].shape[0] > 0), None)
        if batch is None:
            raise FlatbmaError(_EMPTY)
        # one batch given as a sequence: build the gradient graph of each of its chunks once and reuse
        # them in every product; otherwise check the first chunk (its graph is not kept)
        cache = self.method is HVPMethod.DOUBLE_BACKWARD and isinstance(self._data, Sequence) and len(self._data) == 1
        chunks = list(self._chunks()) if cache else [next(c for c in self._chunks() if c[0].shape[0] > 0)]
        reached: set[int] = set()
        cached = []
        with eval_mode(self.model), torch.enable_grad():
            leaves = list(self._leaves.values())
            for x, y in chunks:
                loss = self._batch_loss(self._leaves, x, y)
                if not loss.requires_grad:
                    cached.append((x.shape[0], [], []))
                    continue
                grads = torch.autograd.grad(loss, leaves, allow_unused=True, create_graph=cache)
                reached |= {i for i, g in enumerate(grads) if g is not None}
                idx = [i for i, g in enumerate(grads) if g is not None and g.requires_grad]
                cached.append((x.shape[0], [grads[i] for i in idx], idx))
                del loss, grads
        if cache:
            self._cached = cached
        names = list(self.point)
        if not reached:
            raise FlatbmaError(
                f"the loss does not depend on any of the chosen parameters ({_shorten(names)}): there is "
                "no gradient path from them to the loss. Choose parameters the model uses in its forward "
                "pass (params=...), or leave params unset to use every trainable parameter."
            )
        unused = [names[i] for i in range(len(names)) if i not in reached]
        if unused:
            warnings.warn(
                f"the loss does not depend on {len(unused)} chosen parameter tensor(s) ({_shorten(unused)}); "
                "their rows and columns of the Hessian are zero",
                FlatbmaWarning,
                stacklevel=3,
            )


class _FrozenWeightConv(torch.autograd.Function):
    """``conv(x, W)`` whose backward returns the input gradient only (``W`` is not differentiated).

    The backward is the transposed convolution of the output gradient, a differentiable op, so the
    double backward through it is one grouped convolution of the incoming direction (module docstring).
    """

    @staticmethod
    def forward(x: Tensor, weight: Tensor, stride: tuple, padding: tuple, dilation: tuple, groups: int) -> Tensor:
        conv = (F.conv1d, F.conv2d, F.conv3d)[len(stride) - 1]
        return conv(x, weight, None, stride, padding, dilation, groups)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Tensor) -> None:
        x, weight, stride, padding, dilation, groups = inputs
        ctx.save_for_backward(weight)
        ctx.options = (stride, padding, dilation, groups)
        ctx.in_shape = x.shape[-len(stride) :]

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        (weight,) = ctx.saved_tensors
        stride, padding, dilation, groups = ctx.options
        spatial = len(stride)
        # the output padding that gives the input's size back (strided convolutions drop a remainder)
        extra = tuple(
            n - ((o - 1) * s - 2 * p + d * (k - 1) + 1)
            for n, o, s, p, d, k in zip(
                ctx.in_shape, grad_out.shape[-spatial:], stride, padding, dilation, weight.shape[2:]
            )
        )
        transposed = (F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)[spatial - 1]
        grad_x = transposed(grad_out, weight, None, stride, padding, extra, groups, dilation)
        return grad_x, None, None, None, None, None


def _frozen_conv_forward(module: nn.Module, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``module._conv_forward`` through :class:`_FrozenWeightConv` (the bias, if any, added outside it)."""
    out = _FrozenWeightConv.apply(x, weight, module.stride, _padding(module), module.dilation, module.groups)
    return out if bias is None else out + bias.reshape(-1, *([1] * len(module.stride)))


def _padding(module: nn.Module) -> tuple[int, ...]:
    return (0,) * len(module.stride) if module.padding == "valid" else module.padding


def _frozen_convolutions(model: nn.Module, point: Mapping[str, Tensor]) -> list[nn.Module]:
    """The convolutions of ``model`` whose weight is not among the chosen parameters ``point``.

    Only plain zero-padded ``nn.Conv1d/2d/3d`` (numeric or ``"valid"`` padding) that do not already
    carry their own ``_conv_forward``; any other convolution keeps PyTorch's backward.
    """
    found = []
    for name, module in model.named_modules():
        if type(module) not in (nn.Conv1d, nn.Conv2d, nn.Conv3d) or "_conv_forward" in vars(module):
            continue
        if module.padding_mode != "zeros" or module.padding == "same":
            continue
        if (f"{name}.weight" if name else "weight") not in point:
            found.append(module)
    return found


def _affine_batch_norm(module: _BatchNorm, x: Tensor) -> Tensor:
    """An eval-mode BatchNorm layer as the affine map ``x ↦ x·s + (β − μ s)`` with ``s = γ/√(σ² + ε)``.

    In train mode the layer's own forward (batch statistics) runs instead.
    """
    if module.training:
        return type(module).forward(module, x)
    scale = torch.rsqrt(module.running_var + module.eps)
    if module.affine:
        scale = module.weight * scale
        shift = module.bias - module.running_mean * scale
    else:
        shift = -module.running_mean * scale
    shape = (-1, *([1] * (x.dim() - 2)))  # channels are dimension 1 of a batch (N, C, ...)
    return _ChannelAffine.apply(x, scale.reshape(shape), shift.reshape(shape))


class _ChannelAffine(torch.autograd.Function):
    """``x·s + b`` (one :func:`torch.addcmul`) with the backward of ``addcmul`` minus its copy of ``x``.

    PyTorch's backward forms ``grad · (x · 1)``, a copy of the activation kept by the second-order graph; this one
    forms ``grad · x`` from the saved ``x``, bit for bit the same.
    """

    @staticmethod
    def forward(x: Tensor, scale: Tensor, shift: Tensor) -> Tensor:
        return torch.addcmul(shift, x, scale)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Tensor) -> None:
        x, scale, shift = inputs
        ctx.save_for_backward(x, scale)
        ctx.shapes = (scale.shape, shift.shape)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        x, scale = ctx.saved_tensors
        scale_shape, shift_shape = ctx.shapes
        need_x, need_scale, need_shift = ctx.needs_input_grad
        return (
            grad * scale if need_x else None,
            (grad * x).sum_to_size(scale_shape) if need_scale else None,
            grad.sum_to_size(shift_shape) if need_shift else None,
        )


def _eval_batch_norms(model: nn.Module) -> list[nn.Module]:
    """The BatchNorm layers of ``model`` that normalize with running statistics in eval mode."""
    return [
        m
        for m in model.modules()
        if isinstance(m, _BatchNorm)
        and m.running_mean is not None
        and m.running_var is not None
        and "forward" not in vars(m)
    ]


@contextlib.contextmanager
def _lean_second_order(convolutions: Sequence[nn.Module], batch_norms: Sequence[nn.Module]) -> Iterator[None]:
    """Within the block, route convolutions via :class:`_FrozenWeightConv`, BatchNorm via :func:`_affine_batch_norm`."""
    for module in convolutions:
        module._conv_forward = functools.partial(_frozen_conv_forward, module)
    for module in batch_norms:
        module.forward = functools.partial(_affine_batch_norm, module)
    try:
        yield
    finally:
        for module in convolutions:
            vars(module).pop("_conv_forward", None)
        for module in batch_norms:
            vars(module).pop("forward", None)


_EMPTY = "the data for the Hessian is empty (no batch with at least one example): pass the training batches"


def hvp_fn(
    model: nn.Module,
    data: Iterable[Batch] | Batch,
    *,
    loss_fn: LossFn | None = None,
    params: ParamSelection = None,
    weights: Mapping[str, Tensor] | None = None,
    hvp: HVPMethod | str = HVPMethod.DOUBLE_BACKWARD,
    chunk_size: int | str | None = "auto",
) -> HessianOperator:
    """Return the Hessian-vector product ``v ↦ ∇²L_S(w) v`` of the mean loss over ``data``.

    ``L_S(w) = Σ_j (n_j/n) L_{B_j}(w)`` over the batches ``B_j`` of ``data``. The point ``w`` is taken, per
    tensor, from ``params`` if it is a dict, else from ``weights``, else from the model itself.

    Args:
        model: called as ``functional_call(model, weights, (x,))``, in eval mode during each product.
        data: a DataLoader or any re-iterable of ``(x, y)`` batches (a one-shot iterator is read into a list), or
            one batch. It is iterated once per product, so it should be deterministic (no random augmentation, no
            ``drop_last`` with shuffling).
        loss_fn: ``loss_fn(logits, y)`` returning the *mean* loss over the batch; cross-entropy when ``None``.
        params: the parameters to differentiate (:data:`ParamSelection`); the others stay fixed.
        weights: parameters and/or buffers by module name at which to evaluate (e.g. a posterior sample); the
            rest keep the model's values. Without it, a FlatbmaWarning says when the module is not its BMA's mean.
        hvp: :class:`HVPMethod`.
        chunk_size: most examples per gradient graph (a larger batch is split into near-equal chunks; memory
            scales with a chunk, the sum equals the batch's product to rounding). ``None``: whole batches.
            ``"auto"``: :data:`CPU_CHUNK_SIZE` on CPU, whole batches elsewhere.

    Raises:
        FlatbmaError: on empty data, unknown or duplicate parameter names, shape mismatches, or an unused parameter set.
    """
    return HessianOperator(model, data, loss_fn=loss_fn, params=params, weights=weights, hvp=hvp, chunk_size=chunk_size)


CPU_CHUNK_SIZE = 20
"""Examples per gradient graph on CPU when ``chunk_size="auto"`` (:func:`hvp_fn`): the smallest chunk as fast per
example as whole batches; a product's transient memory is proportional to the chunk."""


def _chunk_size(value: int | str | None, device: torch.device) -> int | None:
    if value == "auto":
        return CPU_CHUNK_SIZE if device.type == "cpu" else None
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise FlatbmaError(f'chunk_size must be a positive integer, None or "auto" (got {value!r})')
    return value


def _resolve_weights(
    model: nn.Module, params: ParamSelection, weights: Mapping[str, Tensor] | None
) -> tuple[Params, Params]:
    """Split into ``(point, fixed)``: the chosen parameters and the other given tensors."""
    named_params = dict(model.named_parameters())
    known = {**dict(model.named_buffers()), **named_params}
    weights = dict(weights or {})
    for k in weights:
        if k not in known:
            raise FlatbmaError(
                f"weights has a tensor {k!r} that the model does not have.{suggest(k, known)} "
                "Pass the weights of this model (parameters and buffers by module name)."
            )
    if params is None:
        names = [k for k, p in named_params.items() if p.requires_grad]
        if not names:
            raise FlatbmaError(
                "the model has no trainable parameter (all have requires_grad=False): pass params= to "
                "choose the parameters of the Hessian"
            )
    elif isinstance(params, str):
        raise FlatbmaError(f"params must be a list of parameter names or a dict, not the string {params!r}")
    else:
        names = list(params)
        if not names:
            raise FlatbmaError("params is empty: choose at least one parameter, or pass None for all trainable ones")
    seen: set[str] = set()
    for k in names:
        if k in seen:
            raise FlatbmaError(f"parameter {k!r} is chosen twice in params")
        seen.add(k)
        if k not in named_params:
            what = "is a buffer, not a parameter" if k in known else "is not a parameter of the model"
            raise FlatbmaError(f"params: {k!r} {what}.{suggest(k, named_params)}")
    point = {}
    for k in names:
        value = params[k] if isinstance(params, Mapping) else weights.get(k, named_params[k])
        if value.shape != named_params[k].shape:
            raise FlatbmaError(
                f"parameter {k!r} has shape {tuple(value.shape)} but the model expects {tuple(named_params[k].shape)}"
            )
        if not value.is_floating_point():
            raise FlatbmaError(f"parameter {k!r} is not floating point ({value.dtype})")
        point[k] = value.detach()
    # the parameters that are not chosen enter detached, so no graph is built through them
    fixed = {k: v.detach() for k, v in named_params.items() if k not in point}
    fixed.update({k: v.detach() for k, v in weights.items() if k not in point})
    return point, fixed


def _reiterable(data: Any) -> Iterable[Batch]:
    if isinstance(data, (tuple, list)) and len(data) == 2 and all(isinstance(t, Tensor) for t in data):
        return [(data[0], data[1])]
    if isinstance(data, Mapping):  # one dict batch {"x": ..., "y": ...}
        return [_unpack(data)]
    if isinstance(data, Tensor) or not isinstance(data, Iterable):
        raise FlatbmaError(
            f"data must be a DataLoader, an iterable of (x, y) batches or one (x, y) batch, not {type(data).__name__}"
        )
    if iter(data) is data:  # one-shot iterator: it would be exhausted after the first product
        return list(data)
    return data


def _unpack(batch: Any) -> Batch:
    """``(x, y)`` of a Hessian data batch: a pair, or a dict read as in training (:func:`flatbma.types.split_batch`)."""
    if isinstance(batch, Mapping):
        x, y = split_batch(batch)
        if y is None:
            raise FlatbmaError(
                "a dict batch of the Hessian data must hold its targets under one of the keys "
                f"{', '.join(TARGET_KEYS)}, got the keys {', '.join(repr(k) for k in batch)}"
            )
        return x, y
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    raise FlatbmaError(
        f"every batch of the Hessian data must be a pair (x, y) or a dict {{'x': ..., 'y': ...}}; got "
        f"{type(batch).__name__}" + (f" of length {len(batch)}" if isinstance(batch, (tuple, list)) else "")
    )


def _shorten(names: Sequence[str], limit: int = 4) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f", … ({len(names) - limit} more)" if len(names) > limit else "")


def nonzero_checked(op: HessianOperator) -> Callable[[Tensor], Tensor]:
    """``op`` as a matvec that raises if its first product (with a random vector) is exactly zero.

    ``H v = 0`` for a random ``v`` means ``H = 0`` almost surely: the loss is at most linear in the
    chosen parameters, so no curvature statistic is meaningful.
    """
    first = [True]

    def matvec(v: Tensor) -> Tensor:
        hv = op(v)
        if first[0]:
            first[0] = False
            if not bool(hv.any()) and bool(v.any()):
                raise FlatbmaError(
                    "the Hessian of the loss with respect to the chosen parameters is identically zero "
                    "(the loss is at most linear in them): choose parameters the loss depends on nonlinearly"
                )
        return hv

    return matvec
