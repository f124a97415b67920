"""Streaming estimators of the curvature ``H`` of the summed loss ``Σ_i ℓ(f(x_i; w), y_i)`` at a point ``w``.

``H`` is the generalized Gauss-Newton ``G = Σ_i J_iᵀ Λ_i J_i = Σ_ik r_ik r_ikᵀ``, ``r_ik = J_iᵀ L_i e_k``
with ``Λ_i = L_i L_iᵀ`` the loss Hessian in the logits (Martens & Grosse 2015; Immer et al. 2021), or
the empirical Fisher ``Σ_i g_i g_iᵀ``, ``g_i = J_iᵀ ∇_f ℓ_i`` (one cotangent per example; Kunstner et al.
2019: not second-order information), with rows from :mod:`flatbma.jacobians`. An estimator adds one batch at a
time to fixed-shape accumulators (``init``), so a pass over the data can be checkpointed and resumed anywhere,
and turns them into :class:`~flatbma.curvature.structures.Blocks` with ``H = (n / n_seen) · Σ_seen`` (``n`` =
data size, ``n_seen`` = examples accumulated): the per-example mean scaled to the data size, exact when every
example was seen once. The forms are :class:`DiagEstimator`, :class:`KfacEstimator`, :class:`FullEstimator`
(primal ``[d, d]``) and :class:`DualEstimator` (the rows ``W ∈ R^{nK×d}``, ``H = WᵀW``; Khan et al. 2019); what
each structure holds: docs/methods.md §3.9.

Accumulators are float64 (the dual rows: the parameters' dtype), on the parameters' device, keyed
without prefix in sorted order. ``accumulate`` updates them in place and returns them. The model runs in
eval mode (BatchNorm on the given buffers, no dropout), so ``H`` is that of a deterministic function.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from functools import reduce as _fold

import torch
from torch import Tensor, nn
from torch.func import functional_call

from flatbma.bn import eval_mode
from flatbma.checks import parse_choice
from flatbma.curvature import kfac
from flatbma.curvature.options import Curvature, Hessian
from flatbma.curvature.structures import Blocks, DenseBlock, DiagBlock, KronBlock, LowRankBlock, symmetric_eigh
from flatbma.errors import FlatbmaError, suggest
from flatbma.jacobians import ce_gradient, ce_sqrt_hessian, rows
from flatbma.types import Params

__all__ = [
    "CROSS_ENTROPY",
    "DiagEstimator",
    "DualEstimator",
    "Estimator",
    "FullEstimator",
    "KfacEstimator",
    "Likelihood",
    "estimator",
    "squared_error",
]

F64 = torch.float64
ROWS_BUDGET_BYTES = 64 * 2**20
"""Rows computed at once (float64 bytes): the examples of a batch are processed in chunks that fit."""

Reduce = Callable[[Params], Params]


@dataclass(frozen=True)
class Likelihood:
    """A per-example loss ``ℓ(f, y)`` as the curvature sees it.

    Attributes:
        sqrt_hessian: ``(logits [B, C], y) -> L [B, C, K]`` with ``L_i L_iᵀ = ∇²_f ℓ(f_i, y_i)``.
        gradient: ``(logits, y) -> ∇_f ℓ [B, C]``.
    """

    sqrt_hessian: Callable[[Tensor, Tensor], Tensor]
    gradient: Callable[[Tensor, Tensor], Tensor]


def _ce_sqrt_hessian(logits: Tensor, _y: Tensor) -> Tensor:
    return ce_sqrt_hessian(logits)


CROSS_ENTROPY = Likelihood(_ce_sqrt_hessian, ce_gradient)
"""Softmax cross-entropy: ``L = diag √p − p√pᵀ``, ``∇ = p − onehot(y)``."""


def squared_error(sigma: float = 1.0) -> Likelihood:
    """``ℓ = ‖f − y‖² / (2σ²)`` (a Gaussian likelihood): ``L = I/σ``, ``∇ = (f − y)/σ²``."""

    def sqrt_hessian(logits: Tensor, _y: Tensor) -> Tensor:
        eye = torch.eye(logits.shape[-1], dtype=logits.dtype, device=logits.device) / sigma
        return eye.expand(logits.shape[0], -1, -1)

    def gradient(logits: Tensor, y: Tensor) -> Tensor:
        return (logits.detach() - y.to(logits.dtype)) / sigma**2

    return Likelihood(sqrt_hessian, gradient)


class Estimator:
    """Adds batches to curvature accumulators and turns them into :class:`Blocks` (module docstring).

    Attributes:
        form: ``"diag"``, ``"kfac"``, ``"full"`` (primal) or ``"dual"``.
        names: the parameters' names, sorted.
        cotangents: ``K``, cotangents per example (``C`` for the GGN, 1 for the empirical Fisher).
        blockwise: whether ``H`` is block-diagonal over single parameter tensors (a ``layerwise`` prior).
        data_parallel: whether ``accumulate`` accepts a ``reduce`` (all but the dual form).
    """

    form = ""
    blockwise = True
    data_parallel = True

    def __init__(
        self,
        model: nn.Module,
        params: Mapping[str, Tensor],
        *,
        num_data: int,
        num_classes: int,
        curvature: Curvature,
        likelihood: Likelihood,
        chunk: int | None,
    ) -> None:
        self.model = model
        self.names = tuple(sorted(params))
        self.shapes = {n: params[n].shape for n in self.names}
        self.dtypes = {n: params[n].dtype for n in self.names}
        self.device = params[self.names[0]].device
        self.num_data = num_data
        self.num_classes = num_classes
        self.curvature = curvature
        self.likelihood = likelihood
        self.cotangents = num_classes if curvature is Curvature.GGN else 1
        self.chunk = chunk
        self.dim = sum(s.numel() for s in self.shapes.values())

    # -- the contract ------------------------------------------------------------------------

    def init(self) -> Params:
        """Zero accumulators of fixed shapes (sorted keys, float64; the dual rows in the parameters' dtype)."""
        return {k: torch.zeros(shape, dtype=dtype, device=self.device) for k, (shape, dtype) in self._layout().items()}

    def accumulate(
        self,
        acc: Params,
        params: Mapping[str, Tensor],
        buffers: Mapping[str, Tensor],
        x: Tensor,
        y: Tensor,
        *,
        offset: int,
        reduce: Reduce | None = None,
    ) -> Params:
        """Add the curvature of batch ``(x, y)`` at ``w = params`` to ``acc`` (in place) and return it.

        Args:
            acc: accumulators from :meth:`init` (or a previous call).
            params: the point ``w`` (the chosen parameters, by name).
            buffers: the model's buffers (BatchNorm running statistics), used as given.
            x: inputs ``[b, ...]``.
            y: labels ``[b]`` (targets ``[b, C]`` for :func:`squared_error`).
            offset: index of the batch's first example within the pass (the dual form's row slot).
            reduce: data parallelism: ``mean over processes`` of a dict of tensors; the batch's increment
                ``Δ`` is added as ``b · reduce(Δ / b)`` (``b`` the local batch size).
        """
        b = int(x.shape[0])
        if b == 0:
            return acc
        with eval_mode(self.model):
            inc = self._increment(acc, params, buffers, x, y, offset)
        if reduce is not None:
            inc = {k: v * b for k, v in reduce({k: v / b for k, v in inc.items()}).items()}
        for k, v in inc.items():
            acc[k].add_(v)
        return acc

    def blocks(self, acc: Mapping[str, Tensor], n_seen: int, num_data: int) -> Blocks:
        """``H = (num_data / n_seen) · Σ_seen`` in block-diagonal eigen form (float64)."""
        if n_seen < 1:
            raise FlatbmaError("no curvature was accumulated (0 examples seen); run at least one batch of the pass")
        return Blocks(self._blocks(acc, num_data / n_seen, n_seen), self.dtypes)

    def describe(self) -> str:
        """One line saying how ``H`` is structured, e.g. ``"kfac (ggn): 12800 weights in Kronecker blocks, ..."``."""
        raise NotImplementedError

    # -- shared pieces -----------------------------------------------------------------------

    def _layout(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        raise NotImplementedError

    def _increment(self, acc, params, buffers, x, y, offset) -> dict[str, Tensor]:
        raise NotImplementedError

    def _blocks(self, acc: Mapping[str, Tensor], scale: float, n_seen: int) -> dict[str, object]:
        raise NotImplementedError

    def _fn(self, fixed: Mapping[str, Tensor], buffers: Mapping[str, Tensor]):
        """``fn(p, x) = f(x; p ∪ fixed)`` with the model's buffers: the logits as a function of ``p``."""
        held = {**{k: v.detach() for k, v in fixed.items()}, **buffers}
        return lambda p, x: functional_call(self.model, {**held, **p}, (x,))

    def _logits(self, params, buffers, x: Tensor) -> Tensor:
        with torch.no_grad():
            return self._fn(params, buffers)({}, x)

    def _cotangent(self, logits: Tensor, y: Tensor) -> Tensor:
        """``[b, K, C]``: the columns of ``L_i`` (GGN) or the loss gradient (EF)."""
        if logits.ndim != 2 or logits.shape[-1] != self.num_classes:
            raise FlatbmaError(
                f"the curvature expects logits [batch, {self.num_classes}] (num_classes = {self.num_classes}), "
                f"but the model returned {list(logits.shape)}"
            )
        if self.curvature is Curvature.EF:
            return self.likelihood.gradient(logits, y).unsqueeze(1)
        return self.likelihood.sqrt_hessian(logits, y).mT

    def _row_chunks(self, names, params, buffers, x, cot) -> Iterator[Params]:
        """Rows ``{name: [c, K, *shape]}`` of the parameters ``names`` over chunks of the batch's examples."""
        sub = {n: params[n].detach() for n in names}
        fixed = {k: v for k, v in params.items() if k not in sub}
        fn = self._fn(fixed, buffers)
        width = sum(self.shapes[n].numel() for n in names) * cot.shape[1] * 8
        step = self.chunk if self.chunk is not None else max(1, ROWS_BUDGET_BYTES // max(width, 1))
        for start in range(0, x.shape[0], step):
            yield rows(fn, sub, x[start : start + step], cot[start : start + step])

    def _diag_increment(self, names, params, buffers, x, cot) -> dict[str, Tensor]:
        inc = {f"diag/{n}": torch.zeros(self.shapes[n], dtype=F64, device=self.device) for n in names}
        if names:
            for r in self._row_chunks(names, params, buffers, x, cot):
                for n in names:
                    inc[f"diag/{n}"] += r[n].to(F64).square().sum((0, 1))
        return inc


class DiagEstimator(Estimator):
    """``diag H = Σ_ik r_ik²`` for every parameter (``K`` per-example vector-Jacobian products)."""

    form = "diag"

    def _layout(self):
        return {f"diag/{n}": (tuple(self.shapes[n]), F64) for n in self.names}

    def _increment(self, acc, params, buffers, x, y, offset):
        cot = self._cotangent(self._logits(params, buffers, x), y)
        return self._diag_increment(self.names, params, buffers, x, cot)

    def _blocks(self, acc, scale, n_seen):
        return {n: DiagBlock((n,), scale * acc[f"diag/{n}"]) for n in self.names}

    def describe(self) -> str:  # noqa: D102 - Estimator.describe
        return f"diag ({self.curvature.value}): {self.dim} weights diagonal"


class KfacEstimator(Estimator):
    """``B ⊗ A`` for Linear/Conv2d weights, dense bias blocks, the exact diagonal elsewhere (:mod:`.kfac`)."""

    form = "kfac"

    def __init__(self, model, params, **kwargs) -> None:
        super().__init__(model, params, **kwargs)
        self.layers, self.fallbacks = kfac.kfac_layers(model, self.names)
        covered = {n for layer in self.layers for n in (layer.weight, layer.bias) if n is not None}
        self.diagonal = tuple(n for n in self.names if n not in covered)

    def _layout(self):
        out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        for layer in self.layers:
            if layer.weight is not None:
                out[f"kfac/A/{layer.weight}"] = ((layer.in_dim, layer.in_dim), F64)
                out[f"kfac/B/{layer.weight}"] = ((layer.out_dim, layer.out_dim), F64)
            if layer.bias is not None:
                out[f"dense/{layer.bias}"] = ((layer.out_dim, layer.out_dim), F64)
        for n in self.diagonal:
            out[f"diag/{n}"] = (tuple(self.shapes[n]), F64)
        return dict(sorted(out.items()))

    def _increment(self, acc, params, buffers, x, y, offset):
        leaves = {k: v.detach().requires_grad_(True) for k, v in params.items()}
        with kfac.captured(self.model, self.layers) as store, torch.enable_grad():
            logits = functional_call(self.model, {**buffers, **leaves}, (x,))
        cot = self._cotangent(logits.detach(), y)
        inc: dict[str, Tensor] = {}
        if self.layers:
            calls = [kfac.single_call(store, layer) for layer in self.layers]
            outputs = [out for _, out in calls]
            grads = torch.autograd.grad(
                logits, outputs, cot.transpose(0, 1).to(logits.dtype), is_grads_batched=True, allow_unused=True
            )
            for layer, (inputs, out), g in zip(self.layers, calls, grads, strict=True):
                if g is None:
                    g = torch.zeros(cot.shape[1], *out.shape, dtype=out.dtype, device=out.device)
                parts = kfac.increments(layer, inputs, g)
                if layer.weight is not None:
                    inc[f"kfac/A/{layer.weight}"] = parts["A"]
                    inc[f"kfac/B/{layer.weight}"] = parts["B"]
                if layer.bias is not None:
                    inc[f"dense/{layer.bias}"] = parts["bias"]
            del grads, outputs, calls
        del store, logits
        inc.update(self._diag_increment(self.diagonal, params, buffers, x, cot))
        return inc

    def _blocks(self, acc, scale, n_seen):
        out: dict[str, object] = {}
        for layer in self.layers:
            if layer.weight is not None:
                a, u_a = symmetric_eigh(acc[f"kfac/A/{layer.weight}"] / n_seen)
                b, u_b = symmetric_eigh(scale * acc[f"kfac/B/{layer.weight}"])
                out[layer.weight] = KronBlock((layer.weight,), self.shapes[layer.weight], b, u_b, a, u_a)
            if layer.bias is not None:
                lam, q = symmetric_eigh(scale * acc[f"dense/{layer.bias}"])
                out[layer.bias] = DenseBlock((layer.bias,), (self.shapes[layer.bias],), lam, q)
        for n in self.diagonal:
            out[n] = DiagBlock((n,), scale * acc[f"diag/{n}"])
        return out

    def describe(self) -> str:  # noqa: D102 - Estimator.describe
        kron = sum(self.shapes[layer.weight].numel() for layer in self.layers if layer.weight is not None)
        dense = sum(self.shapes[layer.bias].numel() for layer in self.layers if layer.bias is not None)
        diag = sum(self.shapes[n].numel() for n in self.diagonal)
        text = (
            f"kfac ({self.curvature.value}): {kron} weights in Kronecker blocks, {dense} in dense bias blocks, "
            f"{diag} diagonal"
        )
        if self.fallbacks:
            shown = ", ".join(f"{m} ({why})" for m, why in list(self.fallbacks.items())[:3])
            more = f" and {len(self.fallbacks) - 3} more" if len(self.fallbacks) > 3 else ""
            text += f"; convolutions kept diagonal: {shown}{more}"
        return text


def _flat_rows(r: Params, names: tuple[str, ...]) -> Tensor:
    """``[c·K, d]``: the rows of ``names`` concatenated per (example, cotangent)."""
    head = r[names[0]].shape[:2]
    return torch.cat([r[n].reshape(*head, -1) for n in names], dim=-1).reshape(head.numel(), -1)


class FullEstimator(Estimator):
    """The full ``H = Σ_i R_iᵀ R_i`` ``[d, d]`` (primal form, ``d ≤ max_full``); one block ``"full"``."""

    form = "full"
    blockwise = False

    def _layout(self):
        return {"full": ((self.dim, self.dim), F64)}

    def _increment(self, acc, params, buffers, x, y, offset):
        cot = self._cotangent(self._logits(params, buffers, x), y)
        inc = torch.zeros(self.dim, self.dim, dtype=F64, device=self.device)
        for r in self._row_chunks(self.names, params, buffers, x, cot):
            flat = _flat_rows(r, self.names).to(F64)
            inc.addmm_(flat.mT, flat)
        return {"full": inc}

    def _blocks(self, acc, scale, n_seen):
        lam, q = symmetric_eigh(scale * acc["full"])
        return {"full": DenseBlock(self.names, tuple(self.shapes[n] for n in self.names), lam, q)}

    def describe(self) -> str:  # noqa: D102 - Estimator.describe
        return f"full ({self.curvature.value}): {self.dim} weights, dense {self.dim}×{self.dim}"


class DualEstimator(Estimator):
    """The rows ``W ∈ R^{nK×d}`` (``H = WᵀW``; Khan et al. 2019), for ``nK ≤ max_full < d``; one block ``"full"``.

    Example ``i`` of the pass owns rows ``iK … iK+K−1`` (``offset`` places a batch); rows of examples never
    seen stay 0. The eigenpairs come from the Gram matrix ``WWᵀ = U diag λ Uᵀ``: ``H = V diag λ Vᵀ`` with
    ``V = WᵀUλ^{−1/2}`` over the ``r`` eigenvalues above ``λ_max · max(nK, d) · ε₆₄``.
    """

    form = "dual"
    blockwise = False
    data_parallel = False

    def _layout(self):
        dtype = _fold(torch.promote_types, self.dtypes.values())
        return {"rows": ((self.num_data * self.cotangents, self.dim), dtype)}

    def accumulate(self, acc, params, buffers, x, y, *, offset, reduce=None):
        """Write the batch's rows into their slots (see the class docstring); no ``reduce``."""
        if reduce is not None:
            raise FlatbmaError(
                "hessian: full in its dual form (n·K ≤ max_full < d) stores per-example rows and cannot run under "
                "train.parallel: data; use hessian: kfac or diag, or run on one process"
            )
        b = int(x.shape[0])
        if offset < 0 or offset + b > self.num_data:
            raise FlatbmaError(
                f"the curvature pass has {self.num_data} examples (num_data) but a batch covers examples "
                f"{offset}..{offset + b - 1}; give num_data = the size of the data the pass runs over"
            )
        if b == 0:
            return acc
        with eval_mode(self.model):
            cot = self._cotangent(self._logits(params, buffers, x), y)
            start = offset * self.cotangents
            for r in self._row_chunks(self.names, params, buffers, x, cot):
                flat = _flat_rows(r, self.names)
                acc["rows"][start : start + flat.shape[0]].copy_(flat)
                start += flat.shape[0]
        return acc

    def _blocks(self, acc, scale, n_seen):
        w = acc["rows"]
        step = max(1, ROWS_BUDGET_BYTES // (8 * max(w.shape[0], 1)))
        gram = torch.zeros(w.shape[0], w.shape[0], dtype=F64, device=w.device)
        for j in range(0, w.shape[1], step):
            part = w[:, j : j + step].to(F64)
            gram.addmm_(part, part.mT)
        lam, u = symmetric_eigh(gram)
        cut = float(lam.max()) * max(w.shape) * torch.finfo(F64).eps if lam.numel() else 0.0
        keep = lam > cut
        lam, u = lam[keep], u[:, keep]
        coeff = u / lam.sqrt()
        v = torch.cat([w[:, j : j + step].to(F64).mT @ coeff for j in range(0, w.shape[1], step)], dim=0)
        shapes = tuple(self.shapes[n] for n in self.names)
        return {"full": LowRankBlock(self.names, shapes, scale * lam, v)}

    def describe(self) -> str:  # noqa: D102 - Estimator.describe
        rows_ = self.num_data * self.cotangents
        return f"full ({self.curvature.value}, dual): {self.dim} weights, rows {rows_}×{self.dim}"


_ESTIMATORS: dict[Hessian, type[Estimator]] = {Hessian.DIAG: DiagEstimator, Hessian.KFAC: KfacEstimator}


def estimator(
    hessian: Hessian | str,
    curvature: Curvature | str,
    model: nn.Module,
    params: Mapping[str, Tensor],
    *,
    num_data: int,
    num_classes: int,
    max_full: int = 4096,
    likelihood: Likelihood = CROSS_ENTROPY,
    chunk: int | None = None,
) -> Estimator:
    """The estimator of ``H`` (structure ``hessian``, kind ``curvature``) over ``params`` of ``model``.

    ``hessian: full`` is the primal ``[d, d]`` matrix when ``d ≤ max_full``, the dual rows when
    ``n·K ≤ max_full < d`` (``K = num_classes`` for the GGN, 1 for the empirical Fisher), and refused otherwise.
    Of ``params`` (by ``model.named_parameters()`` name) only names, shapes, dtypes and device are read here;
    ``num_data`` is ``n``, the size of the data the pass runs over; ``likelihood`` gives the loss's Hessian factor
    and gradient in the logits (e.g. :func:`squared_error`); ``chunk`` examples have their rows computed at once
    (``None``: as many as fit 64 MB of rows).
    """
    hessian = parse_choice(Hessian, hessian, "hessian")
    curvature = parse_choice(Curvature, curvature, "curvature")
    if not params:
        raise FlatbmaError("the curvature needs at least one parameter; make some weights trainable (model.trainable)")
    own = dict(model.named_parameters())
    for name, value in params.items():
        if name not in own:
            raise FlatbmaError(f"the model has no parameter {name!r}.{suggest(name, own)}")
        if tuple(value.shape) != tuple(own[name].shape):
            raise FlatbmaError(f"{name!r} has shape {tuple(value.shape)} but the model's is {tuple(own[name].shape)}")
    for key, value in (("num_data", num_data), ("num_classes", num_classes), ("max_full", max_full)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise FlatbmaError(f"{key} must be a positive integer, got {value!r}")
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
        raise FlatbmaError(f"chunk must be a positive integer or None, got {chunk!r}")
    kwargs = dict(num_data=num_data, num_classes=num_classes, curvature=curvature, likelihood=likelihood, chunk=chunk)
    if hessian is not Hessian.FULL:
        return _ESTIMATORS[hessian](model, params, **kwargs)
    d = sum(v.numel() for v in params.values())
    k = num_classes if curvature is Curvature.GGN else 1
    if d <= max_full:
        return FullEstimator(model, params, **kwargs)
    if num_data * k <= max_full:
        return DualEstimator(model, params, **kwargs)
    raise FlatbmaError(
        f"hessian: full needs d ≤ max_full (primal) or n·K ≤ max_full (dual), but d = {d} and n·K = {num_data}·{k} = "
        f"{num_data * k} exceed max_full = {max_full}; use hessian: kfac or diag, make fewer weights Bayesian "
        "(model.trainable: classifier), or raise max_full"
    )
