"""The BMA predictor: a trained posterior's predictive, with every detail of prediction owned by it.

Over 500 lines on purpose: :class:`BMA` owns every detail of prediction, for classifiers and regressors, as
methods of the one object that holds the samples (numerics in :mod:`flatbma.predict` and :mod:`flatbma.bn`).

:class:`BMA` turns ``(model, method, state)`` into ``log p(y|x) = logsumexp_m log_softmax(f(x; w_m)) − log M``
over ``M`` samples drawn once from a CPU generator seeded with ``seed``, their BatchNorm statistics recomputed
on the training data in a fixed order where the posterior needs it, in eval mode or the posterior's
:attr:`~flatbma.types.Posterior.predict_mode` (MC dropout's masks seeded by ``seed``; modes restored after).
Its numbers equal the manual path exactly: ``method.sample(state, M, torch.Generator().manual_seed(seed))``,
:func:`flatbma.bn.recompute_bn_statistics` per sample on ``statistics_loader(dataset, batch_size)``, then
:func:`flatbma.predict.evaluate` with ``mode=prediction_mode(method, seed)``.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call
from torch.utils.data import DataLoader, IterableDataset

from flatbma.bn import eval_mode, has_batchnorm, statistics_loader, with_recomputed_statistics
from flatbma.calibration import fit_temperature, scale
from flatbma.checks import check_device, check_seed, is_int, is_number, parse_choice
from flatbma.errors import FlatbmaError, FlatbmaTypeError
from flatbma.likelihood import Likelihood, kind
from flatbma.linearized import LinearizedPredictive, linearized_names, linearized_predictions
from flatbma.metrics import uncertainty_decomposition
from flatbma.models.contract import first_output, keep_logits
from flatbma.params import hold, load_into, model_buffers, trainable_params
from flatbma.precision import Precision, autocast
from flatbma.predict import Predictions, bma_log_probs, evaluate, labelled, paired_nll, predict, sample_log_probs
from flatbma.predictor_file import (
    LOGITS_FIRST,
    LOGITS_OUTPUT,
    PREDICTOR_FORMAT,
    architecture,
    architecture_problem,
    likelihood_of,
    read_file,
    write_file,
)
from flatbma.regression import Gaussian, mixture_metrics, sample_outputs
from flatbma.state_io import (
    structure_problem,
)
from flatbma.types import Params, Posterior, Predictive, State, prediction_mode, split_batch


def trained_names(model: nn.Module) -> list[str]:
    """Names of ``model``'s parameters with ``requires_grad`` (the trained, Bayesian ones)."""
    return [n for n, p in model.named_parameters() if p.requires_grad]


def posterior_mean(
    method: Posterior, state: State, samples: Sequence[Mapping[str, Tensor]], names: Iterable[str]
) -> Params:
    """The weights at the posterior mean ``E_q[w]``, in the form of a sample.

    :attr:`flatbma.types.Posterior.mean` when the method has it; otherwise the average of ``samples`` over the
    trained parameters ``names``, with the first sample's other tensors (buffers, not recomputed).
    """
    if method.mean is not None:
        return method.mean(state)
    mean = dict(samples[0])
    for name in names:
        mean[name] = torch.stack([w[name].detach() for w in samples]).mean(0)
    return mean


def member_weights(method: Posterior, state: State, m: int, seed: int) -> Params:
    """Member ``m``'s weights of a mixture (:attr:`~flatbma.types.Capabilities.members` ``> 0``), as a sample.

    An ensemble's member is its point, exactly; a mixture of posteriors (``multi``) gives member ``m``'s posterior
    mean, or for a family without one its sample from the generator seeded with ``seed``.

    Raises:
        FlatbmaError: a posterior without members, or ``m`` not one of them.
    """
    size = method.can.members
    if not size or method.can.split is None:
        raise FlatbmaError("member(m) is a mixture's (ensemble, multi): this posterior has no members; use mean()")
    if not is_int(m) or not 0 <= m < size:
        raise FlatbmaError(f"member must be an integer in [0, {size}) (the mixture's members), got {m!r}")
    own = method.can.split(state, [m])
    if method.mean is not None:
        return method.mean(own)
    # round-robin over the members: a draw of `size` gives each held member one sample
    return method.sample(own, size, torch.Generator(device="cpu").manual_seed(seed))[0]


def reference_point(
    method: Posterior, state: State, samples: Sequence[Mapping[str, Tensor]], names: Iterable[str], seed: int
) -> tuple[Params, str]:
    """The one network a BMA is compared with (the health rule ``worse_than_mean``), and its label.

    A mixture's member 0 (``"member 0"``); else the closed-form mean (``"mean"``); else the average of
    ``samples`` (``"sample average"``). Statistics as given.
    """
    if method.can.members:
        return member_weights(method, state, 0, seed), "member 0"
    if method.mean is not None:
        return method.mean(state), "mean"
    return posterior_mean(method, state, samples, names), "sample average"


def bma_predictions(
    method: Posterior,
    state: State,
    drawn: list[Params],
    names: Sequence[str],
    statistics: Callable[[list[Params]], list[Params]],
) -> Predictions:
    """What a BMA averages, by the method's :attr:`~flatbma.types.Capabilities.predictive`.

    ``samples`` averages ``statistics(drawn)``; ``glm`` and ``probit`` the network linearized at the posterior
    mean ``w̄`` with statistics recomputed once there (:func:`flatbma.linearized.linearized_predictions`:
    ``glm`` averages over ``Δ_m = w_m − w̄``, ``probit`` uses the functional variance at ``state``).

    ``drawn``: the samples as :meth:`~flatbma.types.Posterior.sample` drew them (the state's statistics);
    ``names``: the trained parameters; ``statistics``: maps samples to them with BatchNorm statistics recomputed.
    """
    if method.can.predictive is Predictive.SAMPLES:
        return statistics(drawn)
    mean = statistics([posterior_mean(method, state, drawn, names)])[0]
    fv = method.can.functional_variance
    over = linearized_names(method, state, names)  # last-layer Laplace: the classifier's weights
    variance = partial(fv, state) if fv is not None else None
    return linearized_predictions(method.can.predictive, mean, drawn, over, variance)


class BMA:
    """The Bayesian model average of a trained posterior, ready to predict.

    Args:
        model: the module the method was built for (its frozen parameters are used as they are).
        method: the trained :class:`~flatbma.types.Posterior` (a point estimate is a BMA of one sample).
        state: its trained state.
        train_loader: the training data (without augmentation), read only to recompute BatchNorm statistics: a
            DataLoader's dataset in :func:`flatbma.bn.statistics_loader`'s fixed order, another re-iterable as is.
        num_samples: ``M``, the number of posterior samples.
        seed: seed of the CPU generator the samples are drawn from.
        recompute_bn: recompute the samples' BatchNorm statistics: ``None`` when the posterior needs it
            (:attr:`~flatbma.types.Posterior.recompute_bn`), ``True`` always (as ``flatbma train``), ``False`` never.
        device: where the samples, inputs and module go (the module is moved); ``None``: the module's device.
        batched: how the samples are evaluated (:func:`flatbma.predict.sample_log_probs`).
        method_config: the method's config section (``name`` and options), saved for :func:`flatbma.load_posterior`.
        optim_config: the ``optim`` section the method trained with (the state holds its entries), saved.
        num_data: the training-set size the method was built with (``Objective.num_data``), saved.
        precision: ``fp32``, ``bf16`` or ``fp16`` autocast of the forward passes (:mod:`flatbma.precision`).
        likelihood: ``None`` for a classifier; a :class:`~flatbma.regression.Gaussian` for a regression network,
            whose predictive is the mixture ``(1/M) Σ_m N(y; μ_m, σ_m²)`` (the classifier's methods refuse).

    :func:`flatbma.fit_posterior` sets ``method_config``, ``optim_config``, ``num_data`` and ``likelihood``.
    The predictive is the method's :attr:`~flatbma.types.Capabilities.predictive`: the samples' average, or the
    network linearized at the posterior mean ``w̄`` (``glm``, ``probit``; statistics recomputed once at ``w̄``).

    Raises:
        FlatbmaError: invalid arguments, or statistics to recompute without ``train_loader``.
    """

    def __init__(
        self,
        model: nn.Module,
        method: Posterior,
        state: State,
        train_loader: Iterable[Any] | None = None,
        *,
        num_samples: int = 30,
        seed: int = 0,
        recompute_bn: bool | None = None,
        device: torch.device | str | None = None,
        batched: bool | None = None,
        method_config: Mapping[str, Any] | None = None,
        optim_config: Mapping[str, Any] | None = None,
        num_data: int | None = None,
        precision: Precision | str = Precision.FP32,
        likelihood: Gaussian | None = None,
    ) -> None:
        _check_arguments(model, method, state, num_samples, seed, recompute_bn)
        if TASKS[kind(likelihood)].samples_only and method.can.predictive is not Predictive.SAMPLES:
            raise FlatbmaError(
                f"a regression BMA averages the samples themselves, but this posterior predicts with "
                f"{method.can.predictive.value!r} (a linearized classifier's predictive)"
            )
        self.likelihood = likelihood
        self.precision = parse_choice(Precision, precision, "precision")
        self.model = model
        self.method = method
        self.num_samples = num_samples
        self.seed = seed
        self.batched = batched
        self.method_config = dict(method_config) if method_config is not None else None
        self.optim_config = dict(optim_config) if optim_config is not None else None
        self.num_data = num_data
        self.device = target_device(device, model)
        if device is not None:
            model.to(self.device)
        self.state = _state_on(state, self.device)
        wanted = method.recompute_bn if recompute_bn is None else recompute_bn
        self.recompute_bn = bool(wanted) and has_batchnorm(model)
        """Whether the samples' BatchNorm statistics are recomputed (resolved at construction)."""
        if self.recompute_bn and train_loader is None:
            raise FlatbmaError(
                "this posterior's samples need BatchNorm statistics of their own: pass train_loader= (the "
                "training data, without augmentation) or recompute_bn=False to keep the state's statistics"
            )
        self.train_loader = train_loader
        self._bn_loader = _fixed_order(train_loader) if self.recompute_bn else None
        self._samples: list[Params] | None = None
        self._linearized: LinearizedPredictive | None = None
        self._num_classes: int | None = None
        self._temperature = 1.0
        self._count: int | None = None
        self.loaded: str | None = None
        """What :meth:`load_into` last wrote into the predictor's module (``"the posterior mean"``, ``"member 0 of
        5"``), or ``None``."""
        self.history: list[dict[str, Any]] = []
        """The training log (:func:`flatbma.fit_posterior` fills it; else empty): ``flatbma train``'s ``log.csv``
        rows, one per epoch. Not saved by :meth:`save`."""
        self.selection: list[dict[str, Any]] = []
        """Options chosen on validation data (:func:`flatbma.fit_posterior` with an option ``val``, e.g. Laplace's
        ``prior_precision``): one row per candidate, ``{option: value, "val/nll": ...}``; empty otherwise."""
        hold(model, self._name())

    def _name(self) -> str:
        return str((self.method_config or {}).get("name", "posterior"))

    def __repr__(self) -> str:
        name = self._name()
        bn = "recomputed per sample" if self.recompute_bn else "the state's"
        tempered = f", temperature={self.temperature:.4g}" if self.temperature != 1.0 else ""
        count = f"num_samples={self.num_samples}"
        if self.method.can.members:  # a mixture: the samples its members give (an ensemble's members give one each)
            count = f"num_samples={self._sample_count()} over {self.method.can.members} members"
        loaded = f", module holds {self.loaded}" if self.loaded is not None else ""
        return f"BMA({name}, {count}, seed={self.seed}, bn={bn}, device={self.device}{tempered}{loaded})"

    def _sample_count(self) -> int:
        """How many samples the BMA averages: those drawn, or as many as the method gives for ``num_samples``."""
        if self._samples is not None:
            return len(self._samples)
        if self._count is None:
            with self._forward():
                self._count = len(self._drawn(self.num_samples))  # no statistics recomputed: only counted
        return self._count

    # ---------------------------------------------------------------- torch
    def __call__(self, x: Any) -> Tensor:
        """The BMA's probabilities ``[N, C]`` of ``x``: :meth:`predict_proba` (the mean over the fixed samples)."""
        return self.predict_proba(x)

    def as_module(self) -> BMAModule:
        """The predictor as an ``nn.Module`` whose ``forward(x)`` is :meth:`predict_log_proba` (:class:`BMAModule`)."""
        self._classifier("as_module")
        return BMAModule(self)

    def to(self, device: torch.device | str) -> BMA:
        """Move the predictor — its module, state, samples and later inputs — to ``device``, in place; return it.

        The samples drawn so far move as they are (statistics not recomputed).
        """
        device = check_device(device, "device", instead="cpu", kinds=_DEVICE_KINDS)
        if device == self.device:
            return self
        self.model.to(device)
        self.state = _state_on(self.state, device)
        if self._samples is not None:
            self._samples = [{k: v.to(device) for k, v in w.items()} for w in self._samples]
        self._linearized = None
        self.device = device
        return self

    # ---------------------------------------------------------------- calibration
    @property
    def temperature(self) -> float:
        """``T`` of the temperature-scaled predictive ``softmax(log p̄(y|x) / T)`` (1: none; :meth:`calibrate` fits it).

        It enters :meth:`predict_log_proba`, all that derives from it, and :meth:`evaluate`, not
        :meth:`predict_uncertainty`; :meth:`save` records it.
        """
        return self._temperature

    @temperature.setter
    def temperature(self, value: float) -> None:
        if not is_number(value) or not 0 < value < math.inf:
            raise FlatbmaError(f"temperature must be a positive number (1: none), got {value!r}")
        self._temperature = float(value)

    def calibrate(self, val_loader: Iterable[Any]) -> float:
        """Fit :attr:`temperature` on validation ``(x, y)`` batches (integer labels); return it.

        Temperature scaling (Guo et al. 2017): ``T`` minimizing the NLL of the untempered BMA log-probabilities
        (:func:`flatbma.calibration.fit_temperature`), as ``flatbma compare`` fits it. Never fit on the test data.

        Raises:
            FlatbmaError: a regression BMA, no validation batch, inputs without labels or soft targets.
        """
        self._classifier("calibrate")
        outs, labels = [], []
        with self._forward():
            mode = prediction_mode(self.method, self.seed)
            for log_probs, y in predict(
                self.model, self._predictions(), val_loader, device=self.device, mode=mode, batched=self.batched
            ):
                if y.is_floating_point():
                    raise FlatbmaError(
                        "calibrate fits the temperature to integer labels, but the validation batches hold soft "
                        "targets: give labelled (x, y) batches with class indices"
                    )
                outs.append(log_probs.cpu())
                labels.append(y.cpu())
        if not outs:
            raise FlatbmaError("the validation data is empty: the loader yields no batch")
        self.temperature = fit_temperature(torch.cat(outs), torch.cat(labels))
        return self.temperature

    # ---------------------------------------------------------------- samples
    @property
    def samples(self) -> list[Params]:
        """The ``M`` weight samples every prediction averages over (drawn at first use, then kept)."""
        if self._samples is None:
            self._samples = self._draw(self.num_samples)
        return self._samples

    def sample(self, n: int) -> list[Params]:
        """``n`` weight samples drawn with the predictor's seed, statistics as the predictor's.

        ``n = num_samples`` gives the predictor's own samples; other ``n`` draw anew from the same seed. Each is a
        fresh dict of parameters and buffers by module name (``functional_call`` ready), sharing its tensors.
        """
        if not is_int(n) or n < 1:
            raise FlatbmaError(f"the number of samples must be a positive integer, got {n!r}")
        drawn = self.samples if n == self.num_samples else self._draw(n)
        return [dict(w) for w in drawn]

    def mean(self) -> Params:
        """The weights at the posterior mean (:func:`posterior_mean`), statistics as the predictor's samples'."""
        samples = self.samples if self.method.mean is None else []  # a closed-form mean needs no samples
        mean = posterior_mean(self.method, self.state, samples, trained_names(self.model))
        with self._forward():
            return self._statistics([mean])[0]

    def member(self, m: int = 0) -> Params:
        """Member ``m``'s weights of a mixture, as a sample: :func:`member_weights`, statistics as the predictor's.

        Raises:
            FlatbmaError: a posterior without members, or ``m`` not one of its members.
        """
        try:
            weights = member_weights(self.method, self.state, m, self.seed)
        except FlatbmaError as e:
            raise FlatbmaError(str(e).replace("this posterior", f"this {self._name()} posterior")) from None
        with self._forward():
            return self._statistics([weights])[0]

    def paired_nll(self, data: Iterable[Any], point: Mapping[str, Tensor]) -> dict[str, float]:
        """The BMA and the point estimate ``point`` on the labelled batches of ``data``, example by example.

        :func:`flatbma.predict.paired_nll`; ``data`` is read once into a list (pass validation-sized data).
        """
        self._classifier("paired_nll")
        batches = [labelled(batch) for batch in data]
        with self._forward():
            return paired_nll(self.model, self._predictions(), point, batches, device=self.device, mode=self._mode())

    def reference(self) -> tuple[Params, str]:
        """The network the BMA is compared with, statistics as the samples': :func:`reference_point` and its label."""
        samples = self.samples if self.method.mean is None and not self.method.can.members else []
        weights, label = reference_point(self.method, self.state, samples, trained_names(self.model), self.seed)
        with self._forward():
            return self._statistics([weights])[0], label

    def load_into(self, model: nn.Module | None = None, *, member: int | None = None) -> nn.Module:
        """Write one network of the posterior into ``model`` (default: the predictor's module), in place; return it.

        A posterior with a mean in weight space gets :meth:`mean` with its BatchNorm statistics. A mixture (an
        ensemble, ``multi``) gets one member, :meth:`member` ``(member)`` (default 0): averaging weights across
        basins gives no network the mixture holds. :attr:`loaded` says which was written; the samples do not change.

        Raises:
            FlatbmaError: ``member`` for a posterior without members, or not one of its members.
        """
        if member is not None or self.method.can.members:
            weights = self.member(0 if member is None else member)
            what = f"member {0 if member is None else member} of {self.method.can.members}"
        else:
            weights, what = self.mean(), "the posterior mean"
        target = load_into(self.model if model is None else model, weights)
        if model is None or model is self.model:
            hold(self.model, self._name(), mean_loaded=True)  # flatness on it measures what was loaded
            self.loaded = what
        return target

    # ---------------------------------------------------------------- prediction
    def predict_log_proba(self, data: Any) -> Tensor:
        """BMA log-probabilities ``[N, C]`` of ``data``, on the predictor's device.

        ``data`` is one batch — ``x``, ``(x,)``, ``(x, y)``, ``{"x": ...}`` (:func:`flatbma.types.split_batch`) or a
        list ``[x, y]`` with integer labels — or an iterable of batches; labels are ignored. After
        :meth:`calibrate`, ``log softmax(log p̄ / T)``.
        """
        self._classifier("predict_log_proba")
        log_probs = torch.cat(self._per_batch(data, bma_log_probs))
        return log_probs if self.temperature == 1.0 else scale(log_probs, self.temperature)

    def predict_uncertainty(self, data: Any) -> dict[str, Tensor]:
        """Per-example total, aleatoric and epistemic uncertainty of the BMA (nats), ``[N]`` each.

        ``total = H[p̄(y|x)]``, ``aleatoric = E_w H[p(y|x, w)]``, ``epistemic = I(y; w | x)`` their difference
        (:func:`flatbma.metrics.uncertainty_decomposition`), untempered. Same ``data`` as
        :meth:`predict_log_proba`; float64 on the predictor's device.

        Raises:
            FlatbmaError: the probit predictive (deterministic: it has no per-sample predictives to split).
        """
        self._classifier("predict_uncertainty")
        if self.method.can.predictive is Predictive.PROBIT:
            raise FlatbmaError(
                "the probit predictive has no per-sample predictives, so its entropy cannot be split into "
                "aleatoric and epistemic parts: build the Laplace method with predictive: glm (or samples)"
            )

        def split(model: nn.Module, samples: Predictions, x: Tensor, *, batched: bool | None) -> dict[str, Tensor]:
            return uncertainty_decomposition(sample_log_probs(model, samples, x, batched=batched))

        parts = self._per_batch(data, torch.no_grad()(split))
        return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}

    def predict_entropy(self, data: Any) -> Tensor:
        """The predictive entropy ``H[p̄(y|x)]`` per example, ``[N]``: ``total`` of :meth:`predict_uncertainty`."""
        return self.predict_uncertainty(data)["total"]

    def mutual_information(self, data: Any) -> Tensor:
        """The epistemic part ``I(y; w | x)`` per example, ``[N]``: ``epistemic`` of :meth:`predict_uncertainty`."""
        return self.predict_uncertainty(data)["epistemic"]

    def predict_proba(self, data: Any) -> Tensor:
        """BMA probabilities ``[N, C]``: ``exp`` of :meth:`predict_log_proba` (same ``data``)."""
        return self.predict_log_proba(data).exp()

    def predict(self, data: Any) -> Tensor:
        """The most probable class under the BMA, ``[N]`` (same ``data`` as :meth:`predict_log_proba`).

        For a regression BMA (:attr:`likelihood`), the predictive mean ``μ̄`` (:meth:`predict_regression`).
        """
        return self._task.predict(self, data)

    def predict_regression(self, data: Any) -> dict[str, Tensor]:
        """The regression BMA's predictive per example (:mod:`flatbma.regression`), ``[N]`` each.

        ``mean`` ``μ̄ = (1/M) Σ_m μ_m``, ``std`` ``√(aleatoric + epistemic)``, ``aleatoric`` ``(1/M) Σ_m σ_m²`` and
        ``epistemic`` ``(1/M) Σ_m (μ_m − μ̄)²``. Same ``data`` as :meth:`predict_log_proba`.

        Raises:
            FlatbmaError: a classifier's BMA (no :attr:`likelihood`).
        """
        parts = self._per_batch(data, self._moments)
        mu, var = (torch.cat([p[i] for p in parts], dim=1) for i in (0, 1))
        mean = mu.mean(0)
        aleatoric, epistemic = var.mean(0), ((mu - mean) ** 2).mean(0)
        return {"mean": mean, "std": (aleatoric + epistemic).sqrt(), "aleatoric": aleatoric, "epistemic": epistemic}

    def evaluate(self, loader: Iterable[Any], *, num_classes: int | None = None, n_bins: int = 15) -> dict[str, float]:
        """Accuracy, NLL, ECE, adaptive ECE and Brier score of the BMA on ``(x, y)`` batches (labels or soft targets).

        The dict of :func:`flatbma.predict.evaluate`, temperature-scaled after :meth:`calibrate`; ``num_classes=None``
        reads it from the model's output on the first batch (read under a forked RNG: the loader is unchanged). A
        regression BMA gives :func:`flatbma.regression.mixture_metrics` instead.
        """
        return self._task.evaluate(self, loader, num_classes, n_bins)

    # ---------------------------------------------------------------- files
    def save(self, path: str | Path) -> None:
        """Write the state and the predictor's settings to ``path`` (safetensors, atomically, no pickle).

        :meth:`load` (or :func:`flatbma.load_posterior`) gives the same predictions, bit for bit. The file records
        the temperature, the architecture, and whether the module's logits are the first element of a tuple
        (:func:`flatbma.models.keep_logits`'s hook, reinstalled by :meth:`load`).
        """
        settings = {
            "format": PREDICTOR_FORMAT,
            "num_samples": self.num_samples,
            "seed": self.seed,
            "recompute_bn": self.recompute_bn,
            "method": self.method_config,
        }
        if self.optim_config is not None:
            settings["optim"] = self.optim_config
        if self.num_data is not None:
            settings["num_data"] = self.num_data
        if self.temperature != 1.0:
            settings["temperature"] = self.temperature
        settings.update(self._task.settings(self.likelihood))
        settings["logits"] = LOGITS_FIRST if first_output in self.model._forward_hooks.values() else LOGITS_OUTPUT
        settings["architecture"] = architecture(self.model)  # load refuses a same-shaped module of other layers
        write_file(path, self.state, settings)

    @classmethod
    def load(
        cls,
        path: str | Path,
        model: nn.Module,
        method: Posterior,
        train_loader: Iterable[Any] | None = None,
        *,
        device: torch.device | str | None = None,
        batched: bool | None = None,
        precision: Precision | str = Precision.FP32,
    ) -> BMA:
        """The predictor :meth:`save` wrote to ``path``, for ``model`` and ``method`` built as before.

        The state must have the structure ``method`` gives ``model``, and ``model`` the module tree the file
        records (:func:`flatbma.predictor_file.architecture`); the number of samples, the seed and ``recompute_bn``
        come from the file. ``model`` gets :func:`~flatbma.models.keep_logits`'s hook unless the file records
        logits as the output.
        """
        state, settings = read_file(path)
        state = _fitted(state, method, model, path, optimizer_recorded="optim" in settings)
        other = architecture_problem(settings["architecture"], model)
        if other is not None:
            raise FlatbmaError(
                f"{path} was saved from another architecture ({other}): load it into a module built as the fitted one"
            )
        if settings["logits"] == LOGITS_FIRST:
            keep_logits(model)
        bma = cls(
            model,
            method,
            state,
            train_loader,
            num_samples=settings["num_samples"],
            seed=settings["seed"],
            recompute_bn=settings["recompute_bn"],
            device=device,
            batched=batched,
            method_config=settings["method"],
            optim_config=settings.get("optim"),
            num_data=settings.get("num_data"),
            precision=precision,
            likelihood=likelihood_of(settings, path),
        )
        try:
            bma.temperature = settings.get("temperature", 1.0)
        except FlatbmaError:
            raise FlatbmaError(f"{path}: the predictor settings are damaged (temperature); save it again") from None
        return bma

    # ---------------------------------------------------------------- internals
    @property
    def _task(self) -> Task:
        """The row of :data:`TASKS` of this BMA's :attr:`likelihood`."""
        return TASKS[kind(self.likelihood)]

    def _classifier(self, what: str) -> None:
        if self._task.refuses_classifier:
            raise FlatbmaError(f"{what} is a classifier's, but {self._task.refuses_classifier}")

    def _moments(
        self, model: nn.Module, samples: Predictions, x: Tensor, *, batched: bool | None
    ) -> tuple[Tensor, Tensor]:
        """``(μ, σ²)`` ``[M, B]`` of every sample on the input batch ``x`` (a regression BMA's)."""
        if self._task.refuses_regression:
            raise FlatbmaError(f"predict_regression is a regression's, but {self._task.refuses_regression}")
        with torch.no_grad():
            return self.likelihood.moments(sample_outputs(model, samples, x))  # type: ignore[union-attr]

    def _evaluate_classes(self, loader: Iterable[Any], num_classes: int | None, n_bins: int) -> dict[str, float]:
        """:meth:`evaluate` of a classifier's BMA: :func:`flatbma.predict.evaluate` with the predictor's samples."""
        if num_classes is None:
            if isinstance(loader, Iterator):  # one-shot: read its first batch and put it back
                first = next(loader, None)
                loader = itertools.chain([first], loader) if first is not None else []
            else:
                with torch.random.fork_rng(devices=[]):
                    first = next(iter(loader), None)
            if first is None:
                raise FlatbmaError("the evaluation data is empty: the loader yields no batch")
            num_classes = self._output_classes(first)
        with self._forward():
            return evaluate(
                self.model,
                self._predictions(),
                loader,
                num_classes=num_classes,
                n_bins=n_bins,
                device=self.device,
                mode=prediction_mode(self.method, self.seed),
                batched=self.batched,
                temperature=self.temperature,
            )

    def _regression_metrics(self, loader: Iterable[Any], *_: Any) -> dict[str, float]:
        """:func:`flatbma.regression.mixture_metrics` over the ``(x, y)`` batches of ``loader``."""
        xs, ys = [], []
        for batch in loader:
            x, y = labelled(batch)
            xs.append(x)
            ys.append(y)
        if not xs:
            raise FlatbmaError("the evaluation data is empty: the loader yields no batch")
        parts = self._per_batch(xs, self._moments)
        mu, var = (torch.cat([p[i] for p in parts], dim=1) for i in (0, 1))
        return mixture_metrics(mu, var, torch.cat(ys).to(mu.device))

    def _per_batch(self, data: Any, fn: Callable[..., Any]) -> list[Any]:
        """``fn(model, predictions, x, batched=...)`` for every input batch of ``data``, in the prediction mode."""
        outs: list[Any] = []
        with self._forward():
            samples = self._predictions()
            with self._mode()(self.model):  # entered once: MC dropout's masks run on over the batches
                for x in _inputs(data):
                    if not outs:
                        self._probe(x)  # eval mode within: draws no mask
                    outs.append(fn(self.model, samples, x.to(self.device), batched=self.batched))
        if not outs:
            raise FlatbmaError("there is nothing to predict: the data holds no batch")
        return outs

    def _draw(self, n: int) -> list[Params]:
        with self._forward():
            return self._statistics(self._drawn(n))

    def _drawn(self, n: int) -> list[Params]:
        """``n`` samples from the seeded generator, on the predictor's device, with the state's statistics."""
        drawn = self.method.sample(self.state, n, torch.Generator(device="cpu").manual_seed(self.seed))
        return [{k: v.to(self.device) for k, v in w.items()} for w in drawn] if self._moves(drawn) else drawn

    def _predictions(self) -> Predictions:
        """What prediction averages: the armed samples, or the linearized predictive (built once, then kept)."""
        if self.method.can.predictive is Predictive.SAMPLES:
            return self.samples
        if self._linearized is None:
            with self._forward():
                averaged = self.method.can.predictive is Predictive.GLM or self.method.mean is None
                drawn = self._drawn(self.num_samples) if averaged else []
                names = trained_names(self.model)
                linearized = bma_predictions(self.method, self.state, drawn, names, self._statistics)
                assert isinstance(linearized, LinearizedPredictive)
                self._linearized = linearized
        return self._linearized

    def _statistics(self, samples: list[Params]) -> list[Params]:
        """``samples`` on the predictor's device, their BatchNorm statistics recomputed where the predictor does."""
        samples = [{k: v.to(self.device) for k, v in w.items()} for w in samples]
        if not self.recompute_bn:
            return samples
        return with_recomputed_statistics(self.model, samples, self._bn_loader, device=self.device)

    def _forward(self) -> contextlib.AbstractContextManager[None]:
        """A block of forward passes under :attr:`precision`, after which torch's global generators are as before it.

        (CPU's and the predictor's GPU's: a DataLoader's iterator draws its base seed from them.)
        """
        cuda = self.device.type == "cuda"
        devices = [self.device.index if self.device.index is not None else torch.cuda.current_device()] if cuda else []
        stack = contextlib.ExitStack()
        stack.enter_context(torch.random.fork_rng(devices=devices))
        stack.enter_context(autocast(self.precision, self.device))
        return stack

    def _moves(self, samples: list[Params]) -> bool:
        return any(v.device != self.device for w in samples for v in w.values())

    def _mode(self) -> Callable[[nn.Module], contextlib.AbstractContextManager[Any]]:
        return prediction_mode(self.method, self.seed) or eval_mode

    def _output_classes(self, batch: Any) -> int:
        """The number of classes: the width of the model's output on one example (:meth:`_probe`)."""
        if self._num_classes is None:
            x, _ = split_batch(batch)
            self._num_classes = int(self._probe(x).shape[-1])
        return self._num_classes

    def _probe(self, x: Tensor) -> Tensor:
        """The model's logits for the first example of ``x`` (eval mode, no randomness): inputs it can take.

        Raises:
            FlatbmaError: inputs that are not floating point (a :class:`~flatbma.errors.FlatbmaTypeError`),
                not of the weights' dtype, or on which the model fails (the wrong number of features).
        """
        if not x.is_floating_point():
            raise FlatbmaTypeError(
                f"inputs must be floating point like the training data, got {str(x.dtype).removeprefix('torch.')}: "
                "convert them (x.float())"
            )
        weights = self.samples[0] if self.method.can.predictive is Predictive.SAMPLES else self._predictions().mean
        dtypes = {v.dtype for v in weights.values() if v.is_floating_point()}
        if dtypes and x.dtype not in dtypes:
            found = " and ".join(sorted(str(d).removeprefix("torch.") for d in dtypes))
            raise FlatbmaError(
                f"inputs are {str(x.dtype).removeprefix('torch.')} but the model's weights are {found}: convert "
                "the inputs (x.float() for float32)"
            )
        try:
            with torch.no_grad(), eval_mode(self.model):
                return functional_call(self.model, weights, ((x[:1] if x.dim() > 1 else x).to(self.device),))
        except (RuntimeError, ValueError, IndexError, TypeError) as e:
            detail = str(e).strip().splitlines()[0][:120] if str(e).strip() else type(e).__name__
            raise FlatbmaError(
                f"the model fails on inputs of shape {list(x.shape)} ({detail}): give inputs shaped like the "
                "training data's"
            ) from None


class BMAModule(nn.Module):
    """A :class:`BMA` as an ``nn.Module`` (:meth:`BMA.as_module`): ``forward(x)`` gives its log-probabilities.

    Log-probabilities work as a classifier's logits (``softmax(log p̄) = p̄``): ``F.cross_entropy(module(x), y)``
    is the BMA's NLL, ``argmax`` its class.

    * no parameters or buffers, and no gradient flows (prediction runs under ``torch.no_grad``);
    * ``train()``/``eval()`` set the wrapper's flag only: the BMA always predicts in its own prediction mode;
    * ``.to(device)``, ``.cuda()``, ``.cpu()`` move the predictor (:meth:`BMA.to`); a dtype conversion is refused;
    * its ``state_dict`` is empty (save with :meth:`BMA.save`); no TorchScript.
    """

    def __init__(self, bma: BMA) -> None:
        super().__init__()
        self.__dict__["bma"] = bma  # not a submodule: the network's own parameters are not the BMA's

    def forward(self, x: Any) -> Tensor:
        """``log p̄(y|x)`` ``[N, C]`` of one batch or a loader of them (:meth:`BMA.predict_log_proba`)."""
        return self.bma.predict_log_proba(x)

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> BMAModule:
        probe = fn(torch.zeros((), device=self.bma.device))  # where .to/.cuda/.cpu/.half send a float32 tensor
        if probe.dtype != torch.float32:
            raise FlatbmaError(
                f"the BMA module cannot become {str(probe.dtype).removeprefix('torch.')}: its samples keep their "
                "dtype; move it with .to(device), or build the predictor with precision='bf16' for autocast"
            )
        self.bma.to(probe.device)
        return self

    def extra_repr(self) -> str:
        """The predictor's repr, shown in the module's."""
        return repr(self.bma)


@dataclass(frozen=True)
class Task:
    """What a BMA does where a classifier's and a regression's differ (a row of :data:`TASKS`).

    ``predict``, ``evaluate``: :meth:`BMA.predict`'s and :meth:`BMA.evaluate`'s work; ``settings(likelihood)``: what
    :meth:`BMA.save` records of the likelihood; ``samples_only``: the predictive averages the samples themselves (a
    linearized one cannot serve it); ``refuses_classifier``, ``refuses_regression``: why a classifier's method
    (``predict_log_proba``, ``calibrate``, ...) or ``predict_regression`` is refused, or ``""``.
    """

    predict: Callable[[BMA, Any], Tensor]
    evaluate: Callable[[BMA, Iterable[Any], int | None, int], dict[str, float]]
    settings: Callable[[Gaussian | None], dict[str, Any]]
    samples_only: bool
    refuses_classifier: str
    refuses_regression: str


TASKS: dict[Likelihood, Task] = {
    Likelihood.CATEGORICAL: Task(
        predict=lambda bma, data: bma.predict_log_proba(data).argmax(-1),
        evaluate=BMA._evaluate_classes,
        settings=lambda likelihood: {},
        samples_only=False,
        refuses_classifier="",
        refuses_regression="this BMA is a classifier's: build it with likelihood=flatbma.regression.Gaussian(...) "
        "(fit_posterior(..., likelihood='gaussian'))",
    ),
    Likelihood.GAUSSIAN: Task(
        predict=lambda bma, data: bma.predict_regression(data)["mean"],
        evaluate=BMA._regression_metrics,
        settings=lambda likelihood: {"likelihood": {"name": "gaussian", "noise_std": likelihood.noise_std}},  # type: ignore[union-attr]
        samples_only=True,
        refuses_classifier="this BMA is a regression's (a Gaussian likelihood): use predict_regression, predict "
        "(the predictive mean) or evaluate",
        refuses_regression="",
    ),
}
"""The predictor's rows of the likelihood dispatch (:mod:`flatbma.likelihood`), one per :class:`Likelihood`."""


def _fitted(
    state: State, method: Posterior, model: nn.Module, path: str | Path, *, optimizer_recorded: bool = True
) -> State:
    """``state``, which must have the structure ``method`` gives a fresh state of ``model`` (under a forked RNG).

    :func:`flatbma.state_io.structure_problem`'s rule; a refusal of a file without its ``optim`` section
    (``optimizer_recorded`` false) advises building the method with the optimizer it trained with.
    """
    with torch.random.fork_rng(devices=[]):
        reference = method.init(trainable_params(model), model_buffers(model))
    problem = structure_problem(state, reference)
    if problem:
        advice = (
            ""
            if optimizer_recorded
            else " (the file has not recorded its optimizer: build the method with the optimizer it was trained "
            "with, whose entries it holds, and use flatbma.BMA.load(path, model, method, train_loader))"
        )
        raise FlatbmaError(
            f"{path} does not fit this model and method ({problem}): load it with the architecture and method it "
            f"was saved with{advice}"
        )
    return state


def _check_arguments(
    model: object, method: object, state: object, num_samples: object, seed: object, recompute_bn: object
) -> None:
    if not isinstance(model, nn.Module):
        raise FlatbmaTypeError(f"model must be a torch.nn.Module, got a {type(model).__name__}")
    if not isinstance(method, Posterior):
        raise FlatbmaError(
            f"method must be a flatbma Posterior (a posterior family's build(...)), got a {type(method).__name__}"
        )
    if not isinstance(state, State):
        raise FlatbmaError(
            f"state must be the method's flatbma State (from init and fit), got a {type(state).__name__}"
        )
    if not is_int(num_samples) or num_samples < 1:
        raise FlatbmaError(f"num_samples must be a positive integer, got {num_samples!r}")
    check_seed(seed, "seed")
    if recompute_bn is not None and not isinstance(recompute_bn, bool):
        raise FlatbmaError(
            f"recompute_bn must be True, False or None (when the posterior needs it), got {recompute_bn!r}"
        )


def target_device(device: torch.device | str | None, model: nn.Module) -> torch.device:
    """``device`` as a usable ``torch.device``; ``None``: the module's first parameter's or buffer's (or the CPU)."""
    if device is None:
        first = next(itertools.chain(model.parameters(), model.buffers()), None)
        return first.device if first is not None else torch.device("cpu")
    return check_device(device, "device", instead="cpu (or device=None: the model's)", kinds=_DEVICE_KINDS)


_DEVICE_KINDS = ("cpu", "cuda", "mps", "meta")
"""Where a predictor may go: training's devices, and ``meta`` (shapes only, no data: a dry run)."""


def _state_on(state: State, device: torch.device) -> State:
    """``state`` with its tensors on ``device`` (the same object when they are there already)."""
    sections = (state.params, state.buffers, state.aux)
    if all(v.device == device for section in sections for v in section.values()):
        return state
    params, buffers, aux = ({k: v.to(device) for k, v in s.items()} for s in sections)
    return State(params=params, buffers=buffers, aux=aux, step=state.step)


def _fixed_order(loader: Iterable[Any]) -> Iterable[Any]:
    """The data of ``loader`` in a fixed order for BatchNorm statistics (:func:`flatbma.bn.statistics_loader`)."""
    if isinstance(loader, DataLoader):
        if loader.batch_size is not None and not isinstance(loader.dataset, IterableDataset):
            return statistics_loader(loader.dataset, loader.batch_size, collate_fn=loader.collate_fn)
        return loader
    if isinstance(loader, Iterator):
        raise FlatbmaError(
            "train_loader is read once per sample and must be re-iterable (a DataLoader or a list of batches), "
            f"got a one-shot {type(loader).__name__}"
        )
    return loader


def _inputs(data: Any) -> Iterator[Tensor]:
    """The input tensors of one batch or of an iterable of batches (see :meth:`BMA.predict_log_proba`)."""
    if isinstance(data, Tensor | tuple | Mapping) or _is_labelled_list(data):
        yield split_batch(data)[0]
        return
    if isinstance(data, str) or not isinstance(data, Iterable):
        raise FlatbmaError(
            f"cannot predict a {type(data).__name__}: give inputs x, a batch (x,), (x, y) or {{'x': ...}}, or a "
            "DataLoader"
        )
    for batch in data:
        yield split_batch(batch)[0]


def _is_labelled_list(data: Any) -> bool:
    """Whether ``data`` is a list ``[x]`` or ``[x, y]`` with integer labels ``y``: one batch, as DataLoaders yield."""
    if not isinstance(data, list) or not data or not isinstance(data[0], Tensor):
        return False
    if len(data) == 1:
        return True
    y = data[1] if len(data) == 2 else None
    return (
        isinstance(y, Tensor)
        and y.ndim == 1
        and not y.is_floating_point()
        and not y.is_complex()
        and data[0].ndim > 0
        and y.shape[0] == data[0].shape[0]
    )
