"""From PyTorch in one call: train a registered method on your module and loader, get a :class:`~flatbma.predictor.BMA`.

:func:`fit_posterior` is the CLI's path written once: parse the method (:func:`~flatbma.methods.parse_method`),
build it with an ``optim`` section's optimizer (:class:`~flatbma.optim.config.OptimConfig`, the CLI's defaults),
train it through :func:`flatbma.training.build` and :func:`flatbma.training.train`, then build the predictor —
so its numbers equal ``flatbma train``'s exactly. :func:`load_posterior` reads back what
:meth:`BMA.save <flatbma.predictor.BMA.save>` wrote, rebuilding the method from the recorded section.

Over 500 lines on purpose: beside the two functions, every check of the caller's model, data and options.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from flatbma import likelihood as likelihoods
from flatbma import training
from flatbma.checks import check_seed, is_int, shown
from flatbma.errors import DivergenceError, FlatbmaError, FlatbmaTypeError, FlatbmaWarning
from flatbma.family import RunShape, Stage, available_memory
from flatbma.health import too_wide_line, worse_than_mean
from flatbma.likelihood import Likelihood
from flatbma.loop import History
from flatbma.methods import MethodConfig, parse_method
from flatbma.models import check_classifier, keep_logits, returns_sequence
from flatbma.optim.config import OptimConfig
from flatbma.options import parse_dataclass
from flatbma.params import Objective, model_buffers, trainable_params
from flatbma.posteriors import gaussians
from flatbma.predict import evaluate
from flatbma.predictor import BMA, target_device
from flatbma.predictor_file import likelihood_of, read_file
from flatbma.prior import check_lr_with_prior, not_gaussian_message, parse_prior
from flatbma.regression import Gaussian
from flatbma.rng import first_batch, forked_rng
from flatbma.training import EpochLines
from flatbma.types import Batch, Posterior, State, split_batch, training_batch


def fit_posterior(
    model: nn.Module,
    loader: Iterable[Batch],
    method: str | Mapping[str, Any] = "swag",
    *,
    epochs: int | None = None,
    lr: float | None = None,
    optim: Mapping[str, Any] | None = None,
    num_samples: int = 30,
    seed: int = 0,
    device: torch.device | str | None = None,
    recompute_bn: bool | None = None,
    load_into: bool = True,
    progress: bool = True,
    val_loader: Iterable[Batch] | None = None,
    likelihood: str = "categorical",
    noise_std: float | None = None,
    posthoc: bool = False,
    prior: Mapping[str, Any] | None = None,
    **method_options: Any,
) -> BMA:
    """Train ``method`` on ``model`` over ``loader`` for ``epochs`` epochs and return its BMA predictor.

    ``flatbma train``'s path in one call, with the same numbers: the method section ``{"name": method,
    **method_options}``, the ``optim`` section ``{**optim, "lr": lr}`` with the CLI's defaults, training with torch's
    global generator forked and seeded with ``seed`` (the caller's stream and the module's train/eval mode are
    restored), then ``BMA(model, method, state, loader, ...)`` with the training log in
    :attr:`BMA.history <flatbma.predictor.BMA.history>`. Distributed training is the CLI's. What it owns and checks:
    docs/python-api.md.

    Before training, one forward pass on the first batch checks the data and model: a batch is ``(x, y)`` or a
    dict (:func:`flatbma.types.split_batch`); targets are integer labels in ``[0, classes)`` or soft targets
    ``[batch, classes]`` (rows ≥ 0 summing to 1; loss ``−Σ_c y_c log p_c``); the model returns float32/float64
    logits ``[batch, classes]``, or a tuple led by them (:func:`flatbma.models.keep_logits` then hooks it).

    Post hoc (``posthoc=True``): a family whose posterior phase starts at ``start_step`` (default ``null``) starts it
    at the first update: Laplace's curvature pass alone (``epochs`` defaults to 0), SWAG's snapshots at the held
    ``lr`` (Maddox et al., NeurIPS 2019). Other methods refuse it.

    Two stages (``prior={"method": {...}, "epochs": ..., "optim": ..., "init": ..., "min_std": ...}``): FP-BMA's
    Bayesian transfer pipeline (Lim et al., UAI 2025; docs/cli.md "Two-stage runs"): the first stage's Gaussian
    posterior, ``σ`` floored at ``min_std``, becomes ``method``'s prior and (``init``) its start.

    Args:
        model: a classifier returning logits, moved to ``device``; parameters with ``requires_grad=False`` stay fixed.
        loader: a DataLoader over a sized dataset (its size scales KL terms and SG-MCMC noise; its dataset, in a
            fixed order, recomputes BatchNorm statistics) or any re-iterable of batches; not a one-shot iterator.
        method: a registered method name (``flatbma methods``) or a method section ``{name: ..., ...}``.
        epochs: passes over ``loader`` (Laplace adds its curvature pass); required unless ``posthoc``.
        lr: the peak learning rate (``optim.lr``); ``None`` keeps the section's.
        optim: other ``optim`` keys (``name``, ``momentum``, ``weight_decay``, ``schedule``, ...).
        num_samples: ``M``, samples of the BMA.
        seed: seeds training's draws (data order, initialization, dropout) and the BMA's samples.
        device: where to train and predict; ``None``: the module's device.
        recompute_bn: see :class:`~flatbma.predictor.BMA`.
        load_into: write the posterior mean with its BatchNorm statistics (a mixture's member 0) into ``model``
            (:meth:`BMA.load_into <flatbma.predictor.BMA.load_into>`); ``False`` leaves the weights as they were.
        progress: a bar on a terminal, else one line per epoch; ``False``: nothing (:mod:`flatbma.progress`).
        val_loader: validation ``(x, y)`` batches: options given as ``"val"`` are chosen on them by the BMA's NLL
            (candidates in :attr:`BMA.selection <flatbma.predictor.BMA.selection>`), and a classifier's BMA is
            compared with its reference network on them (else on the training data; :mod:`flatbma.health`).
        likelihood: ``categorical`` (softmax, cross-entropy) or ``gaussian`` (regression with float targets
            ``[batch]``, :class:`flatbma.regression.Gaussian`; predict with
            :meth:`~flatbma.predictor.BMA.predict_regression`). Laplace refuses ``gaussian``.
        noise_std: with ``gaussian``: ``None`` learns the noise (the model returns ``[batch, 2]``: mean and raw
            scale); a positive number fixes it (the model returns ``[batch, 1]``).
        posthoc: fit the posterior around the module's trained weights, with no MAP phase (above).
        prior: a ``prior`` section: train a Gaussian posterior first and use it as ``method``'s prior (above).
        **method_options: the method's options (e.g. ``rank=10``, ``rho=0.05``).

    Raises:
        FlatbmaError: invalid options, model or data (FlatbmaTypeError, also a ``TypeError``, for a wrong kind).
        DivergenceError: training diverged (a FlatbmaError).
    """
    _check_model_argument(model)
    epochs = _epochs(epochs, posthoc)
    check_seed(seed, "seed")
    gaussian = likelihoods.build(likelihood, noise_std)
    config = parse_method(_method_section(method, method_options))
    if posthoc:
        _check_posthoc(config)
    first = parse_prior(prior, config) if prior is not None else None
    choose = config.on_validation()  # options set to "val": chosen on val_loader after training
    if choose and val_loader is None:
        raise FlatbmaError(
            f"{', '.join(f'{k}=val' for k in choose)} chooses {'it' if len(choose) == 1 else 'them'} by the validation "
            "NLL: pass val_loader= (held-out (x, y) batches), or give a value"
        )
    optim_section = _optim_section(optim, lr)
    optim_config = parse_dataclass(OptimConfig, optim_section, "optim")
    if epochs > 0:  # post hoc (epochs 0) trains no step to warm up
        optim_config.check_length(epochs, "optim", "epochs")
    steps, num_data = _sizes(loader)
    train_device = target_device(device, model)
    classes = _FIRST_BATCH[likelihoods.kind(gaussian)](model, loader, gaussian)
    map_steps = 0 if posthoc else epochs * steps  # post hoc: no update belongs to a MAP phase
    check = dict(model=model, steps=steps, num_data=num_data, num_classes=classes, device=train_device)
    if first is not None:  # both stages' options, before either trains (the CLI's validate_run)
        _check_run(first.method, epochs=first.epochs, keys=("prior.epochs", "prior.method"), **check)
        check_lr_with_prior(first, optim_config, config, num_data)
    _check_run(config.resolved(0) if posthoc else config, epochs=epochs, **check)  # post hoc: from update 0
    model.to(train_device)
    objective = Objective(model=model, num_data=num_data, loss_fn=likelihoods.loss(gaussian))
    stage = dict(
        loader=loader,
        steps=steps,
        seed=seed,
        device=train_device,
        progress=progress,
        gaussian=gaussian,
        classes=classes,
    )
    prior_theta, start = None, None
    if first is not None:
        shuffling = _loader_generator(loader)
        order = shuffling.get_state() if shuffling is not None else None
        stage_method = config.first_stage(first.method)  # a mixture's: a mixture of it, one prior per member
        stage_optim = first.optim or optim_config
        _, fitted, fitted_state, _ = _train(
            stage_method,
            stage_optim,
            objective,
            epochs=first.epochs,
            map_steps=first.epochs * steps,
            **stage,
            check=lambda posterior: _check_gaussian(posterior, first.method.name),
        )
        prior_theta = gaussians.floored(fitted.can.gaussian(fitted_state), first.min_std)
        if first.init:
            start = (prior_theta, dict(fitted_state.buffers))
        if shuffling is not None:  # the second stage reads the data in the order the first began with
            shuffling.set_state(order)
    optimizer, posterior, state, log = _train(
        config,
        optim_config,
        objective,
        epochs=epochs,
        map_steps=map_steps,
        prior_theta=prior_theta,
        start=start,
        **stage,
    )

    def predictor(config: MethodConfig, posterior: Posterior) -> BMA:
        return BMA(
            model,
            posterior,
            state,
            loader,
            num_samples=num_samples,
            seed=seed,
            recompute_bn=recompute_bn,
            device=train_device,
            method_config=config.resolved(map_steps).to_dict(),  # start_step: null as the run resolved it
            optim_config=optim_section,
            num_data=num_data,
            likelihood=gaussian,
        )

    selection: list[dict[str, Any]] = []
    for option, grid in choose.items():  # each candidate: the same trained state, another posterior
        for value in grid:
            candidate = config.with_options(**{option: value})
            nll = predictor(candidate, candidate.build(objective, optimizer, map_steps=map_steps)).evaluate(
                val_loader, num_classes=classes
            )["nll"]
            selection.append({option: value, "val/nll": nll})
        best = min(selection, key=lambda row: row["val/nll"])  # the first of equal ones: the smallest value
        config = config.with_options(**{option: best[option]})
        posterior = config.build(objective, optimizer, prior_theta, map_steps=map_steps)
    bma = predictor(config, posterior)
    bma.selection = selection
    bma.history = log.rows
    if classes is not None:  # the health rule worse_than_mean, as the CLI's (a regression has none)
        data = val_loader if val_loader is not None else loader
        _check_against_reference(bma, config, data, val_loader is not None, classes, prior=first is not None)
    if load_into:
        bma.load_into()
    return bma


def load_posterior(
    path: str | Path,
    model: nn.Module,
    train_loader: Iterable[Batch] | None = None,
    *,
    device: torch.device | str | None = None,
) -> BMA:
    """The predictor :func:`fit_posterior`'s :meth:`BMA.save <flatbma.predictor.BMA.save>` wrote to ``path``.

    The method is rebuilt from the section recorded in the file, for ``model``: a fresh module of the same
    architecture (MC dropout's layer and a recorded :func:`~flatbma.models.keep_logits` hook are installed again).
    Predictions equal the saved predictor's bit for bit; ``train_loader`` is needed when the predictor recomputes
    BatchNorm statistics, as at saving.
    """
    _check_model_argument(model)
    if not isinstance(path, str | os.PathLike):
        raise FlatbmaTypeError(f"path must be a file path (str or os.PathLike), got a {type(path).__name__}")
    _, settings = read_file(path)
    section = settings["method"]
    if not isinstance(section, Mapping):
        raise FlatbmaError(
            f"{path} records no method (the predictor was built by hand): rebuild the method and use "
            "flatbma.BMA.load(path, model, method, train_loader)"
        )
    config = parse_method(section)
    num_data = settings.get("num_data", 1)
    if not is_int(num_data) or num_data < 1:
        raise FlatbmaError(f"{path}: the predictor settings are damaged (num_data {shown(num_data)}); save it again")
    gaussian = likelihood_of(settings, path)
    objective = Objective(model=model, num_data=num_data, loss_fn=likelihoods.loss(gaussian))
    optim = settings.get("optim", {})  # a predictor built by hand records none: the default optimizer's entries
    if not isinstance(optim, Mapping):
        raise FlatbmaError(f"{path}: the predictor settings are damaged (optim {shown(optim)}); save it again")
    optimizer = parse_dataclass(OptimConfig, optim, f"{path}: optim").build(steps_per_epoch=1, epochs=1)
    posterior = config.build(objective, optimizer)
    return BMA.load(path, model, posterior, train_loader, device=device)


def _check_model_argument(model: object) -> None:
    if not isinstance(model, nn.Module):
        raise FlatbmaTypeError(f"model must be a torch.nn.Module, got a {type(model).__name__}")


def _train(
    config: MethodConfig,
    optim_config: OptimConfig,
    objective: Objective,
    *,
    loader: Iterable[Batch],
    epochs: int,
    steps: int,
    map_steps: int,
    seed: int,
    device: torch.device,
    progress: bool,
    gaussian: Gaussian | None,
    classes: int | None = None,
    prior_theta: Mapping[str, Tensor] | None = None,
    start: tuple[Mapping[str, Tensor], Mapping[str, Tensor]] | None = None,
    check: Callable[[Posterior], None] | None = None,
) -> tuple[Any, Posterior, State, EpochLines]:
    """One stage of :func:`fit_posterior`: ``(optimizer, posterior, trained state, its epoch log)``.

    Builds ``config``'s method (prior ``prior_theta``), lets ``check`` see the posterior, initializes it at ``start``
    ``(params, buffers)`` or at the module's weights, and trains it with torch's global generator forked and seeded
    with ``seed``. With ``classes`` every batch's labels are checked to lie in ``[0, classes)``.
    """
    built = training.build(
        config, optim_config, objective, steps_per_epoch=steps, epochs=epochs, map_steps=map_steps, prior=prior_theta
    )
    if check is not None:
        check(built.posterior)
    model = objective.model
    try:
        with forked_rng(seed):
            state = _init(built.posterior, config.name, start or (trainable_params(model), model_buffers(model)), start)
            log = EpochLines(
                epochs=built.epochs,
                learning_rate=built.learning_rate,
                history=History(),
                lines=progress,
                accuracy=likelihoods.kind(gaussian).has_classes,  # regression targets have none
            )
            state, _ = training.train(
                built.posterior,
                state,
                loader,
                model=model,
                epochs=built.epochs,
                device=device,
                lines=log,
                progress=progress,
                regression=not likelihoods.kind(gaussian).has_classes,
                num_classes=classes,
            )
    except DivergenceError as e:
        advice = "" if e.cause == "inputs" else f"; {config.divergence_advice(e.cause, optim_config.lr, prefix='')}"
        raise DivergenceError(f"{e}{advice}", cause=e.cause) from None
    return built.optimizer, built.posterior, state, log


def _init(posterior: Posterior, name: str, at: tuple[Mapping[str, Tensor], Mapping[str, Tensor]], prior: Any) -> State:
    """``posterior.init(*at)``; at a fitted prior (``prior`` given) a refusal says what the first stage can change."""
    try:
        return posterior.init(*at)
    except FlatbmaError as e:
        if prior is None:
            raise
        raise FlatbmaError(
            f"{name} cannot start at the fitted prior: {e} — or let the first stage collect more snapshots (raise "
            "prior['epochs'], lower prior['method']'s start_step or collect_every)"
        ) from None


def _epochs(epochs: object, posthoc: object) -> int:
    """The epochs of :func:`fit_posterior`: a positive integer, or with ``posthoc`` any from 0 (its default)."""
    if not isinstance(posthoc, bool):
        raise FlatbmaTypeError(f"posthoc must be True or False, got {shown(posthoc)}")
    if epochs is None:
        if posthoc:
            return 0
        raise FlatbmaError("epochs is required: give the passes over the loader (epochs=10), or posthoc=True")
    if not is_int(epochs) or epochs < (0 if posthoc else 1):
        least = "an integer >= 0 with posthoc" if posthoc else "a positive integer"
        raise FlatbmaError(f"epochs must be {least}, got {shown(epochs)}")
    return int(epochs)


def _check_posthoc(config: MethodConfig) -> None:
    """Refuse ``posthoc`` for a method with no MAP phase before its posterior's, or with its start given."""
    sections = config.after_map()
    if not sections:
        raise FlatbmaError(
            f"posthoc: {config.name} has no MAP phase to skip (it already starts at the module's weights): drop "
            "posthoc=True, or use a method fitted around a trained network (laplace, swag)"
        )
    given = [c.options["start_step"] for c in sections if c.options.get("start_step") is not None]
    if given:
        raise FlatbmaError(
            f"posthoc=True starts {config.name}'s posterior phase at the first update, but start_step={given[0]} is "
            "given too: keep one"
        )


def _check_gaussian(posterior: Posterior, name: str) -> None:
    """A first stage's posterior must be a low-rank plus diagonal Gaussian (an option may turn it off)."""
    if posterior.can.gaussian is None:
        raise FlatbmaError(not_gaussian_message(name))


def _loader_generator(loader: Iterable[Batch]) -> torch.Generator | None:
    """The loader's own shuffling generator (a DataLoader's ``generator``), or ``None``."""
    generator = getattr(loader, "generator", None)
    return generator if isinstance(generator, torch.Generator) else None


def _check_against_reference(
    bma: BMA, config: MethodConfig, data: Iterable[Batch], validation: bool, num_classes: int, *, prior: bool
) -> None:
    """Warn when the BMA's NLL on ``data`` is worse than its reference network's: the CLI's rule and words.

    The reference is :meth:`BMA.reference <flatbma.predictor.BMA.reference>` evaluated as a point estimate (on
    validation data both example by example); the rule :func:`flatbma.health.worse_than_mean`. Soft targets are
    not compared.
    """
    first = first_batch(data)
    if first is None or split_batch(first)[1] is None:
        return
    if split_batch(first)[1].is_floating_point():  # type: ignore[union-attr]  # soft targets: no labels to score
        return
    which = "validation" if validation else "training"
    try:
        cuda = [bma.device.index or 0] if bma.device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda):  # a DataLoader's iterator draws its seed: the caller's stream stays
            weights, reference = bma.reference()
            if validation:  # example by example: the rule weighs the difference against its noise
                measured = bma.paired_nll(data, weights)
            else:
                ours = bma.evaluate(data, num_classes=num_classes)
                theirs = evaluate(bma.model, [weights], data, num_classes=num_classes, device=bma.device)
                measured = {
                    "examples": int(theirs["n"]),
                    "bma_nll": ours["nll"],
                    "bma_accuracy": ours["accuracy"],
                    "mean_nll": theirs["nll"],
                    "mean_accuracy": theirs["accuracy"],
                }
    except FlatbmaError as e:
        raise FlatbmaError(f"comparing the BMA with its reference network on the {which} data: {e}") from None
    compared = {"data": which, "num_classes": num_classes, "reference": reference, **measured}
    if not worse_than_mean(compared):
        return
    diagnostics = bma.method.can.diagnostics(bma.state) if bma.method.can.diagnostics is not None else {}
    line = too_wide_line(f"the {config.name} BMA", compared, config.advice(prior, diagnostics))
    warnings.warn(FlatbmaWarning(line), stacklevel=3)


def _check_run(
    config: MethodConfig,
    *,
    model: nn.Module,
    steps: int,
    num_data: int,
    num_classes: int | None,
    epochs: int,
    device: torch.device,
    keys: tuple[str, str] = ("train.epochs", "method"),
) -> None:
    """Refuse options that ask more of the run than it gives, as ``flatbma train`` does (same check, same words).

    The messages name the CLI's ``keys`` (a first stage's: ``prior.epochs``, ``prior.method``). The module's weights
    count as pretrained (``prior_mean: pretrained`` reads them).
    """
    weights = config.needs_weights()
    shape = RunShape(
        steps_per_epoch=steps,
        num_train=num_data,
        num_test=0,
        num_trainable=sum(p.numel() for p in model.parameters() if p.requires_grad) if weights else None,
        num_classes=num_classes,
        pretrained=True,
        available_memory=available_memory(device) if weights else None,
    )
    config.check(Stage(shape, epochs, *keys))


def _check_first_batch(model: nn.Module, loader: Iterable[Batch]) -> int:
    """Check the model and data on the loader's first batch before anything trains; return the number of classes.

    A model whose forward returns a tuple or list gets :func:`~flatbma.models.keep_logits` (logits first).
    """
    batch = first_batch(loader)
    if batch is None:
        raise FlatbmaError("the training loader yields no batch")
    x, y = training_batch(batch)
    here = target_device(None, model)  # checked where the model is: a meta module cannot move
    try:
        classes = check_classifier(model, x[:2].to(here), name="the model")
    except FlatbmaTypeError:  # a tuple output (logits, extras) passed every other check: keep its first element
        if not (x.is_floating_point() and returns_sequence(model, x[:2].to(here), name="the model")):
            raise
        classes = check_classifier(keep_logits(model), x[:2].to(here), name="the model")
    if y.is_floating_point():  # soft targets: probabilities over the model's classes
        if y.shape[1] != classes:
            raise FlatbmaError(
                f"soft targets have {y.shape[1]} columns but the model returns {classes} logits per example: give "
                f"class probabilities [batch, {classes}]"
            )
        if bool((y < 0).any()) or not torch.allclose(y.sum(-1), torch.ones_like(y[:, 0]), atol=1e-4):
            raise FlatbmaError(
                "soft targets must be class probabilities: non-negative rows that sum to 1 (e.g. y.softmax(-1), or "
                "one-hot and label-smoothed rows)"
            )
        return classes
    bad = (y < 0) | (y >= classes)
    if bool(bad.any()):
        raise FlatbmaError(
            f"label {int(y[bad][0])} is out of range: the model returns {classes} logits per example, so labels "
            f"must be class indices in [0, {classes})"
        )
    return classes


def _check_first_regression_batch(model: nn.Module, loader: Iterable[Batch], gaussian: Gaussian) -> None:
    """A regression's model and data, checked on the loader's first batch (:func:`fit_posterior`).

    The batch is ``(x, y)`` with floating-point targets ``[batch]``; the model returns ``[batch, outputs]``
    (:attr:`~flatbma.regression.Gaussian.outputs`: 2 with a learned noise, 1 with a fixed one).
    """
    batch = first_batch(loader)
    if batch is None:
        raise FlatbmaError("the training loader yields no batch")
    if not (isinstance(batch, tuple | list) and len(batch) == 2 and all(isinstance(t, torch.Tensor) for t in batch)):
        raise FlatbmaTypeError(
            f"a training batch must be a pair (x, y) of inputs and targets, got a {type(batch).__name__}: give a "
            "DataLoader of (x, y) batches (e.g. over a TensorDataset(x, y))"
        )
    x, y = batch
    if not y.is_floating_point() or y.dim() != 1 or y.shape[0] != x.shape[0]:
        hint = " (squeeze a [batch, 1] target tensor with y.squeeze(1))" if y.dim() == 2 and y.shape[1] == 1 else ""
        raise FlatbmaError(
            f"regression targets must be floating point, one per example ([batch]), got {str(y.dtype)[6:]} of shape "
            f"{list(y.shape)} for inputs of shape {list(x.shape)}{hint}"
        )
    here = target_device(None, model)
    was_training = model.training
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            model.eval()
            out = model(x[:2].to(here))
    except (RuntimeError, ValueError, IndexError, TypeError) as e:
        detail = str(e).strip().splitlines()[0][:120] if str(e).strip() else type(e).__name__
        raise FlatbmaError(f"the model fails on the first batch ({detail}): give inputs it can take") from None
    finally:
        model.train(was_training)
    want = [min(2, x.shape[0]), gaussian.outputs]
    if not isinstance(out, torch.Tensor) or list(out.shape) != want:
        got = list(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        noise = "mean and raw scale: a learned noise" if gaussian.noise_std is None else "the mean: a fixed noise_std"
        raise FlatbmaError(f"a Gaussian regression model must return {want} ({noise}), got {got}")


def _method_section(method: str | Mapping[str, Any], options: Mapping[str, Any]) -> dict[str, Any]:
    if isinstance(method, str):
        return {"name": method, **options}
    if not isinstance(method, Mapping):
        raise FlatbmaError(f"method must be a method name or a method section {{name: ...}}, got {shown(method)}")
    twice = sorted(set(method) & set(options))
    if twice:
        raise FlatbmaError(f"method option(s) {', '.join(twice)} given twice: in the method section and as keywords")
    return {**method, **options}


def _optim_section(optim: Mapping[str, Any] | None, lr: float | None) -> dict[str, Any]:
    if optim is not None and not isinstance(optim, Mapping):
        raise FlatbmaError(f"optim must be a mapping of optim keys (lr, momentum, ...), got {shown(optim)}")
    section = dict(optim or {})
    if lr is not None:
        if "lr" in section:
            raise FlatbmaError("the learning rate is given twice: as lr= and in optim; keep one")
        section["lr"] = lr
    return section


def _sizes(loader: Iterable[Batch]) -> tuple[int, int]:
    """``(steps per epoch, number of training examples)`` of ``loader``.

    A DataLoader over a sized dataset: ``len(loader)`` and ``len(loader.dataset)``. Any other re-iterable of
    batches is read once, every random stream left as it was, and its batches and rows counted.
    """
    dataset = getattr(loader, "dataset", None)
    if dataset is not None:
        try:
            steps, num_data = len(loader), len(dataset)  # type: ignore[arg-type]
        except TypeError:
            raise FlatbmaError(
                f"loader must be a DataLoader over a dataset of known size (its length sets the schedule and the "
                f"number of examples), got a {type(loader).__name__}"
            ) from None
    elif isinstance(loader, Iterable) and not isinstance(loader, Iterator | Tensor | str | Mapping):
        with torch.random.fork_rng(devices=[]):  # a list draws nothing; another iterable might
            sizes = [len(training_batch(batch)[0]) for batch in loader]
        steps, num_data = len(sizes), sum(sizes)
    else:
        raise FlatbmaError(
            f"loader must be a DataLoader or a re-iterable of batches (a list of (x, y) pairs), got a one-shot "
            f"{type(loader).__name__}: every epoch reads it again"
            if isinstance(loader, Iterator)
            else f"loader must be a DataLoader or a list of (x, y) batches, got a {type(loader).__name__}"
        )
    if steps == 0 or num_data == 0:
        raise FlatbmaError("the training loader is empty")
    return steps, num_data


_FIRST_BATCH: dict[Likelihood, Callable[[nn.Module, Iterable[Batch], Gaussian | None], int | None]] = {
    Likelihood.CATEGORICAL: lambda model, loader, _: _check_first_batch(model, loader),
    Likelihood.GAUSSIAN: _check_first_regression_batch,  # type: ignore[dict-item]
}
"""The check of the first batch by likelihood (:mod:`flatbma.likelihood`): a classifier's gives its classes."""
