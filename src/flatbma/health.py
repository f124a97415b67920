"""Training health: whether a finished run fitted its training data, flagged without stopping the run.

A run can end with finite numbers and still have failed: its loss climbed for the whole run (a step
size or KL radius too large for the posterior, e.g. FP-BMA with ``gamma: 100``), or its BMA predicts
no better than chance on the very images it trained on. Such a run is not stopped — its checkpoint and
metrics are kept — but it is flagged, by three rules:

* **loss rise**: the last epoch's mean training loss is more than :data:`LOSS_RISE` times the first
  epoch's. The first epoch's mean already holds the highest losses of a run (those at its
  initialization: ``log C`` for a fresh head), and an epoch mean moves with mini-batch noise by a few
  per cent, not by a factor of two; a healthy run ends below its first epoch (a cosine schedule ends
  with a step size near 0). Twice the first epoch is therefore far outside noise: the optimizer moved
  away from the data. Runs of one epoch have nothing to compare.
* **at chance on the training data**: the BMA's accuracy on up to :data:`HEALTH_EXAMPLES` un-augmented
  training images is at most the chance level — the share of the most frequent class among them,
  what always predicting that class scores — plus two standard errors of an accuracy at that level,
  ``2·sqrt(p(1 − p)/n)``. A BMA that cannot beat that on the data it was fitted to has learned nothing.
* **worse than its mean**: the BMA's NLL exceeds both ``r · NLL_ref`` and ``NLL_ref + s · log C`` (``log C``, the NLL
  of a uniform guess over ``C`` classes), :data:`MEAN_WORSE`, where ``ref`` is the one network the posterior holds
  (:func:`flatbma.predictor.reference_point`): its mean (:attr:`flatbma.types.Posterior.mean`: Laplace's MAP, SWAG's
  SWA mean, VI's ``μ``, MC dropout's deterministic network, a point estimate itself); for a mixture of independently
  trained members (ensembles, ``multi``), whose average of weights lies in none of their basins, its member 0 (what
  :meth:`flatbma.BMA.load_into` writes: a mixture worse than one of its members averages in worse ones); for SG-MCMC,
  which has no closed-form mean, the average of its kept iterates — each evaluated as a point estimate with recomputed
  BatchNorm statistics. On the validation split when the run has one (``r = 1.01``, ``s = 0.0005``: worse beyond
  rounding, the BMA's own purpose being held-out predictions, and by more than :data:`NOISE_Z` standard errors of the
  per-example differences: without it, MultiSWAG on 200 held-out digits images came out worse than its member 0, 0.062
  against 0.051, and was flagged, while 10% better on the test set; with it, not), otherwise on the training images of
  the chance rule (``r = 2``, ``s = 0.2``): a MAP was fitted to them, so its training NLL can be tiny and a sound
  posterior several times worse there — the margin in units of ``log C`` keeps such runs unflagged (a last-layer
  Laplace with the evidence's δ on digits' small CNN: BMA NLL 0.064 against its MAP's 0.018 on training images; MC
  dropout 0.053 against 0.025), while a posterior that undoes its MAP (all weights, KFAC, the evidence's δ on the same
  CNN: 0.76 against 0.018) is far beyond it. On validation data the same last-layer Laplace (0.13 against 0.063) is
  flagged when that difference exceeds its noise: its BMA predicts held-out data worse than its MAP. The run's fit is
  fine; its posterior is too wide. :func:`flatbma.fit_posterior` applies the same rule (:func:`worse_than_mean`) to
  its ``val_loader``, or to the training data without one, and warns in the same words (:func:`too_wide_line`), with
  advice from the method's own settings (the family's :attr:`~flatbma.family.Family.advice`).

A regression run (a Gaussian likelihood: no classes, no chance level) has three rules of its own instead of
the classifier's ``at_chance`` and ``worse_than_mean``:

* **no better than the mean predictor** (``at_mean_predictor``): the BMA's root mean squared error on the
  validation split, or without one on up to :data:`HEALTH_EXAMPLES` un-augmented training examples, is at
  least the standard deviation of their targets — the error of always predicting their mean (their own
  mean: a predictor that knew it in advance, so the rule errs towards not flagging). That is ``R² ≤ 0``: the
  network explains none of the targets' variance, on data it was fitted to or drawn like it.
* **learned nothing** (``learned_nothing``): its last epoch's training RMSE is within :data:`NO_PROGRESS` (1 %)
  of its first epoch's. An epoch's RMSE is over the same examples every epoch, so a network whose weights do
  not move keeps it to the digit (``lr = 1e-9`` on diabetes: 0.991 at every epoch, a training ``R²`` of 0.018
  from its initialization alone); the first epoch already averages the errors at the start, and a network that
  fits anything lowers the last by far more (0.954 → 0.621 at the shipped ``lr = 0.01``; 0.95 → 0.93 in two
  epochs of the tests' 8-unit MLP). Runs of one epoch have nothing to compare, and runs started from fitted
  weights (a two-stage run's prior with ``prior.init``, ``model.pretrained``) may rightly barely move: not
  compared.
* **RMSE blow-up** (``rmse_blowup``): the test RMSE is more than :data:`RMSE_BLOWUP` times the targets'
  standard deviation. Predicting their mean scores about that deviation on data like them, and a Gaussian
  target lies within three of them of its mean but for 0.3 % of the time: a predictive whose typical error is
  beyond that (test RMSE 31.6 with Adam at ``lr = 1``, 67.6 with SWAG's ``scale: 1000``, on standardized
  targets) is broken, whatever its training loss did.

:func:`assess` puts the rules together into the ``health`` entry of ``metrics.json`` and of a compare
row; :func:`warning` is its one line; :func:`flagged_text` the reports' and findings' wording.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from flatbma.errors import FlatbmaWarning

__all__ = [
    "HEALTH_EXAMPLES",
    "LOSS_RISE",
    "MARK",
    "MEAN_WORSE",
    "HealthWarning",
    "assess",
    "flagged_line",
    "flagged_text",
    "is_flagged",
    "too_wide_line",
    "warn_if_flagged",
    "worse_than_mean",
]

RMSE_BLOWUP = 3.0
"""A regression run whose test RMSE exceeds this multiple of its targets' standard deviation is flagged."""

NO_PROGRESS = 0.01
"""A regression run whose last epoch's training RMSE is within this fraction of its first epoch's learned nothing."""

LOSS_RISE = 2.0
"""A run whose last epoch's mean training loss exceeds this multiple of its first epoch's is flagged."""

HEALTH_EXAMPLES = 1000
"""Training images the BMA is scored on for the chance rule (the first ones of the fixed statistics order)."""

MEAN_WORSE = {"validation": (1.01, 0.0005), "training": (2.0, 0.2)}
"""By the data compared on: ``(r, s)`` of the rule ``worse_than_mean`` (module docstring)."""

NOISE_Z = 2.0
"""On validation data the BMA's NLL must also exceed its reference's by this many standard errors of the mean of
their per-example differences (``nll_diff_se``): a difference the draw of the validation examples alone would
make about 2% of the time (one-sided)."""
"""By the data compared on: ``(r, s)`` of the rule ``worse_than_mean``, which fires when the BMA's NLL exceeds both
``r · NLL_mean`` and ``NLL_mean + s · log C`` (``log C``: the NLL of a uniform guess over ``C`` classes)."""

MARK = "⚠"
"""The mark of a method with a flagged run in compare's tables and findings."""

LOSS_RULE = f"last epoch's training loss > {LOSS_RISE:g} x the first epoch's"
CHANCE_RULE = "BMA accuracy on training images <= majority-class rate + 2 standard errors"
REGRESSION_RULES = {
    "at_mean_predictor": "BMA RMSE on validation (or training) examples >= their targets' standard deviation",
    "learned_nothing": f"last epoch's training RMSE within {NO_PROGRESS:.0%} of the first epoch's",
    "rmse_blowup": f"test RMSE > {RMSE_BLOWUP:g} x the targets' standard deviation",
}
MEAN_RULE = (
    "BMA NLL > {:g} x its reference network's (its mean, a mixture's member 0, a chain's average) and > its + {:g} "
    "log C on the validation split; > {:g} x and "
    "+ {:g} log C on training images (a run without one)".format(*MEAN_WORSE["validation"], *MEAN_WORSE["training"])
)


class HealthWarning(FlatbmaWarning):
    """A finished run is flagged by a training-health rule (module docstring)."""


def assess(history: Sequence[Mapping[str, Any]] | None, fit: Mapping[str, Any] | None) -> dict[str, Any]:
    """The ``health`` entry of a run from its per-epoch ``history`` and its BMA's training ``fit``.

    Args:
        history: the run's epochs (``{"loss": ...}`` each, as in ``metrics.json``), or ``None``.
        fit: ``{"train_bma_accuracy", "train_bma_nll", "train_examples", "chance_accuracy", "against_mean"}`` of
            :func:`flatbma.experiment.run.evaluate.training_fit`, or ``None`` (not measured).

    Returns:
        ``{"ok", "flags", "rules", "first_loss", "last_loss", "loss_ratio", "train_bma_accuracy",
        "train_examples", "chance_accuracy", "train_bma_nll", "against_mean"}``: ``flags`` lists the rules that
        fired (``"loss_rise"``, ``"at_chance"``, ``"worse_than_mean"``), ``ok`` is whether none did; a value that
        was not measured is ``None`` (``against_mean`` too for a method without a mean, whose ``rules`` then
        leave that rule out).
    """
    out: dict[str, Any] = {"ok": True, "flags": [], "rules": {"loss_rise": LOSS_RULE, "at_chance": CHANCE_RULE}}
    losses = [h.get("loss") for h in history or [] if isinstance(h, Mapping)]
    first, last = (losses[0], losses[-1]) if len(losses) >= 2 else (None, None)
    ratio = last / first if _positive(first) and _finite(last) else None
    out.update(first_loss=first, last_loss=last, loss_ratio=ratio)
    if ratio is not None and ratio > LOSS_RISE:
        out["flags"].append("loss_rise")
    fit = fit or {}
    accuracy, n, chance = (fit.get(k) for k in ("train_bma_accuracy", "train_examples", "chance_accuracy"))
    out.update(train_bma_accuracy=accuracy, train_examples=n, chance_accuracy=chance)
    if _finite(accuracy) and _finite(chance) and isinstance(n, int) and n > 0:
        if accuracy <= chance + 2 * math.sqrt(chance * (1 - chance) / n):
            out["flags"].append("at_chance")
    out["train_bma_nll"] = fit.get("train_bma_nll")
    out["regression"] = regression = fit.get("regression")
    if isinstance(regression, Mapping):
        out["rules"] = {"loss_rise": LOSS_RULE, **REGRESSION_RULES}
        errors = [h.get("rmse") for h in history or [] if isinstance(h, Mapping)]
        out["first_rmse"], out["last_rmse"] = (errors[0], errors[-1]) if len(errors) >= 2 else (None, None)
        out["flags"] += _regression_flags(regression, history or [])
    out["against_mean"] = compared = fit.get("against_mean")
    if isinstance(compared, Mapping) and compared.get("data") in MEAN_WORSE:
        out["rules"]["worse_than_mean"] = MEAN_RULE
        if worse_than_mean(compared):
            out["flags"].append("worse_than_mean")
    out["ok"] = not out["flags"]
    return out


def _regression_flags(fit: Mapping[str, Any], history: Sequence[Any]) -> list[str]:
    """The regression rules (module docstring) firing on ``fit`` (:func:`.evaluate.regression_fit`'s), ``history``."""
    rmse, std, test = (fit.get(k) for k in ("rmse", "target_std", "test_rmse"))
    flags = []
    if _finite(rmse) and _positive(std) and rmse >= std:
        flags.append("at_mean_predictor")
    errors = [h.get("rmse") for h in history if isinstance(h, Mapping)]
    if len(errors) >= 2 and _positive(errors[0]) and _finite(errors[-1]) and not fit.get("fitted_start"):
        if abs(errors[-1] - errors[0]) <= NO_PROGRESS * errors[0]:
            flags.append("learned_nothing")
    if _positive(std) and isinstance(test, int | float) and not test <= RMSE_BLOWUP * std:  # NaN: blown up too
        flags.append("rmse_blowup")
    return flags


def worse_than_mean(compared: Mapping[str, Any]) -> bool:
    """The rule ``worse_than_mean`` on one comparison (module docstring): BMA NLL > ``r·ref`` and > ``ref + s·log C``.

    ``compared``: ``{"data": "validation" | "training", "bma_nll", "mean_nll", "num_classes", ...}``
    (:func:`flatbma.experiment.run.evaluate.against_mean`, or :func:`flatbma.fit_posterior`'s); other data, or a
    value not measured, never fires.
    """
    if compared.get("data") not in MEAN_WORSE:
        return False
    ratio, share = MEAN_WORSE[compared["data"]]
    ours, theirs, classes = (compared.get(k) for k in ("bma_nll", "mean_nll", "num_classes"))
    if not (_finite(ours) and _finite(theirs) and isinstance(classes, int) and classes > 1):
        return False
    se = compared.get("nll_diff_se")  # paired examples (validation): beyond what their draw alone moves
    beyond_noise = not _finite(se) or ours - theirs > NOISE_Z * se
    return ours > ratio * theirs and ours > theirs + share * math.log(classes) and beyond_noise


REFERENCES = {"mean": "posterior mean", "member 0": "member 0", "sample average": "samples' average"}
"""How the warnings name the network the BMA is compared with (:func:`flatbma.predictor.reference_point`)."""


def _reference(compared: Mapping[str, Any]) -> str:
    return REFERENCES.get(str(compared.get("reference", "mean")), "posterior mean")


def too_wide_line(subject: str, compared: Mapping[str, Any], advice: str) -> str:
    """The one line of a BMA worse than its reference network: ``"<subject> has a posterior too wide for its …"``.

    The advice first (the command line cuts a warning at 300 characters): what to change, from the method's own
    settings (:meth:`~flatbma.methods.MethodConfig.advice`).
    """
    return f"{subject} has a posterior too wide for its {_reference(compared)} (try {advice}): {_worse_text(compared)}"


def _worse_text(c: Mapping[str, Any]) -> str:
    examples = f"{c['examples']} {'validation examples' if c['data'] == 'validation' else 'training images'}"
    return (
        f"its BMA is worse than its {_reference(c)} on {examples} (NLL {c['bma_nll']:.3f} vs {c['mean_nll']:.3f}, "
        f"accuracy {c['bma_accuracy']:.3f} vs {c['mean_accuracy']:.3f})"
    )


def is_flagged(health: Any) -> bool:
    """Whether a ``health`` entry (possibly missing: rows of older versions) flags its run."""
    return isinstance(health, Mapping) and health.get("ok") is False


def flagged_text(health: Mapping[str, Any]) -> str:
    """What the rules of a flagged ``health`` entry found, e.g. ``"training loss rose from 2.5 to 25 (10×)"``."""
    found = []
    if "loss_rise" in health.get("flags", ()):
        found.append(
            f"training loss rose from {health['first_loss']:.3g} (epoch 1) to {health['last_loss']:.3g} (last "
            f"epoch), {health['loss_ratio']:.1f}x"
        )
    if "at_chance" in health.get("flags", ()):
        found.append(
            f"its BMA is at chance on its training data (accuracy {health['train_bma_accuracy']:.3f} on "
            f"{health['train_examples']} images, chance {health['chance_accuracy']:.3f})"
        )
    regression = health.get("regression") or {}
    if "at_mean_predictor" in health.get("flags", ()):
        found.append(
            f"its BMA is no better than predicting the mean (RMSE {regression['rmse']:.3g} on {regression['examples']} "
            f"{regression['data']} examples, {regression['target_std']:.3g} by their mean)"
        )
    if "learned_nothing" in health.get("flags", ()):
        found.append(f"it learned nothing (training RMSE {_first_last(health)})")
    if "rmse_blowup" in health.get("flags", ()):
        found.append(
            f"its test RMSE {regression['test_rmse']:.3g} is over {RMSE_BLOWUP:g}x its targets' spread "
            f"({regression['target_std']:.3g})"
        )
    if "worse_than_mean" in health.get("flags", ()):
        found.append(_worse_text(health["against_mean"]))
    return "; ".join(found)


def _first_last(health: Mapping[str, Any]) -> str:
    """``"0.991 at epoch 1, 0.991 at the last"``: a regression run's training RMSE recorded in ``health``."""
    first, last = health.get("first_rmse"), health.get("last_rmse")
    return f"{first:.3g} at epoch 1, {last:.3g} at the last" if _finite(first) and _finite(last) else "unchanged"


def _collapsed(health: Mapping[str, Any]) -> bool:
    """Whether a rule of a failed fit fired (``loss_rise``, ``at_chance``), not only ``worse_than_mean``."""
    return any(flag != "worse_than_mean" for flag in health.get("flags", ()))


def flagged_line(method: str, run: Mapping[str, Any]) -> str:
    """The line of a flagged compare row in the report's tables and findings: ``"⚠ fp-bma seed 0: ..."``."""
    health = run["health"]
    wide = f"a posterior too wide for its {_reference(health.get('against_mean') or {})}"
    failed = "a failed fit" if _collapsed(health) else wide
    return f"{MARK} {method} seed {run.get('seed')}: {flagged_text(health)}; its numbers describe {failed}"


def warn_if_flagged(health: Mapping[str, Any], where: str, advice: str) -> None:
    """Warn (:class:`HealthWarning`, one line on the command line) when ``health`` flags the run at ``where``.

    ``advice``: what to change when only ``worse_than_mean`` fired, from the method's own settings
    (:meth:`~flatbma.methods.MethodConfig.advice`; :func:`too_wide_line`).
    """
    if not is_flagged(health):
        return
    if _collapsed(health):
        flags = set(health.get("flags", ()))
        fix = (
            "check optim.lr (too low learns nothing) and train.epochs"
            if flags <= {"at_mean_predictor", "learned_nothing"}
            else "lower the learning rate (or the method's step, e.g. gamma) and train again"
        )
        text = f"{where} looks collapsed: {flagged_text(health)}; its numbers describe a failed fit: {fix}"
    else:
        text = too_wide_line(where, health["against_mean"], advice)
    warnings.warn(text, HealthWarning, stacklevel=2)


def _finite(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def _positive(x: Any) -> bool:
    return _finite(x) and x > 0
