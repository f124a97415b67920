"""From PyTorch in one call: train a registered method on your module and loader, get a :class:`~flatbma.predictor.BMA`.

:func:`fit_posterior` is the manual path written once — parse the method by name
(:func:`~flatbma.experiment.config.methods.parse_method`), build the optimizer of an ``optim`` section
(:class:`~flatbma.experiment.config.sections.OptimConfig`, the CLI's defaults), ``method.init`` at the
module's weights, :func:`~flatbma.experiment.runner.fit` (the one loop), then the predictor — so its
numbers equal that path's exactly (the README shows both). :func:`load_posterior` reads back what
:meth:`BMA.save <flatbma.predictor.BMA.save>` wrote, rebuilding the method from the recorded section.

Both are reached as ``flatbma.fit_posterior`` / ``flatbma.load_posterior``; ``import flatbma`` loads
this module only when one of them is first used.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from flatbma.checks import check_seed, is_int
from flatbma.errors import DivergenceError, FlatbmaError, FlatbmaTypeError
from flatbma.experiment.config.methods import parse_method
from flatbma.experiment.config.parse import parse_dataclass, shown
from flatbma.experiment.config.sections import OptimConfig
from flatbma.experiment.runner import fit
from flatbma.models import check_classifier
from flatbma.params import Objective, model_buffers, trainable_params
from flatbma.predictor import BMA, likelihood_of, read_file, target_device
from flatbma.regression import Gaussian
from flatbma.rng import first_batch, forked_rng
from flatbma.types import Batch, training_batch


def fit_posterior(
    model: nn.Module,
    loader: Iterable[Batch],
    method: str | Mapping[str, Any] = "swag",
    *,
    epochs: int,
    lr: float | None = None,
    optim: Mapping[str, Any] | None = None,
    num_samples: int = 30,
    seed: int = 0,
    device: torch.device | str | None = None,
    recompute_bn: bool | None = None,
    load_into: bool = False,
    progress: bool = False,
    likelihood: str = "categorical",
    noise_std: float | None = None,
    **method_options: Any,
) -> BMA:
    """Train ``method`` on ``model`` over ``loader`` for ``epochs`` epochs and return its BMA predictor.

    What it does, step by step (the README's manual block does the same by hand):

    1. ``parse_method({"name": method, **method_options})`` — options as in a config's ``method``
       section (``flatbma methods NAME`` lists them), checked, with their defaults;
    2. the optimizer of the ``optim`` section ``{**optim, "lr": lr}`` with the CLI's defaults (SGD with
       momentum and weight decay, cosine schedule over ``epochs · len(loader)`` steps);
    3. ``method.build(Objective(model, num_data=len(loader.dataset)), optimizer, map_steps=epochs ·
       len(loader))`` (MC dropout inserts its dropout layer here; Laplace's MAP phase is ``map_steps``
       long), then ``method.init`` at the module's trainable parameters and buffers;
    4. with torch's global generator forked and seeded with ``seed`` (the caller's stream is left
       alone): ``init`` and :func:`~flatbma.experiment.runner.fit` with the module in train mode — for
       ``epochs`` epochs plus the method's extra ones (``laplace``, ``f-laplace``: one, the curvature
       pass) —; its train/eval mode is restored afterwards;
    5. ``BMA(model, method, state, loader, num_samples=..., seed=seed, recompute_bn=...)``, and with
       ``load_into`` :meth:`BMA.load_into <flatbma.predictor.BMA.load_into>`.

    Two-stage runs (a ``prior`` section) and distributed training are the CLI's (``flatbma train``).

    Args:
        model: any classifier ``nn.Module`` returning logits; parameters with ``requires_grad=False``
            stay fixed (not Bayesian). Without ``load_into`` its weights are left as they were.
        loader: ``(x, y)`` training batches — a DataLoader over a sized dataset (its size scales KL
            terms and SG-MCMC noise); its dataset, in a fixed order, also serves to recompute BatchNorm
            statistics.
        method: a registered method name (``flatbma methods``) or a method section ``{name: ..., ...}``.
        epochs: passes over ``loader`` (the optimizer's schedule spans them; Laplace adds its curvature pass).
        lr: the peak learning rate (``optim.lr``); ``None`` keeps the section's.
        optim: other ``optim`` keys (``name``, ``momentum``, ``weight_decay``, ``schedule``, ...).
        num_samples: ``M``, samples of the BMA.
        seed: seed of training's random draws (data order of a DataLoader without its own generator,
            initialization noise, dropout masks) and of the BMA's samples.
        device: where to train and predict (the module is moved there); ``None``: the module's device.
        recompute_bn: see :class:`~flatbma.predictor.BMA`.
        load_into: write the posterior mean (with the BMA's BatchNorm statistics) into ``model``.
        progress: show a progress bar on a terminal.
        likelihood: ``categorical`` (a classifier: softmax of the logits, cross-entropy) or ``gaussian``
            (regression, :class:`flatbma.regression.Gaussian`: the loss is the Gaussian NLL, the batches'
            targets are floats ``[batch]`` and the predictor's :meth:`~flatbma.predictor.BMA.predict_regression`
            and :meth:`~flatbma.predictor.BMA.evaluate` give the mixture predictive and its NLL, RMSE and coverage).
            Laplace (a softmax Gauss-Newton) refuses ``gaussian``.
        noise_std: with ``gaussian``: ``None`` learns the noise (the model returns ``[batch, 2]``: mean and raw
            scale), a positive number fixes it (the model returns ``[batch, 1]``).
        **method_options: the method's options (e.g. ``rank=10``, ``rho=0.05``).

    Before training, the model is checked with one forward pass on the first batch of ``loader`` (read
    without moving any random stream: :func:`flatbma.rng.first_batch`): the batch is a pair ``(x, y)`` of
    inputs and 1-D integer labels, the model returns float32 or float64 logits ``[batch, classes]``
    (:func:`flatbma.models.check_classifier`: no meta or 16-bit weights, something to train) and the labels
    lie in ``[0, classes)``.

    Raises:
        FlatbmaError: invalid options, model or data (a :class:`~flatbma.errors.FlatbmaTypeError`, also a
            ``TypeError``, for an argument of the wrong kind), each in one line saying what to change;
            DivergenceError (a FlatbmaError) when training diverges.
    """
    _check_model_argument(model)
    if not is_int(epochs) or epochs < 1:
        raise FlatbmaError(f"epochs must be a positive integer, got {shown(epochs)}")
    check_seed(seed, "seed")
    gaussian = _likelihood(likelihood, noise_std)
    config = parse_method(_method_section(method, method_options))
    optim_config = parse_dataclass(OptimConfig, _optim_section(optim, lr), "optim")
    steps, num_data = _sizes(loader)
    train_device = target_device(device, model)
    if gaussian is None:
        _check_first_batch(model, loader)
    else:
        _check_first_regression_batch(model, loader, gaussian)
    model.to(train_device)
    objective = Objective(model=model, num_data=num_data, **({"loss_fn": gaussian} if gaussian is not None else {}))
    optimizer = optim_config.build(steps_per_epoch=steps, epochs=epochs)
    posterior = config.build(objective, optimizer, map_steps=epochs * steps)
    was_training = model.training
    try:
        with forked_rng(seed):
            state = posterior.init(trainable_params(model), model_buffers(model))
            model.train()
            total = epochs + config.extra_epochs()  # Laplace: the curvature epoch after the MAP's
            state, _ = fit(posterior, state, loader, epochs=total, device=train_device, progress=progress)
    except DivergenceError as e:
        raise DivergenceError(f"{e}; lower the learning rate (e.g. lr={optim_config.lr / 10:g})") from None
    finally:
        model.train(was_training)
    bma = BMA(
        model,
        posterior,
        state,
        loader,
        num_samples=num_samples,
        seed=seed,
        recompute_bn=recompute_bn,
        device=train_device,
        method_config=config.to_dict(),
        num_data=num_data,
        likelihood=gaussian,
    )
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

    The method is rebuilt from the section recorded in the file for ``model`` — a fresh module of the
    same architecture (MC dropout inserts its dropout layer into it again). Its optimizer is never used:
    the predictor only samples. Predictions equal those of the saved predictor bit for bit.
    ``train_loader`` is needed when the predictor recomputes BatchNorm statistics, as at saving.
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
    objective = Objective(model=model, num_data=num_data, **({"loss_fn": gaussian} if gaussian is not None else {}))
    posterior = config.build(objective, OptimConfig().build(steps_per_epoch=1, epochs=1))
    return BMA.load(path, model, posterior, train_loader, device=device)


def _check_model_argument(model: object) -> None:
    if not isinstance(model, nn.Module):
        raise FlatbmaTypeError(f"model must be a torch.nn.Module, got a {type(model).__name__}")


def _check_first_batch(model: nn.Module, loader: Iterable[Batch]) -> None:
    """The model and the data, checked on the loader's first batch before anything trains (:func:`fit_posterior`)."""
    batch = first_batch(loader)
    if batch is None:
        raise FlatbmaError("the training loader yields no batch")
    x, y = training_batch(batch)
    here = target_device(None, model)  # checked where the model is: a meta module cannot move
    classes = check_classifier(model, x[:2].to(here), name="the model")
    bad = (y < 0) | (y >= classes)
    if bool(bad.any()):
        raise FlatbmaError(
            f"label {int(y[bad][0])} is out of range: the model returns {classes} logits per example, so labels "
            f"must be class indices in [0, {classes})"
        )


def _likelihood(name: object, noise_std: object) -> Gaussian | None:
    """``None`` for ``categorical``; the :class:`~flatbma.regression.Gaussian` of ``gaussian`` with ``noise_std``."""
    if name == "categorical":
        if noise_std is not None:
            raise FlatbmaError("noise_std is the Gaussian likelihood's: give it with likelihood='gaussian'")
        return None
    if name == "gaussian":
        return Gaussian(noise_std=noise_std)  # type: ignore[arg-type]
    raise FlatbmaError(f"likelihood must be 'categorical' (a classifier) or 'gaussian' (regression), got {shown(name)}")


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
    """``(steps per epoch, number of training examples)`` of ``loader``."""
    dataset = getattr(loader, "dataset", None)
    try:
        steps, num_data = len(loader), len(dataset)  # type: ignore[arg-type]
    except TypeError:
        raise FlatbmaError(
            f"loader must be a DataLoader over a dataset of known size (its length sets the schedule and the "
            f"number of examples), got a {type(loader).__name__}"
        ) from None
    if steps == 0 or num_data == 0:
        raise FlatbmaError("the training loader is empty")
    return steps, num_data
