"""Tiny float64 models and dense references (built without flatbma.curvature) for the curvature tests."""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

F64 = torch.float64


def tiny_cnn(seed: int = 0, classes: int = 3) -> nn.Module:
    """Conv(pad 1) → BN → tanh → Conv(stride 2) → flatten → Linear, eval mode, random BN statistics."""
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1),
        nn.BatchNorm2d(3),
        nn.Tanh(),
        nn.Conv2d(3, 2, 3, stride=2),
        nn.Flatten(),
        nn.Linear(2 * 2 * 2, classes),
    ).to(F64)
    with torch.no_grad():
        model[1].running_mean.normal_()
        model[1].running_var.uniform_(0.5, 2.0)
        model[1].weight.normal_()
        model[1].bias.normal_()
    return model.eval()


def images(n: int, seed: int = 1, classes: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 2, 5, 5, generator=g, dtype=F64), torch.randint(0, classes, (n,), generator=g)


def params_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters() if v.requires_grad}


def buffers_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_buffers()}


def flat(tensors: Mapping[str, torch.Tensor], names=None) -> torch.Tensor:
    names = sorted(tensors) if names is None else names
    return torch.cat([tensors[n].reshape(-1) for n in names])


def per_example_jacobians(model, params, buffers, x) -> torch.Tensor:
    """``[n, C, d]`` Jacobians of the logits in the flat sorted-name layout, by ``torch.func.jacrev``."""
    names = sorted(params)
    shapes = [params[n].shape for n in names]

    def f(vec, xi):
        pieces = vec.split([s.numel() for s in shapes])
        p = {n: piece.view(s) for n, piece, s in zip(names, pieces, shapes, strict=True)}
        return functional_call(model, {**buffers, **p}, (xi.unsqueeze(0),)).squeeze(0)

    vec = flat(params, names)
    return torch.stack([torch.func.jacrev(f)(vec, xi) for xi in x])


def ce_hessian(logits: torch.Tensor) -> torch.Tensor:
    """``Λ_i = diag p_i − p_i p_iᵀ`` written out."""
    p = F.softmax(logits, -1)
    return torch.diag_embed(p) - p.unsqueeze(-1) * p.unsqueeze(-2)


def dense_ggn(model, params, buffers, x, hessian=ce_hessian) -> torch.Tensor:
    """``Σ_i J_iᵀ Λ_i J_i`` ``[d, d]`` from jacrev and an explicit ``Λ`` (``hessian(logits) -> [n, C, C]``)."""
    jac = per_example_jacobians(model, params, buffers, x)
    with torch.no_grad():
        lam = hessian(functional_call(model, {**buffers, **params}, (x,)))
    return torch.einsum("nci,ncd,ndj->ij", jac, lam, jac)


def per_example_grads(model, params, buffers, x, y) -> torch.Tensor:
    """``[n, d]`` gradients of the per-example cross-entropy by a loop of ``torch.autograd.grad``."""
    names = sorted(params)
    out = []
    for xi, yi in zip(x, y, strict=True):
        leaves = {k: v.clone().requires_grad_(True) for k, v in params.items()}
        loss = F.cross_entropy(functional_call(model, {**buffers, **leaves}, (xi[None],)), yi[None], reduction="sum")
        grads = torch.autograd.grad(loss, [leaves[n] for n in names])
        out.append(torch.cat([g.reshape(-1) for g in grads]))
    return torch.stack(out)


def block_slices(params: Mapping[str, torch.Tensor]) -> dict[str, slice]:
    """Slice of each parameter in the flat sorted-name layout."""
    out, start = {}, 0
    for n in sorted(params):
        out[n] = slice(start, start + params[n].numel())
        start += params[n].numel()
    return out
