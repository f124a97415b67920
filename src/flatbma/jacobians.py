"""Per-example Jacobian-transpose rows of a network's logits, and the cross-entropy factors they meet.

With ``J_i = ∂f(x_i; w)/∂w ∈ R^{C×d}`` and cotangents ``s_ik ∈ R^C``, :func:`rows` computes ``r_ik = J_iᵀ s_ik``
by ``torch.func.vmap`` of ``torch.func.vjp`` over examples: no ``[B, C, d]`` Jacobian unless asked for
(:func:`jacobian`). A loss Hessian ``Λ_i = L_i L_iᵀ`` gives the generalized Gauss-Newton
``G = Σ_i J_iᵀ Λ_i J_i = Σ_ik r_ik r_ikᵀ`` with ``s_ik = L_i e_k`` (Martens & Grosse 2015); the empirical Fisher
takes ``s_i`` the loss gradient (derivation: docs/methods.md §3.9).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from flatbma.types import Params

__all__ = ["Fn", "ce_gradient", "ce_sqrt_hessian", "jacobian", "rows"]

Fn = Callable[[Params, Tensor], Tensor]
"""``fn(params, x) -> logits [B, C]``; examples must not interact (eval-mode BatchNorm)."""


def rows(fn: Fn, params: Params, x: Tensor, cotangents: Tensor, *, chunk: int | None = None) -> Params:
    """Per-example rows ``r_ik = J_iᵀ s_ik`` of the logits' Jacobian transposed.

    ``fn`` is called on one example at a time (``x_i[None]``), at the point ``params``; ``x`` is ``[B, *in]``,
    ``cotangents`` ``[B, K, C]`` with ``cotangents[i, k] = s_ik``; ``chunk``, examples per vmapped call (``None``:
    all at once), bounds memory, not the result.

    Returns:
        ``{name: [B, K, *shape]}`` with ``out[name][i, k] = (J_iᵀ s_ik)[name]``.
    """
    primals = {k: v.detach() for k, v in params.items()}

    def one(xi: Tensor, si: Tensor) -> Params:
        _, vjp_fn = torch.func.vjp(lambda p: fn(p, xi.unsqueeze(0)).squeeze(0), primals)
        return torch.func.vmap(vjp_fn)(si)[0]

    with torch.enable_grad():
        out = torch.func.vmap(one, chunk_size=chunk)(x, cotangents.to(x.device))
    return {k: out[k] for k in params}


def jacobian(fn: Fn, params: Params, x: Tensor, *, chunk: int | None = None) -> Params:
    """Per-example Jacobians ``J_i = ∂f(x_i)/∂w`` of the logits: :func:`rows` with ``s_ik = e_k``.

    Returns:
        ``{name: [B, C, *shape]}``, ``out[name][i, c] = ∂f_c(x_i)/∂w[name]``.
    """
    with torch.no_grad():
        num_classes = fn({k: v.detach() for k, v in params.items()}, x[:1]).shape[-1]
    ref = next(iter(params.values()))
    eye = torch.eye(num_classes, dtype=ref.dtype, device=x.device)
    return rows(fn, params, x, eye.expand(x.shape[0], num_classes, num_classes), chunk=chunk)


def ce_sqrt_hessian(logits: Tensor) -> Tensor:
    """``L_i = diag √p_i − p_i √p_iᵀ`` ``[B, C, C]`` with ``L_i L_iᵀ = diag p_i − p_i p_iᵀ`` (``p = softmax``).

    The cotangents of the GGN are its columns: ``s_ik = L_i e_k``, i.e. ``L.mT[i, k]``.
    """
    log_p = F.log_softmax(logits.detach(), dim=-1)
    p, root = log_p.exp(), (0.5 * log_p).exp()
    return torch.diag_embed(root) - p.unsqueeze(-1) * root.unsqueeze(-2)


def ce_gradient(logits: Tensor, y: Tensor) -> Tensor:
    """``∇_f ℓ = p_i − onehot(y_i)`` ``[B, C]``: the cross-entropy's gradient with respect to the logits."""
    p = F.softmax(logits.detach(), dim=-1)
    return p - F.one_hot(y.long(), p.shape[-1]).to(p.dtype)
