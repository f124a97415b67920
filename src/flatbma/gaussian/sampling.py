"""Standard-normal noise and the sampler ``w = μ + (1/√2)(σ ⊙ z₁ + L z₂ / √(K − 1))`` with its pullback."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import NamedTuple

import torch
from torch import Tensor

from flatbma import packed
from flatbma.gaussian.layout import KIND, blocks, factor_scale, from_rows, names_and_shapes, packed_rows, section
from flatbma.packed import Layout
from flatbma.types import Params


class GaussianNoise(NamedTuple):
    """Standard-normal noise that a reparameterized family maps to weights.

    Attributes:
        z1: ``z₁ ~ N(0, I_d)`` shaped like the weights, keyed by parameter name.
        z2: ``z₂ ~ N(0, I_K)`` for a low-rank factor (``None`` for a diagonal family).
    """

    z1: Params
    z2: Tensor | None = None


def standard_normal_like(like: Mapping[str, Tensor], generator: torch.Generator | None) -> Params:
    """``N(0, I)`` tensors shaped like ``like``, drawn on the generator's device and moved to ``like``'s.

    Drawn in key order into the views of one contiguous buffer (:func:`standard_normal`), so that a flat
    consumer needs no concatenation; tensors of mixed dtypes or devices are drawn one by one.
    """
    values = list(like.values())
    ref = values[0]
    if any(v.dtype != ref.dtype or v.device != ref.device for v in values):
        out = {}
        for k, v in like.items():
            device = generator.device if generator is not None else v.device
            out[k] = torch.randn(v.shape, generator=generator, device=device, dtype=v.dtype).to(v.device)
        return out
    return standard_normal(packed.Layout.contiguous(like), ref.dtype, ref.device, generator)


def standard_normal(
    layout: packed.Layout, dtype: torch.dtype, device: torch.device, generator: torch.Generator | None
) -> Params:
    """``N(0, I)`` tensors for every key of ``layout``, as views of one buffer on ``device``.

    Drawn key after key on the generator's device (the same numbers as one ``torch.randn`` per tensor
    in that order) and moved to ``device`` in one copy.
    """
    source = generator.device if generator is not None else device
    views = layout.views(torch.empty(layout.numel, dtype=dtype, device=source))
    for v in views.values():
        v.normal_(generator=generator)
    if source != device:
        views = layout.views(packed.flat_of(views).to(device))
    return views


_NOISE_LAYOUTS: dict[int, tuple[Layout, Layout]] = {}
"""``id(θ layout) -> (θ layout, z₁ layout)``; the entry keeps the θ layout alive, so its id is not reused."""


def _noise_layout(theta: Mapping[str, Tensor]) -> Layout | None:
    """The layout of ``z₁`` (keys: parameter names) for a packed ``θ``: row 0 of its buffer, cached."""
    layout = packed.layout_of(theta, kind=KIND)
    if layout is None:
        return None
    cached = _NOISE_LAYOUTS.get(id(layout))
    if cached is not None and cached[0] is layout:
        return cached[1]
    count = len(layout.keys) // 3  # the mean/ entries come first and tile row 0
    z_layout = Layout(
        tuple(k[len("mean/") :] for k in layout.keys[:count]),
        layout.shapes[:count],
        layout.strides[:count],
        layout.offsets[:count],
        (layout.shape[1],),
    )
    if len(_NOISE_LAYOUTS) >= 8:
        _NOISE_LAYOUTS.clear()
    _NOISE_LAYOUTS[id(layout)] = (layout, z_layout)
    return z_layout


def draw_noise(theta: Mapping[str, Tensor], rank: int, generator: torch.Generator | None) -> GaussianNoise:
    """``z₁ ~ N(0, I_d)`` (by parameter name, in sorted order), then ``z₂ ~ N(0, I_K)`` with ``K = rank``.

    For a packed ``θ`` (:func:`~flatbma.gaussian.layout.theta_layout`) ``z₁`` is drawn as the views of
    one ``[d]`` buffer laid out like ``θ``'s row 0, so the sampler uses it without concatenation.
    """
    layout = _noise_layout(theta)
    if layout is None:
        z1 = standard_normal_like(section(theta, "mean"), generator)
    else:
        matrix = packed_rows(theta)
        z1 = standard_normal(layout, matrix.dtype, matrix.device, generator)
    ref = next(iter(z1.values()))
    device = generator.device if generator is not None else ref.device
    z2 = torch.randn(rank, generator=generator, device=device, dtype=ref.dtype).to(ref.device)
    return GaussianNoise(z1, z2)


def _flat_noise(z1: Mapping[str, Tensor], names: list[str], batch: torch.Size) -> Tensor:
    """``z₁`` as ``[*batch, d]`` in ``names`` order: its buffer when packed that way, else concatenated."""
    flat = packed.flat_of(z1, names) if not batch else None
    if flat is not None:
        return flat.view(-1)
    return torch.cat([z1[n].reshape(*batch, -1) for n in names], dim=-1)


def sample_weights(theta: Mapping[str, Tensor], z1: Mapping[str, Tensor], z2: Tensor) -> Params:
    """``w = μ + (1/√2)(σ ⊙ z₁ + L z₂ / √(K−1))`` by parameter name, differentiable in ``θ``.

    So ``w ~ N(μ, ½(diag σ² + LLᵀ/(K−1)))``: the SWAG sampler (Maddox et al. 2019). ``z1`` (by name) and ``z2``
    (``[K]``) may carry the same leading sample dimensions ``[*batch]``.
    """
    names, shapes = names_and_shapes(theta)
    k = z2.shape[-1]
    c = factor_scale(k)
    batch = z2.shape[:-1]
    # one flat [K, d] pass: a few large kernels (and as many backward) instead of one small product per tensor
    mu, log_std, factor = blocks(theta)
    noise = _flat_noise(z1, names, batch)
    flat = mu + math.sqrt(0.5) * torch.exp(log_std) * noise + c * (z2 @ factor)
    pieces = flat.split([shape.numel() for shape in shapes], dim=-1)
    return {n: piece.view(*batch, *shape) for n, piece, shape in zip(names, pieces, shapes, strict=True)}


def pullback(theta: Mapping[str, Tensor], noise: GaussianNoise, grads: Mapping[str, Tensor]) -> Mapping[str, Tensor]:
    """``(∂w/∂θ)ᵀ g`` for ``w = sample_weights(θ, z₁, z₂)``, in closed form (no autograd graph).

    ``w`` is linear in ``μ``, ``σ`` and ``L``: ``∂/∂μ = g``, ``∂/∂log σ = g ⊙ σ ⊙ z₁/√2`` and ``∂/∂L_k = c·z₂ₖ·g``
    with ``c = 1/√(2(K−1))``, packed like ``θ`` (:func:`~flatbma.gaussian.layout.theta_layout`); ``z₂``: shape ``[K]``.
    """
    names, _ = names_and_shapes(theta)
    k = noise.z2.shape[-1]
    c = factor_scale(k)
    _, log_std, _ = blocks(theta)
    first = grads[names[0]]
    z1 = _flat_noise(noise.z1, names, torch.Size())
    out = torch.empty((k + 2, z1.numel()), dtype=first.dtype, device=first.device)
    g = torch.cat([grads[n].reshape(-1) for n in names], out=out[0])  # gathered into row 0, no copy after
    torch.mul(math.sqrt(0.5) * torch.exp(log_std) * z1, g, out=out[1])
    torch.outer(c * noise.z2.to(g.dtype), g, out=out[2:])
    return from_rows(out, theta)
