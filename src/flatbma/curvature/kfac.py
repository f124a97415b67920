"""Kronecker factors of ``nn.Linear`` and ``nn.Conv2d`` weights: forward hooks, patches, factor increments.

For a weight ``W ∈ R^{out×in}`` (flattened row major) applied at locations ``t`` to inputs ``a_it`` with
output gradients ``b_ikt = ∂(s_ikᵀ f_i)/∂o_it`` (``s_ik`` the GGN cotangents), the per-example
gradient is ``Σ_t b_ikt ⊗ a_it``, and KFAC approximates the GGN block ``Σ_ik (Σ_t b⊗a)(Σ_t b⊗a)ᵀ`` by

    ``H_W ≈ B ⊗ A``,   ``A = Σ_it a_it a_itᵀ / (n_seen·T)``,   ``B = (n/n_seen) Σ_ikt b_ikt b_iktᵀ``

(Martens & Grosse 2015 for ``T = 1``; the "expand" form for convolutions and weight sharing, Grosse &
Martens 2016, Eschenhagen et al. 2023). It is exact for ``n = 1, T = 1``, and for every layer of a deep
linear network under squared error. The numerators ``Σ aaᵀ/T`` and ``Σ bbᵀ`` are accumulated separately
over batches and multiplied once, ``(ΣB)⊗(ΣA)/n``. For a convolution (``groups = 1``, zero padding) the
inputs are the patches ``F.unfold(x, k, dilation, padding, stride)`` ``[B, C_in·k_h·k_w, T]``, whose
rows are in the order of ``W.reshape(C_out, −1)``. A Linear layer applied to ``[B, *, in]`` counts the
middle dimensions as locations. A bias gets its exact dense GGN block ``Σ_ik (Σ_t b_ikt)(Σ_t b_ikt)ᵀ``.

The output gradients of every hooked layer come from one batched backward (examples do not mix in eval mode),
``torch.autograd.grad(logits, outputs, s[K, B, C], is_grads_batched=True)``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from flatbma.errors import FlatbmaError

__all__ = ["KfacLayer", "captured", "increments", "kfac_layers", "single_call"]

F64 = torch.float64


@dataclass(frozen=True)
class KfacLayer:
    """A Linear or Conv2d layer whose weight gets a Kronecker block (``weight``) and/or bias a dense one.

    Attributes:
        module: the module's qualified name.
        weight: the weight's parameter name when it is among the chosen parameters, else ``None``.
        bias: the bias's parameter name when it is among the chosen parameters, else ``None``.
        out_dim: output features / channels.
        in_dim: ``in`` of ``W.reshape(out, -1)`` (``C_in·k_h·k_w`` for a convolution).
        conv: ``(kernel_size, dilation, padding, stride)`` for a convolution, ``None`` for Linear.
    """

    module: str
    weight: str | None
    bias: str | None
    out_dim: int
    in_dim: int
    conv: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[int, ...]] | None = None


def kfac_layers(model: nn.Module, names: Sequence[str]) -> tuple[list[KfacLayer], dict[str, str]]:
    """The layers with a Kronecker block among ``names``, and the fallbacks ``{module: reason}``.

    ``nn.Linear`` and ``nn.Conv2d`` (exactly these types) whose weight or bias is in ``names`` qualify;
    a convolution with ``groups > 1``, a padding mode other than zeros or a string padding falls back
    to the diagonal (its parameters are then not covered by any layer).
    """
    chosen = set(names)
    layers: list[KfacLayer] = []
    fallbacks: dict[str, str] = {}
    for mod_name, module in model.named_modules():
        if type(module) not in (nn.Linear, nn.Conv2d):
            continue
        prefix = f"{mod_name}." if mod_name else ""
        weight = f"{prefix}weight" if f"{prefix}weight" in chosen else None
        bias = f"{prefix}bias" if module.bias is not None and f"{prefix}bias" in chosen else None
        if weight is None and bias is None:
            continue
        if isinstance(module, nn.Linear):
            layers.append(KfacLayer(mod_name, weight, bias, module.out_features, module.in_features))
            continue
        reason = _conv_fallback(module)
        if reason:
            fallbacks[mod_name] = reason
            continue
        w = module.weight
        geometry = (tuple(module.kernel_size), tuple(module.dilation), tuple(module.padding), tuple(module.stride))
        layers.append(KfacLayer(mod_name, weight, bias, w.shape[0], w[0].numel(), geometry))
    return layers, fallbacks


def _conv_fallback(conv: nn.Conv2d) -> str:
    if conv.groups != 1:
        return f"groups={conv.groups}"
    if conv.padding_mode != "zeros":
        return f"padding_mode={conv.padding_mode}"
    if isinstance(conv.padding, str):
        return f"padding={conv.padding!r}"
    return ""


@contextmanager
def captured(model: nn.Module, layers: Sequence[KfacLayer]) -> Iterator[dict[str, list[tuple[Tensor, Tensor]]]]:
    """Forward hooks recording ``(input, output)`` of every layer's calls while the block runs."""
    store: dict[str, list[tuple[Tensor, Tensor]]] = {layer.module: [] for layer in layers}

    def hook_for(key: str):
        def hook(_module: nn.Module, inputs: tuple[Tensor, ...], output: Tensor) -> None:
            store[key].append((inputs[0].detach(), output))

        return hook

    handles = [model.get_submodule(layer.module).register_forward_hook(hook_for(layer.module)) for layer in layers]
    try:
        yield store
    finally:
        for handle in handles:
            handle.remove()


def single_call(store: dict[str, list[tuple[Tensor, Tensor]]], layer: KfacLayer) -> tuple[Tensor, Tensor]:
    """The one ``(input, output)`` pair of ``layer``; a layer called twice or never is refused."""
    calls = store[layer.module]
    if len(calls) != 1:
        how = "never called through its forward" if not calls else f"called {len(calls)} times per forward pass"
        raise FlatbmaError(
            f"hessian: kfac needs every Linear/Conv2d layer called once per forward pass, but {layer.module!r} was "
            f"{how}; use hessian: diag"
        )
    return calls[0]


def increments(layer: KfacLayer, inputs: Tensor, grads: Tensor) -> dict[str, Tensor]:
    """One batch's factor numerators (float64) of ``layer``.

    ``inputs``: ``[B, *, in]`` (Linear) or ``[B, C_in, H, W]`` (Conv2d); ``grads``: ``[K, B, *output shape]``.

    Returns:
        ``"A"``: ``Σ_it a_it a_itᵀ / T`` (when the weight is chosen), ``"B"``: ``Σ_ikt b_ikt b_iktᵀ`` (weight),
        ``"bias"``: ``Σ_ik (Σ_t b_ikt)(Σ_t b_ikt)ᵀ`` (when the bias is chosen).
    """
    k, b = grads.shape[:2]
    if layer.conv is not None:
        g = grads.reshape(k, b, layer.out_dim, -1).transpose(-1, -2)  # [K, B, T, out]
    else:
        g = grads.reshape(k, b, -1, layer.out_dim)
    g = g.to(F64)
    out: dict[str, Tensor] = {}
    if layer.weight is not None:
        if layer.conv is not None:
            kernel, dilation, padding, stride = layer.conv
            a = F.unfold(inputs, kernel, dilation=dilation, padding=padding, stride=stride).transpose(1, 2)
        else:
            a = inputs.reshape(b, -1, layer.in_dim)
        locations = a.shape[1]
        a = a.reshape(-1, layer.in_dim).to(F64)
        out["A"] = (a.mT @ a) / locations
        gf = g.reshape(-1, layer.out_dim)
        out["B"] = gf.mT @ gf
    if layer.bias is not None:
        gs = g.sum(2).reshape(-1, layer.out_dim)
        out["bias"] = gs.mT @ gs
    return out
