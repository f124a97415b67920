"""Training health: whether a finished run fitted its training data, flagged without stopping the run.

A run can end with finite numbers and still have failed (a step size or KL radius too large). It keeps its
checkpoint and metrics but is flagged by these rules (their reasons and examples: docs/reliability.md):

* **loss rise**: the last epoch's mean training loss exceeds :data:`LOSS_RISE` times the first epoch's. Needs two
  epochs.
* **at chance on the training data**: the BMA's accuracy on up to :data:`HEALTH_EXAMPLES` un-augmented training
  images is at most the chance level ``p`` (the share of their most frequent class) plus ``2·sqrt(p(1 − p)/n)``.
* **worse than its mean**: the BMA's NLL exceeds both ``r · NLL_ref`` and ``NLL_ref + s · log C``
  (:data:`MEAN_WORSE`), ``ref`` being the one network the posterior holds, evaluated as a point estimate
  (:func:`flatbma.predictor.reference_point`). On the validation split when there is one (and beyond
  :data:`NOISE_Z` standard errors of the per-example differences), else on the chance rule's training images.
  The fit is fine; the posterior is too wide. :func:`flatbma.fit_posterior` applies the same rule
  (:func:`worse_than_mean`) and words (:func:`too_wide_line`).

A regression run (a Gaussian likelihood: no classes) replaces ``at_chance`` and ``worse_than_mean`` with:

* **no better than the mean predictor** (``at_mean_predictor``): the BMA's RMSE on the validation split (else on
  up to :data:`HEALTH_EXAMPLES` training examples) is at least their targets' standard deviation: ``R² ≤ 0``
  (their own mean knows it in advance, so the rule errs towards not flagging).
* **learned nothing** (``learned_nothing``): the last epoch's training RMSE, over the same examples each epoch, is
  within :data:`NO_PROGRESS` of the first's, as when weights do not move. Not compared for one epoch, or from
  fitted weights (``prior.init``, ``model.pretrained``).
* **RMSE blow-up** (``rmse_blowup``): the test RMSE exceeds :data:`RMSE_BLOWUP` times the targets' standard
  deviation (a Gaussian target lies within 3σ of its mean but for 0.3% of the time).

:func:`assess` gives the ``health`` entry of ``metrics.json`` and a compare row; ``warn_if_flagged`` is its one
line; :func:`flagged_text` the reports' and findings' wording.
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
"""By the data compared on: ``(r, s)`` of the rule ``worse_than_mean`` (module docstring; ``log C``: a uniform NLL)."""

NOISE_Z = 2.0
"""On validation data the BMA's NLL must also exceed its reference's by this many standard errors of the mean of
their per-example differences (``nll_diff_se``): about 2% one-sided by the draw of the examples alone."""

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
        fired, ``ok`` is whether none did; an unmeasured value is ``None`` (``against_mean`` too for a method
        without a mean, whose ``rules`` then leave that rule out).
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
    (:func:`flatbma.experiment.run.evaluate.against_mean`'s); other data or an unmeasured value never fires.
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

    The ``advice`` (:meth:`~flatbma.methods.MethodConfig.advice`) comes first: the command line cuts a warning at
    300 characters.
    """
    return f"{subject} has a posterior too wide for its {_reference(compared)} (try {advice}): {_worse_text(compared)}"


def _worse_text(c: Mapping[str, Any]) -> str:
    examples = f"{c['examples']} {'validation examples' if c['data'] == 'validation' else 'training images'}"
    return (
        f"its BMA is worse than its {_reference(c)} on {examples} (NLL {c['bma_nll']:.3f} vs {c['mean_nll']:.3f}, "
        f"accuracy {c['bma_accuracy']:.3f} vs {c['mean_accuracy']:.3f})"
    )


def is_flagged(health: Any) -> bool:
    """Whether a ``health`` entry (possibly missing) flags its run."""
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
    """Warn (:class:`HealthWarning`, one line) when ``health`` flags the run at ``where``.

    ``advice``: what to change when only ``worse_than_mean`` fired (:meth:`~flatbma.methods.MethodConfig.advice`).
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
