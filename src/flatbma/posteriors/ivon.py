"""Improved Variational Online Newton: IVON (Shen et al., ICML 2024, Algorithm 1), a posterior and its optimizer.

"Variational Learning is Effective for Large Deep Networks" (arXiv 2402.17641); reference package ``ivon-opt``.

A mean-field Gaussian ``q(w) = N(m, diag σ²)`` with ``σ = 1/√(λ(h + δ))``, trained by a natural-gradient update at
the cost of one gradient per Monte-Carlo sample. Step ``t = 1, 2, …`` with ``M`` samples:

    ``θ_j = m + σ ⊙ z_j``, ``z_j ~ N(0, I)``                          the samples (``j = 1..M``)
    ``ĝ = (1/M) Σ_j ∇L_B(θ_j)``                                        the gradient at the samples
    ``ĥ = (1/M) Σ_j ∇L_B(θ_j) ⊙ (θ_j − m)/σ²``                          the reparameterization (Price) Hessian
    ``g ← β₁ g + (1 − β₁) ĝ``                                          momentum
    ``h ← β₂ h + (1 − β₂) ĥ + ½(1 − β₂)² (h − ĥ)²/(h + δ)``             Hessian, with its positivity correction
    ``m ← m − α_t · clip((g/(1 − β₁ᵗ) + δ m)/(h + δ), −ξ, ξ)``          mean (bias-corrected momentum)

then ``σ = 1/√(λ(h + δ))`` with the new ``h``; ``σ`` and ``(θ_j − m)/σ²`` in ``ĥ`` are those of the ``h`` the
samples were drawn with. ``λ = ess`` (default ``N``, the training-set size), so ``q`` approximates the posterior of
``λ`` examples under the prior ``N(0, I/(λδ))``; ``h`` starts at ``h₀ = hess_init``, ``g`` at 0; ``rescale_lr`` gives
``α_t = (h₀ + δ)·η_t``; ``ξ = clip_radius`` (``None``: no clip). IVON is its own optimizer: from flatbma's SGD it
reads ``η_t = optimizer.learning_rate(step)``, ``β₁ = optimizer.momentum`` and ``δ = optimizer.weight_decay``. With
an ascent step on weights (F-IVON) the gradient at each sample is ``∇L_B(θ_j + ε_j)``,
``ε_j = ascent.perturb(θ_j, ∇L_B(θ_j))``, in both ``ĝ`` and ``ĥ``.

State: ``params`` = ``{"mean/<name>": m, "hess/<name>": h}`` (one packed ``[2, d]`` buffer), ``aux`` = the momentum
``ivon/momentum/<name>`` (:class:`Momentum`), the noise seed ``rng/seed`` and an amortized ascent step's memories
``ascent/sample<j>/…``. Step ``t``'s noise comes from the generator of ``(rng/seed, t − 1)``; data-parallel runs
all-reduce every ``∇L_B(θ_j)`` and draw the same ``z_j`` on every rank (docs/methods.md §3.10).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, ClassVar, NamedTuple

import torch
from torch import Tensor

from flatbma import packed
from flatbma.checks import check_int, check_number
from flatbma.errors import FlatbmaError
from flatbma.family import Family, Section
from flatbma.gaussian import check_sections, is_theta, section
from flatbma.named import SEP, entries, nest, part, typed
from flatbma.optim.ascent import (
    ASCENT,
    ascent_memory,
    has_memory,
    memory_entries,
    memory_of,
    needs_sample,
    sharpness_aware_value_and_grad,
)
from flatbma.optim.sgd import SGD
from flatbma.params import Objective, clone
from flatbma.rng import SEED_KEY, new_seed, seeded_generator
from flatbma.types import (
    Ascent,
    AscentSpace,
    Batch,
    Capabilities,
    GradientTransformation,
    Params,
    Posterior,
    State,
    StepOutput,
    ascent_space,
)

PREFIXES = ("mean", "hess")
"""The sections of ``θ``: the mean ``m`` and the Hessian estimate ``h``."""

NAME = "ivon"
"""The component IVON keeps its momentum under in ``aux`` (:mod:`flatbma.named`): ``ivon/momentum/<name>``."""


class Momentum(NamedTuple):
    """IVON's own state (component :data:`NAME` of ``aux``): ``momentum``, ``g`` by weight name (one ``[d]`` buffer)."""

    momentum: dict[str, Tensor]


KIND = "ivon"
"""``Layout.kind`` of ``θ``'s packed ``[2, d]`` buffer (:func:`theta_layout`)."""


@dataclass(frozen=True)
class Options:
    """IVON's options (:func:`build`; ``β₁``, ``δ``, ``η_t`` come from ``optim``): ``ivon-opt`` 0.1.3's defaults.

    Attributes:
        ess: ``λ``, the effective sample size; ``None``: ``N``, the training-set size. A larger ``λ`` narrows ``q``.
        hess_init: ``h₀ > 0``, the initial Hessian estimate, so the initial ``σ = 1/√(λ(h₀ + δ))``.
        beta2: ``β₂``, the Hessian's decay; ``h`` moves by ``≈ (1 − β₂)(ĥ − h)`` per step, so a run of ``T``
            steps moves ``σ`` only when ``T(1 − β₂)`` is not small.
        mc_samples: ``M``, samples (gradients) per step.
        clip_radius: ``ξ``, the elementwise clip of the step; ``None`` for none.
        rescale_lr: ``α_t = (h₀ + δ)·η_t`` (Algorithm 1's optional rescaling); ``False``: ``α_t = η_t``.
    """

    NOTES: ClassVar[str] = """
IVON is its own optimizer: optim.lr and optim.schedule give its learning rate (times hess_init + delta with
rescale_lr), optim.momentum is its beta1 and optim.weight_decay its delta (the prior N(0, I/(ess·delta)));
optim.name adam and optim.nesterov are refused. sigma = 1/sqrt(ess·(h + delta)), h starting at hess_init, moves
only when the run's updates times (1 − beta2) is not small. Defaults: ivon-opt 0.1.3's (the authors' package),
ess null = the training-set size (Algorithm 1). docs/methods.md §3.10.
"""

    ess: float | None = None
    hess_init: float = 1.0
    beta2: float = 0.99999
    mc_samples: int = 1
    clip_radius: float | None = None
    rescale_lr: bool = True


@dataclass(frozen=True)
class _Rule:
    """The update's constants: the options with ``λ``, ``β₁``, ``δ`` and the learning-rate schedule resolved."""

    ess: float
    hess_init: float
    beta1: float
    beta2: float
    weight_decay: float
    mc_samples: int
    clip_radius: float | None
    learning_rate: Callable[[int], float]
    lr_factor: float


def _check_options(o: Options) -> None:
    inf = math.inf
    if o.ess is not None:
        message = f"method.ess must be a positive number or null (N, the training-set size), got {o.ess!r}"
        check_number(o.ess, message, low=0, low_open=True, high=inf, high_open=True)
    message = f"method.hess_init must be a positive number (the authors' runs use 0.001 to 0.5), got {o.hess_init!r}"
    check_number(o.hess_init, message, low=0, low_open=True, high=inf, high_open=True)
    message = f"method.beta2 must be a number in [0, 1) (the paper's is 0.99999), got {o.beta2!r}"
    check_number(o.beta2, message, low=0, high=1, high_open=True)
    check_int(o.mc_samples, f"method.mc_samples must be an integer >= 1 (got {o.mc_samples!r})", minimum=1)
    if o.clip_radius is not None:
        message = f"method.clip_radius must be a positive number or null (no clipping), got {o.clip_radius!r}"
        check_number(o.clip_radius, message, low=0, low_open=True, high=inf, high_open=True)
    if not isinstance(o.rescale_lr, bool):
        raise FlatbmaError(f"method.rescale_lr must be true or false, got {o.rescale_lr!r}")


def _check_optimizer(optimizer: GradientTransformation) -> SGD:
    """The optimizer IVON reads ``η_t``, ``β₁`` and ``δ`` from: flatbma's SGD without Nesterov momentum."""
    if not isinstance(optimizer, SGD):
        raise FlatbmaError(
            f"ivon is its own optimizer: it takes optim.lr and optim.schedule (its learning rate), optim.momentum "
            f"(its beta1) and optim.weight_decay (its delta) from optim.name: sgd, got a {type(optimizer).__name__}: "
            "set optim.name: sgd"
        )
    if optimizer.nesterov:
        raise FlatbmaError(
            "ivon's momentum is its own (beta1 = optim.momentum), not Nesterov's: set optim.nesterov: false"
        )
    if optimizer.decay_mask is not None:
        raise FlatbmaError("ivon's weight decay delta acts on every weight; give it an SGD without a decay_mask")
    check_number(
        optimizer.momentum,
        f"ivon's beta1 (optim.momentum) must be in [0, 1), got {optimizer.momentum!r}",
        low=0,
        high=1,
        high_open=True,
    )
    check_number(
        optimizer.weight_decay,
        f"ivon's delta (optim.weight_decay) must be >= 0, got {optimizer.weight_decay!r}",
        low=0,
        high=math.inf,
        high_open=True,
    )
    return optimizer


def build(
    objective: Objective, optimizer: GradientTransformation, ascent: Ascent | None = None, **options
) -> Posterior:
    """IVON (Shen et al. 2024, Algorithm 1; the update is in the module docstring), or F-IVON with an ascent step.

    ``optimizer`` must be flatbma's :class:`~flatbma.optim.SGD`; ``ascent`` a step on weights (SAM, ASAM,
    Fisher-SAM, or :class:`~flatbma.optim.Amortized` around one), taken at every sample.

    Raises:
        FlatbmaError: an option out of range, another optimizer (Adam), Nesterov momentum, or an ascent step on
            ``θ`` (FP-BMA's Fisher ball).
    """
    o = Options(**options)
    _check_options(o)
    sgd = _check_optimizer(optimizer)
    if ascent is not None and (ascent_space(ascent) is AscentSpace.THETA or needs_sample(ascent)):
        raise FlatbmaError(
            "ivon takes an ascent step on the sampled weights (SAM, ASAM, Fisher-SAM: f-ivon), not one on the "
            "variational parameters (FP-BMA's Fisher ball)"
        )
    rule = _Rule(
        ess=float(o.ess) if o.ess is not None else float(objective.num_data),
        hess_init=float(o.hess_init),
        beta1=float(sgd.momentum),
        beta2=float(o.beta2),
        weight_decay=float(sgd.weight_decay),
        mc_samples=int(o.mc_samples),
        clip_radius=float(o.clip_radius) if o.clip_radius is not None else None,
        learning_rate=sgd.learning_rate,
        lr_factor=float(o.hess_init) + float(sgd.weight_decay) if o.rescale_lr else 1.0,
    )
    return Posterior(
        init=partial(init, rule=rule, ascent=ascent),
        update=partial(update, rule=rule, objective=objective, ascent=ascent),
        sample=partial(sample, rule=rule),
        recompute_bn=True,
        mean=mean,
        marginal_variance=partial(marginal_variance, rule=rule),
        can=Capabilities(gaussian=partial(gaussian, rule=rule)),
    )


# ---------------------------------------------------------------------------------------------------
# the layout


def theta_layout(shapes: Mapping[str, torch.Size]) -> packed.Layout:
    """``θ``'s packed layout: a ``[2, d]`` buffer, row 0 ``m``, row 1 ``h``; the names' columns in sorted order."""
    names = sorted(shapes)
    d = sum(shapes[n].numel() for n in names)
    keys, sizes, strides, offsets = [], [], [], []
    for row, prefix in enumerate(PREFIXES):
        offset = row * d
        for n in names:
            keys.append(f"{prefix}/{n}")
            sizes.append(shapes[n])
            strides.append(packed.contiguous_strides(shapes[n]))
            offsets.append(offset)
            offset += shapes[n].numel()
    return packed.Layout(tuple(keys), tuple(sizes), tuple(strides), tuple(offsets), (2, d), KIND)


@functools.lru_cache(maxsize=16)
def _row_layout(layout: packed.Layout) -> packed.Layout:
    """One row of ``θ``'s layout as a ``[d]`` layout keyed by weight name (the weights, the momentum)."""
    half = len(layout.keys) // 2
    keys = tuple(k.removeprefix("mean/") for k in layout.keys[:half])
    return packed.Layout(keys, layout.shapes[:half], layout.strides[:half], layout.offsets[:half], (layout.shape[1],))


def _momentum(state: State) -> dict[str, Tensor]:
    """``g`` by weight name, read through the typed state (the same tensors)."""
    return typed(Momentum, part(NAME, state.aux)).momentum


def _packed(state: State) -> tuple[State, Tensor, Tensor, Tensor, packed.Layout]:
    """``(state, m, h, g, weights layout)``: ``θ`` and the momentum as flat buffers (packed again once if needed)."""
    found = packed.buffer(state.params, kind=KIND)
    g = _momentum(state)
    flat_g = None if found is None else packed.flat_of(g, _row_layout(found[0]).keys)
    if found is None or flat_g is None:
        check_sections(state.params, PREFIXES, "ivon")
        layout = theta_layout({n: v.shape for n, v in section(state.params, "mean").items()})
        params = packed.pack(state.params, layout)
        g = packed.pack(g, _row_layout(layout))
        state = replace(state, params=params, aux={**state.aux, **nest(NAME, entries(Momentum(g)))})
        found, flat_g = packed.buffer(params, kind=KIND), packed.flat_of(g)
    layout, theta = found  # type: ignore[misc]
    return state, theta[0], theta[1], flat_g, _row_layout(layout)


def _sigma(rule: _Rule, h: Tensor) -> Tensor:
    """``σ = 1/√(λ(h + δ))``."""
    return torch.rsqrt((h + rule.weight_decay) * rule.ess)


# ---------------------------------------------------------------------------------------------------
# the transform


def init(params: Params, buffers: Params, *, rule: _Rule, ascent: Ascent | None) -> State:
    """``m = w`` (or ``params`` itself when it is an IVON ``θ``), ``h = h₀``, ``g = 0``, the seed, ascent memories."""
    seed = new_seed()
    if is_theta(params):
        check_sections(params, PREFIXES, "ivon")
        mean_, hess = section(params, "mean"), section(params, "hess")
    else:
        mean_ = dict(params)
        hess = {n: torch.full_like(v, rule.hess_init) for n, v in params.items()}
    layout = theta_layout({n: v.shape for n, v in mean_.items()})
    theta = packed.pack(
        {**{f"mean/{n}": v for n, v in mean_.items()}, **{f"hess/{n}": v for n, v in hess.items()}}, layout
    )
    rows = _row_layout(layout)
    device = next(iter(theta.values())).device
    g = rows.views(torch.zeros(rows.numel, dtype=theta[layout.keys[0]].dtype, device=device))
    aux = {**nest(NAME, entries(Momentum(g))), SEED_KEY: seed.to(device)}
    if has_memory(ascent):
        weights = _row_layout(layout).views(packed.flat_of(theta)[0].clone())
        for j in range(rule.mc_samples):
            aux.update(ascent_memory(ascent, weights, _sample_name(j)))
    return State(params=theta, buffers=clone(buffers), aux=aux)


def _sample_name(j: int) -> str:
    """The component of sample ``j``'s ascent memory: ``ascent/sample<j>`` (sample ``j`` of every step continues it)."""
    return f"{ASCENT}{SEP}sample{j}"


def update(
    state: State, batch: Batch, *, rule: _Rule, objective: Objective, ascent: Ascent | None
) -> tuple[State, StepOutput]:
    """One step of Algorithm 1 (the module docstring), in place, with the noise of ``(rng/seed, step)``."""
    state, m, h, g, weights = _packed(state)
    generator = seeded_generator(state.aux[SEED_KEY], state.step, m.device)
    kept = memory_entries(state.aux) if has_memory(ascent) else {}
    with torch.no_grad():
        shifted = h + rule.weight_decay  # h + δ of the h the samples are drawn with
        sigma = shifted.mul(rule.ess).rsqrt_()  # σ = 1/√(λ(h + δ))
    grad_sum = noise_grad_sum = None
    losses, first_logits = [], None
    for j in range(rule.mc_samples):
        with torch.no_grad():
            z = torch.randn(m.shape, generator=generator, device=generator.device, dtype=m.dtype).to(m.device)
            w = weights.views(torch.addcmul(m, z, sigma))  # θ_j = m + σ ⊙ z_j
        bufs = state.buffers if j == 0 else clone(state.buffers)  # running statistics: the first sample's pass
        memory = memory_of(kept, _sample_name(j)) if kept else None
        loss, logits, grads = sharpness_aware_value_and_grad(objective, w, bufs, batch, ascent, memory)
        with torch.no_grad():
            flat = torch.cat([grads[k].reshape(-1) for k in weights.keys])
            if grad_sum is None:
                grad_sum, noise_grad_sum = flat, z.mul_(flat)
            else:
                grad_sum.add_(flat)
                noise_grad_sum.addcmul_(flat, z)  # type: ignore[union-attr]
        losses.append(loss)
        first_logits = logits if first_logits is None else first_logits
    with torch.no_grad():
        _apply(rule, m, h, g, shifted, sigma, grad_sum, noise_grad_sum, state.step)  # type: ignore[arg-type]
        stats = {f"{NAME}/hess": h.mean()}
    out = StepOutput(torch.stack(losses).mean(), first_logits, stats)  # type: ignore[arg-type]
    return replace(state, step=state.step + 1), out  # the ascent memories in aux: updated in place


def _apply(
    rule: _Rule,
    m: Tensor,
    h: Tensor,
    g: Tensor,
    shifted: Tensor,
    sigma: Tensor,
    grad_sum: Tensor,
    noise_grad_sum: Tensor,
    step: int,
) -> None:
    """The momentum, Hessian and mean updates of step ``t = step + 1``, in place (every temporary reused).

    From ``Σ_j ĝ_j`` and ``Σ_j z_j ⊙ ĝ_j`` of the ``M`` samples, ``shifted = h + δ`` and ``σ`` of the ``h`` they were
    drawn with: ``ĥ = (1/M) Σ_j ĝ_j ⊙ (θ_j − m)/σ² = (1/M) Σ_j ĝ_j ⊙ z_j / σ``.
    """
    b1, b2, delta, k = rule.beta1, rule.beta2, rule.weight_decay, rule.mc_samples
    if k > 1:
        grad_sum.div_(k)
        noise_grad_sum.div_(k)
    hess_hat = noise_grad_sum.div_(sigma)
    correction = torch.sub(h, hess_hat, out=sigma).square_()  # (h − ĥ)², in σ's buffer
    g.lerp_(grad_sum, 1 - b1)  # β₁g + (1 − β₁)ĝ
    h.lerp_(hess_hat, 1 - b2).addcdiv_(correction, shifted, value=0.5 * (1 - b2) ** 2)
    debias = 1 - b1 ** (step + 1)
    numerator = torch.add(g, m, alpha=delta * debias, out=hess_hat)  # (1 − β₁ᵗ)·(g/(1 − β₁ᵗ) + δm)
    denominator = torch.add(h, delta, out=shifted)  # h + δ, of the new h
    rate = rule.learning_rate(step) * rule.lr_factor / debias
    if rule.clip_radius is None:
        m.addcdiv_(numerator, denominator, value=-rate)
    else:
        radius = rule.clip_radius * debias
        m.add_(numerator.div_(denominator).clamp_(-radius, radius), alpha=-rate)


# ---------------------------------------------------------------------------------------------------
# the posterior


@torch.no_grad()
def sample(state: State, n: int, generator: torch.Generator | None = None, *, rule: _Rule) -> list[Params]:
    """``n`` draws ``w = m + σ ⊙ z``, ``z ~ N(0, I)`` (one ``[d]`` draw each, in the layout's order), with buffers."""
    _, m, h, _, weights = _packed(state)
    sigma = _sigma(rule, h)
    device = generator.device if generator is not None else m.device
    out = []
    for _ in range(n):
        z = torch.randn(m.shape, generator=generator, device=device, dtype=m.dtype).to(m.device)
        out.append({**weights.views(torch.addcmul(m, z, sigma)), **clone(state.buffers)})
    return out


def mean(state: State) -> Params:
    """``m``, with the buffers: the posterior mean, where IVON predicts without sampling."""
    return {**{k: v.detach().clone() for k, v in section(state.params, "mean").items()}, **clone(state.buffers)}


def marginal_variance(state: State, *, rule: _Rule) -> Params:
    """``σ² = 1/(λ(h + δ))`` by parameter name: exactly the sampler's variances."""
    return {k: 1 / ((h.detach() + rule.weight_decay) * rule.ess) for k, h in section(state.params, "hess").items()}


def gaussian(state: State, *, rule: _Rule) -> Params:
    """``N(m, diag σ²)`` in the low-rank ``θ`` layout of :mod:`flatbma.gaussian`: ``log_std = log(√2 σ)``, ``L = 0``.

    That layout's ``Σ = ½(diag s² + LLᵀ/(K−1))`` with ``s = √2 σ`` and ``L = 0`` (rank 2) is ``diag σ²`` exactly.
    """
    variance = marginal_variance(state, rule=rule)
    means = section(state.params, "mean")
    theta = {f"mean/{n}": v.detach().clone() for n, v in means.items()}
    theta.update({f"log_std/{n}": 0.5 * torch.log(2 * variance[n]) for n in means})
    theta.update({f"factor/{n}": v.new_zeros((2, *v.shape)) for n, v in means.items()})
    return theta


def advice(method: Section, prior: bool, diagnostics: Mapping[str, Any]) -> str:
    """What to change when IVON's BMA is worse than its mean (:attr:`Family.advice`): a larger ``ess`` narrows ``q``."""
    ess = method.options["ess"]
    return f"ess: 10x (now {'the data size' if ess is None else f'{ess:g}'})"


FAMILY = Family(build, Options, gaussian=True, advice=advice)
"""IVON, and with SAM at each sampled model F-IVON (:mod:`flatbma.methods`)."""
