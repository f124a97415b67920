"""MC dropout (Gal & Ghahramani, ICML 2016) and its flat-seeking variant F-MC-dropout (Nguyen et al. 2023).

Dropout training is approximate VI with ``q(W)`` = the weights times Bernoulli masks; the BMA averages ``M``
forward passes, each with a fresh mask: ``p(y|x) ≈ (1/M) Σ_m softmax(f(x; w ⊙ z_m))``, ``z_m ~ Bernoulli(1 − p)``.
Its mean is the trained ``w``, its width that of the masked weights (:func:`dropout_weight_variance`).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.nn.modules.dropout import _DropoutNd

from flatbma.checks import is_number
from flatbma.errors import FlatbmaError
from flatbma.family import Family, Section, Stage
from flatbma.models import classifier_of
from flatbma.params import Objective
from flatbma.posteriors import point
from flatbma.rng import draw_seed, forked_rng
from flatbma.types import Ascent, GradientTransformation, Params, Posterior, State


@dataclass(frozen=True)
class Options:
    """MC dropout's options (:func:`build`).

    Attributes:
        rate: dropout probability ``p`` in ``[0, 1)``.
        override_existing: set the model's own dropout layers to ``rate`` (otherwise their rates are kept).
    """

    rate: float = 0.1
    override_existing: bool = True


def build(
    objective: Objective, optimizer: GradientTransformation, ascent: Ascent | None = None, **options
) -> Posterior:
    """MC dropout: train ``w`` with dropout active, predict with ``M`` fresh dropout masks.

    Training is :func:`flatbma.posteriors.point.build`'s update on the dropout network,
    ``w_{t+1} = opt(w_t, ∇L_B(w_t + ε_t; z'_t))`` with ``ε_t = ascent.perturb(w_t, ∇L_B(w_t; z_t))``, every forward
    pass drawing its own mask (with SAM, F-MC-dropout, the second pass sees a fresh ``z'_t``).

    **This function mutates** ``objective.model`` **(in place):**

    1. with ``override_existing``, every dropout layer (``nn.Dropout``, ``nn.Dropout1d/2d/3d``,
       ``nn.AlphaDropout``, ...) gets ``p = rate``;
    2. if ``rate > 0`` and afterwards no dropout layer has ``p > 0``, the classifier ``name`` found by
       :func:`flatbma.models.classifier_of` is replaced by ``nn.Sequential(nn.Dropout(rate), linear)``
       (the same ``nn.Linear``), renaming ``"<name>.weight"`` → ``"<name>.1.weight"``. Take the parameters passed
       to ``init`` (e.g. :func:`flatbma.params.trainable_params`) **after** ``build``; ``init`` rejects stale names.
       Building twice on the same model inserts nothing the second time.

    ``sample(state, n, generator)`` returns ``n`` references to the same weights; the masks are drawn by the forward
    passes in :func:`predict_mode`.

    Raises:
        FlatbmaError: ``rate`` outside ``[0, 1)``, or a dropout layer is needed but the model is a bare ``nn.Linear``.
    """
    o = Options(**options)
    if not is_number(o.rate) or not 0 <= o.rate < 1:
        raise FlatbmaError(f"method.rate must be in [0, 1) (the dropout probability), got {o.rate!r}")
    if not isinstance(o.override_existing, bool):
        raise FlatbmaError(f"method.override_existing must be true or false, got {o.override_existing!r}")
    prepare_dropout(objective.model, float(o.rate), override_existing=o.override_existing)
    return Posterior(
        init=partial(init, model=objective.model, optimizer=optimizer, ascent=ascent),
        update=partial(point.update, objective=objective, optimizer=optimizer, ascent=ascent),
        sample=sample,
        predict_mode=predict_mode,
        mean=point.weights_of,
        marginal_variance=partial(marginal_variance, model=objective.model),
    )


def init(
    params: Params, buffers: Params, *, model: nn.Module, optimizer: GradientTransformation, ascent: Ascent | None
) -> State:
    """The point's state (:func:`flatbma.posteriors.point.init`) of ``params``: ``model``'s, named after build."""
    names = dict(model.named_parameters())
    unknown = sorted(k for k in params if k not in names)
    if unknown:
        raise FlatbmaError(
            f"mc-dropout: parameters {unknown[:3]} are not parameters of the model; the model gained a "
            "dropout layer before its classifier in build(), which renamed them. Take the parameters "
            "after building the method (trainable_params(objective.model))."
        )
    return point.init(params, buffers, optimizer=optimizer, ascent=ascent)


def sample(state: State, n: int, generator: torch.Generator | None = None) -> list[Params]:
    """``n`` references to the trained weights (with the buffers): the masks are drawn in :func:`predict_mode`."""
    if n < 1:
        raise FlatbmaError(f"the number of samples must be >= 1 (eval.num_samples), got {n}")
    weights = {**state.params, **state.buffers}
    return [dict(weights) for _ in range(n)]


@contextmanager
def predict_mode(model: nn.Module, generator: torch.Generator | None = None) -> Iterator[nn.Module]:
    """:func:`mc_dropout_mode`, its masks drawn from torch's RNG forked and seeded by one draw from ``generator``.

    So the masks depend only on that seed and the order of the passes; ``None``: torch's global RNG itself.
    """
    with mc_dropout_mode(model):
        if generator is None:
            yield model
            return
        with forked_rng(draw_seed(generator)):
            yield model


def marginal_variance(state: State, *, model: nn.Module) -> Params:
    """The width of the masked weights: :func:`dropout_weight_variance` of the trained weights."""
    return dropout_weight_variance(model, state.params)


def dropout_weight_variance(model: nn.Module, params: Params) -> Params:
    """The marginal variances of MC dropout's weight distribution, by trained parameter name.

    An ``nn.Linear`` right after an ``nn.Dropout(p)`` in an ``nn.Sequential`` (the classifier :func:`build` inserts,
    or a torchvision-style head) has weights ``W_ij z_j/(1−p)``, ``z_j ~ Bernoulli(1−p)``: variance ``W_ij² p/(1−p)``.
    Every other trained parameter has variance 0 (dropout elsewhere has no weight-space form).
    """
    variance = {k: torch.zeros_like(v) for k, v in params.items()}
    for name, module in model.named_modules():
        if not isinstance(module, nn.Sequential):
            continue
        children = list(module.named_children())
        for (_, first), (child, second) in itertools.pairwise(children):
            key = f"{name}.{child}.weight" if name else f"{child}.weight"
            if type(first) is nn.Dropout and first.p > 0 and isinstance(second, nn.Linear) and key in params:
                w = params[key].detach()
                variance[key] = w * w * (first.p / (1 - first.p))
    return variance


def prepare_dropout(model: nn.Module, rate: float, *, override_existing: bool = True) -> list[str]:
    """Make ``model`` a dropout network with rate ``rate``, in place (see :func:`build`); return the renamed modules.

    The names of classifiers wrapped into ``nn.Sequential(nn.Dropout(rate), linear)``: none when the model already had
    an active dropout layer or ``rate`` is 0.
    """
    layers = [m for m in model.modules() if isinstance(m, _DropoutNd)]
    if override_existing:
        for m in layers:
            m.p = rate
    if rate == 0 or any(m.p > 0 for m in layers):
        return []
    name, linear = classifier_of(model)
    if name == "":
        raise FlatbmaError(
            "mc-dropout needs a dropout layer, but the model is a bare nn.Linear with no parent to insert "
            "one into; wrap it, e.g. nn.Sequential(nn.Dropout(p), linear)."
        )
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent), child, nn.Sequential(nn.Dropout(rate), linear))
    return [name]


@contextmanager
def mc_dropout_mode(model: nn.Module) -> Iterator[nn.Module]:
    """Eval mode for every module except dropout layers, which stay stochastic; modes restored after."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    for m in model.modules():
        if isinstance(m, _DropoutNd):
            m.train()
    try:
        yield model
    finally:
        for m, training in modes:
            m.training = training


def check_dropout_rate(method: Section, stage: Stage) -> None:
    """MC dropout: ``rate: 0`` over every dropout layer (``override_existing``) draws no mask, a silent point estimate.

    Raises:
        FlatbmaError: ``rate`` is 0 and ``override_existing`` is set.
    """
    if method.options["rate"] == 0 and method.options["override_existing"]:
        raise FlatbmaError(
            f"{stage.key('rate')}=0.0 sets every dropout layer to p=0, so every {method.name} sample is the same "
            "network (a point estimate, which sgd trains): use a rate in (0, 1), e.g. 0.1"
        )


def advice(method: Section, prior: bool, diagnostics: Mapping[str, Any]) -> str:
    """What to change when MC dropout's BMA is worse than its mean network (:attr:`Family.advice`): half the rate."""
    rate = method.options["rate"]
    return f"rate: {rate / 2:g} (now {rate:g})"


FAMILY = Family(build, Options, check=check_dropout_rate, advice=advice)
"""MC dropout, and with SAM on the dropout net F-MC-dropout (:mod:`flatbma.methods`)."""
