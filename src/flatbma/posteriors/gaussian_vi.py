"""Reparameterized Gaussian variational inference, shared by mean-field and low-rank VI and their F-variants.

A :class:`ReparameterizedFamily` describes ``q_θ``: how ``θ`` is initialized from the weights, how standard-normal
noise is drawn, the differentiable map ``w = w(θ, z)`` and the closed-form ``KL(q_θ ‖ p)``. :func:`build` turns it
into a :class:`~flatbma.types.Posterior` trained on the negative ELBO per example (Blundell et al. 2015)

    ``ℒ(θ) = E_{z}[L_B(w(θ, z))] + κ · KL(q_θ ‖ p) / n``

with ``n = objective.num_data`` (the KL is divided by the data-set size here and nowhere else), ``κ = kl_weight``
and the expectation estimated with ``M`` reparameterized samples per step.

With an ascent step on weights this is F-VI (Nguyen et al., NeurIPS 2023, Algorithm 1; :func:`elbo_value_and_grad`);
with one on ``θ`` (:class:`flatbma.optim.FisherBall`), FP-BMA (Lim et al. 2025; :func:`theta_sharpness_value_and_grad`).

State: ``params`` = ``θ``, ``buffers`` = the model's buffers, ``aux`` = the optimizer's state of ``θ`` under
``optimizer/``, the noise seed ``rng/seed`` and the ascent step's memories under ``ascent/``. The training noise of
a step comes from a generator seeded by ``(rng/seed, step)``, so a reloaded state resumes with exactly the noise it
would have drawn; ``sample`` uses the caller's generator.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from enum import Enum
from functools import partial
from typing import Any, Protocol

import torch
from torch import Tensor

from flatbma import packed
from flatbma.checks import check_int, check_number, parse_choice
from flatbma.errors import FlatbmaError
from flatbma.family import Section
from flatbma.gaussian import GaussianNoise, is_theta, section
from flatbma.named import OPTIMIZER, SEP, chain, part
from flatbma.optim.amortized import Amortized
from flatbma.optim.ascent import (
    ASCENT,
    ascent_memory,
    has_memory,
    memory_entries,
    memory_of,
    needs_sample,
    sharpness_aware_value_and_grad,
    two_pass,
)
from flatbma.optim.fisher_ball import FisherBall
from flatbma.optim.sgd import steady_gain, with_decay_mask
from flatbma.params import Objective, add, clone, detached, dot, scale
from flatbma.rng import SEED_KEY, new_seed, seeded_generator
from flatbma.types import (
    Ascent,
    AscentSpace,
    Batch,
    GradientTransformation,
    Params,
    Posterior,
    State,
    StepOutput,
    ascent_space,
)


class VarianceStep(str, Enum):
    """How the optimizer steps the variance parameters (``method.variance_step``; strings and members accepted).

    ``NATURAL`` (the default) steps the diagonal variance parameters (mean-field ``ρ``, low-rank ``log σ``) along
    their natural gradient (Amari 1998) of the tempered ELBO ``(n/κ)·ℒ``: that block's gradient times
    ``(n/κ)·F⁻¹/G``, clipped to ``[−1, 1]`` (the family's ``natural_variance``), ``F`` the Fisher of ``q`` in it
    (2 in ``log σ``) and ``G`` the optimizer's gain on a constant gradient (:func:`flatbma.optim.sgd.steady_gain`).
    In ``log σ``, with ``h_i`` the data curvature,

        ``Δ log σ_i = −η·clip(½((n/κ)σ_i²h_i + σ_i²/s² − 1))``,

    a contraction to the mean-field optimum ``σ_i² = 1/((n/κ)h_i + 1/s²)`` at rate ``η`` per update whatever ``n``
    and ``σ``. The mean and a low-rank factor keep the optimizer's plain step. ``PLAIN``: the optimizer's step on
    the plain gradient in every block (Blundell et al. 2015), which moves a small ``σ`` by only about ``ηκ/n`` per
    update (why, and why both the clip and ``G`` are needed: docs/methods.md §3.3).
    """

    NATURAL = "natural"
    PLAIN = "plain"


def advice(method: Section, prior: bool, diagnostics: Mapping[str, Any]) -> str:
    """VI's :attr:`~flatbma.family.Family.advice`: a tempered KL, σ's start; FP-BMA: a prior, a narrower ball."""
    o, tips = method.options, []
    kappa = o["kl_weight"]
    if kappa > 0:
        tips.append(f"kl_weight: {kappa / 10:g} (now {kappa:g})")
    if VarianceStep(o["variance_step"]) is VarianceStep.PLAIN:
        init = o["init_std"]
        tips.append(f"init_std: {init / 10:g} (now {init:g}; σ stays near it with variance_step: plain)")
    step = method.ascent.ascent if isinstance(method.ascent, Amortized) else method.ascent
    if isinstance(step, FisherBall):
        if not prior:
            tips.append("a SWAG prior stage to start from (prior)")
        if step.gamma is not None:
            tips.append(f"gamma: {step.gamma / 10:g} (now {step.gamma:g})")
        elif step.radius is not None:
            tips.append(f"radius: {step.radius / 2:g} (now {step.radius:g})")
    return "; ".join(tips) or f"prior_std: {o['prior_std'] / 10:g} (now {o['prior_std']:g})"


class ReparameterizedFamily(Protocol):
    """A Gaussian family ``q_θ`` with a differentiable sampler ``w = w(θ, z)``."""

    def init_theta(self, params: Params, generator: torch.Generator) -> Params:
        """Variational parameters ``θ`` centred at the model weights ``params``."""
        ...

    def check_theta(self, theta: Mapping[str, Tensor]) -> None:
        """Raise a :class:`FlatbmaError` unless ``theta`` has this family's layout and options."""
        ...

    def noise(self, theta: Mapping[str, Tensor], generator: torch.Generator | None) -> GaussianNoise:
        """Draw the standard-normal noise of one sample."""
        ...

    def reparameterize(self, theta: Mapping[str, Tensor], noise: GaussianNoise) -> Params:
        """Weights ``w(θ, z)`` by parameter name, differentiable in ``θ``."""
        ...

    def kl(self, theta: Mapping[str, Tensor]) -> Tensor:
        """``KL(q_θ ‖ p)`` in closed form, differentiable in ``θ``."""
        ...

    def decays(self, key: str) -> bool:
        """Whether the optimizer's weight decay (an L2 prior on the weights) acts on ``θ[key]``: the means only."""
        ...

    # Optional, used when present:
    #   pullback(θ, noise, g) -> (∂w/∂θ)ᵀg in closed form (else autograd through reparameterize);
    #   kl_grad(θ) -> ∇_θ KL in closed form (else autograd through kl);
    #   layout(θ) -> flatbma.packed.Layout: θ and its optimizer state are kept packed in it;
    #   natural_variance(θ, g, s) -> g with its diagonal variance block times s·F⁻¹, clipped (VarianceStep.NATURAL);
    #   step_size(θ, θ') -> {name: 0-d tensor}: how far an ascent step on θ moved q (recorded every step).


def _device(tensors: Mapping[str, Tensor]) -> torch.device:
    return next(iter(tensors.values())).device


# ---------------------------------------------------------------------------------------------------
# the gradient


def elbo_value_and_grad(
    objective: Objective,
    family: ReparameterizedFamily,
    theta: Mapping[str, Tensor],
    buffers: Mapping[str, Tensor],
    batch: Batch,
    noises: Sequence[GaussianNoise],
    *,
    ascent: Ascent | None = None,
    kl_weight: float = 1.0,
    memories: Sequence[Mapping[str, Tensor]] | None = None,
) -> tuple[Tensor, Tensor, Params]:
    """Mini-batch loss, logits and the (flat-seeking) negative-ELBO gradient w.r.t. ``θ`` for given noise.

    ``∇_θ ℒ = (1/M) Σ_m (∂w_m/∂θ)ᵀ ∇_w L_B(w_m + ε_m) + κ ∇_θ KL(q_θ‖p) / n`` with
    ``w_m = w(θ, z_m)``, ``ε_m = ascent.perturb(w_m, ∇L_B(w_m))`` (``ε_m = 0`` without an ascent step)
    and ``n = objective.num_data``. Each vector-Jacobian product ``(∂w_m/∂θ)ᵀg_m`` is the family's
    closed-form ``pullback`` when it has one, else autograd; the KL gradient is :func:`kl_grad`.

    ``noises`` holds one :class:`GaussianNoise` per sample (``M = len(noises) ≥ 1``), ``memories`` the ascent step's
    memory per sample (:func:`weight_memories`); ``buffers`` are updated in place (BatchNorm) by the first,
    unperturbed pass of the first sample.

    Returns:
        ``(mean over samples of L_B(w_m), logits of the first sample, gradient by key of θ)``.
    """
    if not noises:
        raise ValueError("elbo_value_and_grad needs at least one noise sample")
    theta = detached(theta)
    m = len(noises)
    total: Params = {}
    losses, first_logits = [], None
    for i, noise in enumerate(noises):
        with torch.no_grad():
            w = family.reparameterize(theta, noise)
        bufs = buffers if i == 0 else clone(buffers)
        memory = memories[i] if memories is not None else None
        loss, logits, g = sharpness_aware_value_and_grad(objective, w, bufs, batch, ascent, memory)
        pulled = _pullback(family, theta, noise, g)
        total = add(total, pulled) if total else pulled
        losses.append(loss)
        if first_logits is None:
            first_logits = logits
    out = scale(total, 1 / m) if m > 1 else total
    if kl_weight:
        out = add(out, kl_grad(family, theta), kl_weight / objective.num_data)
    return torch.stack(losses).mean(), first_logits, out


def _pullback(family: ReparameterizedFamily, theta: Params, noise: GaussianNoise, g: Params) -> Params:
    """``(∂w/∂θ)ᵀ g`` for ``w = family.reparameterize(θ, noise)``: ``family.pullback`` if it has one, else autograd."""
    closed_form = getattr(family, "pullback", None)
    if closed_form is not None and (noise.z2 is None or noise.z2.dim() == 1):
        return closed_form(theta, noise, g)
    return autograd_gradient(lambda leaves: dot(family.reparameterize(leaves, noise), g), theta)


def autograd_gradient(scalar: Callable[[Params], Tensor], theta: Mapping[str, Tensor]) -> Params:
    """``∇_θ scalar(θ)`` by key of ``θ`` (zeros for keys it does not depend on)."""
    leaves = {k: v.detach().requires_grad_(True) for k, v in theta.items()}
    grads = torch.autograd.grad(scalar(leaves), list(leaves.values()), allow_unused=True)
    return {k: torch.zeros_like(v) if d is None else d for (k, v), d in zip(leaves.items(), grads)}


def kl_grad(family: ReparameterizedFamily, theta: Mapping[str, Tensor]) -> Params:
    """``∇_θ KL(q_θ ‖ p)`` by key of ``θ``: ``family.kl_grad(θ)`` when the family has a closed form, else autograd."""
    closed_form = getattr(family, "kl_grad", None)
    if closed_form is not None:
        return closed_form(theta)
    return autograd_gradient(family.kl, theta)


def theta_sharpness_value_and_grad(
    objective: Objective,
    family: ReparameterizedFamily,
    theta: Mapping[str, Tensor],
    buffers: Mapping[str, Tensor],
    batch: Batch,
    noises: Sequence[GaussianNoise],
    *,
    ascent: Ascent | None = None,
    kl_weight: float = 1.0,
    memory: Mapping[str, Tensor] | None = None,
    record: dict[str, Tensor] | None = None,
) -> tuple[Tensor, Tensor, Params]:
    """The sharpness-aware step applied to the variational parameters ``θ`` themselves (FP-BMA; Lim et al. 2025).

    :func:`flatbma.optim.ascent.two_pass` on ``θ``, with the same noise ``z_m`` in both passes (so an ascent step with
    a ``memory``, :class:`flatbma.optim.Amortized`, schedules the second pass as on weights):

    1. ``g = ∇_θ (1/M) Σ_m L_B(w(θ, z_m))`` — the reparameterized data-loss gradient, no KL;
    2. ``δ = ascent.perturb(θ, g)`` (e.g. :class:`flatbma.optim.FisherBall`);
    3. ``∇_θ ℒ = ∇_θ' (1/M) Σ_m L_B(w(θ', z_m))|_{θ'=θ+δ} + κ ∇_θ KL(q_θ‖p) / n`` — the KL at the
       unperturbed ``θ``, ``n = objective.num_data``.

    Without an ascent step this is :func:`elbo_value_and_grad`. BatchNorm running statistics are updated once, by
    the first sample of the first pass. An ascent step taken from the drawn sample
    (:func:`flatbma.optim.ascent.needs_sample`: FisherBall's ``direction: score``) replaces steps 1–2 by
    ``δ = ascent.perturb_sample(θ, w(θ, z))`` for the one noise sample ``z``; the first pass is then forward only.

    ``record``, when given, receives the family's ``step_size(θ, θ + δ)`` (if any) at every step with a second pass.

    Returns:
        ``(mean over samples of L_B(w(θ, z_m)), logits of the first sample at θ, gradient by key of θ)``.
    """
    if ascent is None:
        return elbo_value_and_grad(objective, family, theta, buffers, batch, noises, kl_weight=kl_weight)
    measure = getattr(family, "step_size", None) if record is not None else None

    def data_gradient(point: Mapping[str, Tensor], part: Batch, first: bool) -> tuple[Tensor, Tensor, Params]:
        if not first and measure is not None:
            record.update(measure(theta, point))  # type: ignore[union-attr]
        bufs = buffers if first else clone(buffers)
        return elbo_value_and_grad(objective, family, point, bufs, part, noises, kl_weight=0.0)

    if needs_sample(ascent):
        loss, logits, grads = _sample_ascent(objective, family, theta, buffers, batch, noises, ascent, data_gradient)
    else:
        loss, logits, grads = two_pass(data_gradient, theta, batch, ascent, memory)
    if kl_weight:
        grads = add(grads, kl_grad(family, theta), kl_weight / objective.num_data)
    return loss, logits, grads


def _sample_ascent(
    objective: Objective,
    family: ReparameterizedFamily,
    theta: Mapping[str, Tensor],
    buffers: Mapping[str, Tensor],
    batch: Batch,
    noises: Sequence[GaussianNoise],
    ascent: Ascent,
    gradient: Callable[[Mapping[str, Tensor], Batch, bool], tuple[Tensor, Tensor, Params]],
) -> tuple[Tensor, Tensor, Params]:
    """A step from the drawn sample: the loss at ``w(θ, z)`` (forward only), ``δ`` from ``w``, the gradient at θ + δ."""
    if len(noises) != 1:
        raise FlatbmaError(
            f"an ascent step taken from the drawn sample perturbs θ along one sample, but this step draws "
            f"{len(noises)}: set method.num_mc_samples: 1 (as the authors' code)"
        )
    theta = detached(theta)
    with torch.no_grad():
        w = family.reparameterize(theta, noises[0])
        loss, logits = objective.loss(w, buffers, batch)  # BatchNorm statistics updated here, once
        perturbed = add(theta, ascent.perturb_sample(theta, w))  # type: ignore[attr-defined]
    _, _, grads = gradient(perturbed, batch, False)
    return loss.detach(), logits.detach(), grads


# ---------------------------------------------------------------------------------------------------
# the posterior


def _repacked(family: ReparameterizedFamily, state: State) -> State:
    """``state`` with ``θ`` and its optimizer state packed in ``family.layout`` (a loaded or moved state's, once)."""
    if not hasattr(family, "layout") or packed.layout_of(state.params) is not None:
        return state
    params, aux = packed.pack_with_mirrors(state.params, state.aux, family.layout(state.params))
    return replace(state, params=params, aux=aux)


def check_options(
    *, num_mc_samples: int, init_std: float, prior_std: float, kl_weight: float, variance_step: object
) -> VarianceStep:
    """Validate the options every reparameterized VI family shares (config keys ``method.*``); the variance step."""
    check_int(num_mc_samples, f"method.num_mc_samples must be an integer >= 1 (got {num_mc_samples!r})", minimum=1)
    inf = float("inf")
    for name, value in (("init_std", init_std), ("prior_std", prior_std)):
        message = f"method.{name} must be a positive number (got {value!r})"
        check_number(value, message, low=0, low_open=True, high=inf, high_open=True)
    message = f"method.kl_weight must be a number >= 0 (got {kl_weight!r}); 1 is the ELBO"
    check_number(kl_weight, message, low=0, high=inf, high_open=True)
    return parse_choice(VarianceStep, variance_step, "method.variance_step")


def build(
    objective: Objective,
    optimizer: GradientTransformation,
    ascent: Ascent | None,
    family: ReparameterizedFamily,
    *,
    num_mc_samples: int,
    kl_weight: float,
    variance_step: VarianceStep,
) -> Posterior:
    """A :class:`~flatbma.types.Posterior` that fits ``family`` by (flat-seeking) reparameterized VI.

    ``θ_{t+1} = optimizer(θ_t, P ∇_θ ℒ)`` on ``M`` fresh noise samples per step, with ``P`` the variance step
    (:class:`VarianceStep`: with ``NATURAL`` the family's ``natural_variance`` with ``s = n/(κG)``, ``G`` the
    optimizer's :func:`~flatbma.optim.sgd.steady_gain`; the identity with ``PLAIN``). The optimizer's weight decay
    acts only on the entries ``family.decays`` selects (the mean). The gradient is :func:`elbo_value_and_grad` for an
    ascent step on weights or none (F-VI), :func:`theta_sharpness_value_and_grad` for one on ``θ`` (FP-BMA). An
    ascent memory (:class:`flatbma.optim.Amortized`) is kept in ``aux``: one on ``θ``, or one per Monte-Carlo
    sample on weights (:func:`weight_memories`).

    ``init`` accepts the model weights (``θ`` is centred at them by ``family.init_theta``) or a ready ``θ`` in the
    family's layout (e.g. from :func:`flatbma.gaussian.init_from_swag`). ``sample`` draws ``w ~ q_θ`` with the
    state's buffers (``recompute_bn=True``). ``update`` reports the data term (mean ``L_B`` over the
    ``M = num_mc_samples`` samples, without the KL) and the logits of the first sample.
    """
    natural = variance_step is VarianceStep.NATURAL
    size = objective.num_data / kl_weight if kl_weight else objective.num_data  # n/κ: the tempered ELBO's
    variance_scale = size / steady_gain(optimizer) if natural else None  # n/(κG) (VarianceStep)
    optimizer = with_decay_mask(optimizer, family.decays)  # weight decay on μ, never on σ or L
    if needs_sample(ascent) and num_mc_samples != 1:
        raise FlatbmaError(
            f"the ascent step is taken from the drawn sample (direction: score, as the authors' code: one sample per "
            f"step), but method.num_mc_samples is {num_mc_samples}: set it to 1"
        )
    fixed = {"family": family, "optimizer": optimizer, "ascent": ascent, "num_mc_samples": num_mc_samples}
    return Posterior(
        init=partial(init, **fixed),
        update=partial(update, **fixed, objective=objective, kl_weight=kl_weight, variance_scale=variance_scale),
        sample=sampler(family),
        recompute_bn=True,
    )


def init(
    params: Params,
    buffers: Params,
    *,
    family: ReparameterizedFamily,
    optimizer: GradientTransformation,
    ascent: Ascent | None,
    num_mc_samples: int,
) -> State:
    """``θ`` (``family.init_theta`` of ``params``, or ``params`` if a ``θ``), optimizer state, seed, ascent memories."""
    seed = new_seed()
    if is_theta(params):
        theta = clone(params)
        family.check_theta(theta)
    else:
        theta = family.init_theta(clone(params), seeded_generator(seed, -1, _device(params)))
    if hasattr(family, "layout"):
        theta = packed.pack(theta, family.layout(theta))
    aux = {**chain((OPTIMIZER, optimizer.init(theta))), SEED_KEY: seed.to(_device(theta))}
    on_theta = ascent_space(ascent) is AscentSpace.THETA
    if has_memory(ascent) and on_theta:
        aux.update(ascent_memory(ascent, theta))
    elif has_memory(ascent):
        aux.update(weight_memories(family, ascent, theta, num_mc_samples))
    return State(params=theta, buffers=clone(buffers), aux=aux)


def update(
    state: State,
    batch: Batch,
    *,
    family: ReparameterizedFamily,
    optimizer: GradientTransformation,
    ascent: Ascent | None,
    num_mc_samples: int,
    objective: Objective,
    kl_weight: float,
    variance_scale: float | None,
) -> tuple[State, StepOutput]:
    """``θ ← optimizer(θ, P ∇_θ ℒ)`` (:func:`build`) on ``M`` noise samples from the generator of ``(seed, step)``."""
    on_theta = ascent_space(ascent) is AscentSpace.THETA
    value_and_grad = theta_sharpness_value_and_grad if on_theta else elbo_value_and_grad
    state = _repacked(family, state)
    generator = seeded_generator(state.aux[SEED_KEY], state.step, _device(state.params))
    theta = packed.as_packed(state.params)  # one layout check for the whole step
    noises = [family.noise(theta, generator) for _ in range(num_mc_samples)]
    kept = memory_entries(state.aux) if has_memory(ascent) else {}
    memory = {}  # the ascent step's memory (updated in place): one on θ, one per sample on weights
    if kept and on_theta:
        memory = {"memory": memory_of(kept)}
    elif kept:
        memory = {"memories": [memory_of(kept, _sample_name(i)) for i in range(num_mc_samples)]}
    record: dict[str, Tensor] = {}  # the ascent's step size on θ (theta_sharpness_value_and_grad)
    if on_theta:
        memory["record"] = record
    loss, logits, grads = value_and_grad(
        objective, family, theta, state.buffers, batch, noises, ascent=ascent, kl_weight=kl_weight, **memory
    )
    if variance_scale is not None:  # VarianceStep.NATURAL: (n/κG)·F⁻¹ on the diagonal variance block, clipped
        grads = family.natural_variance(theta, grads, variance_scale)  # type: ignore[attr-defined]
    own = optimizer.apply(state.params, grads, part(OPTIMIZER, state.aux), state.step)
    aux = {**chain((OPTIMIZER, own)), SEED_KEY: state.aux[SEED_KEY], **kept}
    stats = {f"ascent/{k}": v for k, v in record.items()}
    return replace(state, aux=aux, step=state.step + 1), StepOutput(loss, logits, stats)


def _sample_name(i: int) -> str:
    """The component name of Monte-Carlo sample ``i``'s ascent memory: ``ascent/sample<i>`` (:mod:`flatbma.named`)."""
    return f"{ASCENT}{SEP}sample{i}"


def weight_memories(family: ReparameterizedFamily, ascent: Ascent, theta: Mapping[str, Tensor], m: int) -> Params:
    """The memories of an ascent step on weights, one per Monte-Carlo sample: ``aux["ascent/sample<i>/…"]``.

    Sample ``i`` of a step continues the memory of sample ``i`` of the steps before. Shaped like the weights
    ``w(θ, z)`` of one draw with a throw-away generator (no generator of the run is drawn from).
    """
    with torch.no_grad():
        weights = family.reparameterize(theta, family.noise(theta, torch.Generator(_device(theta)).manual_seed(0)))
    return {k: v for i in range(m) for k, v in ascent_memory(ascent, weights, _sample_name(i)).items()}


def sampler(family: ReparameterizedFamily) -> Callable[[State, int, torch.Generator | None], list[Params]]:
    """``sample(state, n, generator)`` of ``family``: :func:`sample` with the family bound."""
    return partial(sample, family=family)


@torch.no_grad()
def sample(
    state: State, n: int, generator: torch.Generator | None = None, *, family: ReparameterizedFamily
) -> list[Params]:
    """``n`` draws ``w = reparameterize(θ, noise)`` of ``q_θ``, with the buffers."""
    return [
        {**family.reparameterize(state.params, family.noise(state.params, generator)), **clone(state.buffers)}
        for _ in range(n)
    ]


def mean_of(state: State) -> Params:
    """The weights at the mean ``μ`` of a Gaussian VI state (its ``mean/`` section), with its buffers."""
    mean = {n: v.detach().clone() for n, v in section(state.params, "mean").items()}
    return {**mean, **{k: v.detach().clone() for k, v in state.buffers.items()}}
