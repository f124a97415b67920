"""Every number a run reports by name, in one table: its key, how it reads, which end is better, its range.

A metric is computed where its maths lives (:mod:`flatbma.metrics`, :mod:`flatbma.regression`, :mod:`flatbma.flatness`);
this table is the one place its name is spelled for what reads the results (:func:`test_keys`, :data:`SUMMARY`,
the comparison's tables, findings and figures). A new metric is its computation and one row here.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

__all__ = ["NAMES", "SUMMARY", "Group", "Name", "name", "test_keys"]


class Group(str, Enum):
    """Which runs report a metric: a classifier's test metrics, a regression's, the flatness protocol's, others."""

    CLASSIFIER = "classifier"
    REGRESSION = "regression"
    FLATNESS = "flatness"
    OTHER = "other"


UNIT = (0.0, 1.0)
"""The range of a probability, an accuracy or a calibration error."""
NONNEGATIVE = (0.0, None)


@dataclass(frozen=True)
class Name:
    """A reported number.

    Attributes:
        key: its key in ``metrics.json`` and the comparison's results.
        label: its column header.
        group: which runs report it (:class:`Group`).
        lower: what a significantly lower value means ("better", "worse", "flatter", "narrower"); ``""``: not
            compared.
        higher: what a significantly higher value means.
        bounds: ``(low, high)``: the range its definition confines it to (``None``: unbounded).
        reads: how to read a difference when neither end is better (a coverage, best at its level).
        summary: whether ``flatbma train`` prints it on its last line.
    """

    key: str
    label: str
    group: Group
    lower: str = ""
    higher: str = ""
    bounds: tuple[float | None, float | None] = (None, None)
    reads: str = ""
    summary: bool = False


def _lower_better(key: str, label: str, group: Group, bounds: tuple[float | None, float | None], **kw: object) -> Name:
    return Name(key, label, group, lower="better", higher="worse", bounds=bounds, **kw)  # type: ignore[arg-type]


_C, _R, _F, _O = Group.CLASSIFIER, Group.REGRESSION, Group.FLATNESS, Group.OTHER

NAMES: tuple[Name, ...] = (
    Name("accuracy", "accuracy", _C, lower="worse", higher="better", bounds=UNIT, summary=True),
    _lower_better("nll", "NLL", _C, NONNEGATIVE, summary=True),
    _lower_better("ece", "ECE", _C, UNIT, summary=True),
    _lower_better("aece", "AECE", _C, UNIT, summary=True),
    _lower_better("brier", "Brier", _C, (0.0, 2.0), summary=True),
    Name("lambda1", "λ₁ median", _F, lower="flatter", higher="sharper", summary=True),
    Name("lambda1_mean", "λ₁ mean", _F),
    Name("trace_cov", "tr Σ", _F, lower="narrower", higher="wider", bounds=NONNEGATIVE),
    Name("lambda1_over_lambda5", "λ₁/λ₅", _F, summary=True),
    Name("distribution_lambda1", "λ₁ of the mean Hessian", _O),
    Name("sam_sharpness", "SAM sharpness", _O, summary=True),
    Name("train_time_s", "train time (s)", _O, bounds=NONNEGATIVE),
    Name("eval_time_s", "eval time (s)", _O, bounds=NONNEGATIVE),
    _lower_better("nll", "NLL", _R, (None, None)),  # a density's: unbounded below
    _lower_better("rmse", "RMSE", _R, NONNEGATIVE, summary=True),
    _lower_better("mae", "MAE", _R, NONNEGATIVE, summary=True),
    *(
        Name(f"coverage_{a}", f"coverage {a}", _R, "covers less", "covers more", UNIT, "best at the level", a == "0.9")
        for a in ("0.5", "0.9", "0.95")
    ),
    _lower_better("calibration_error", "calibration error", _R, UNIT, summary=True),
)
"""Every reported number, by group: a classifier's test metrics (the BMA's on the clean test set), the flatness
protocol's (λ₁ is the median over the posterior's samples, robust to one sharp sample), other measurements, a
regression's test metrics (the mixture predictive's; a coverage is best at its level, so no end of it is better)."""

SUMMARY: tuple[str, ...] = tuple(dict.fromkeys(n.key for n in NAMES if n.summary))
"""The metrics ``flatbma train`` prints on its last line, in the table's order (those a run has)."""


def name(key: str, group: Group) -> Name:
    """The table's row of ``key`` in ``group``."""
    return next(n for n in NAMES if n.key == key and n.group is group)


def test_keys(group: Group) -> tuple[str, ...]:
    """The test metrics of a run of ``group`` (:attr:`Group.CLASSIFIER` or :attr:`Group.REGRESSION`), in order."""
    return tuple(n.key for n in NAMES if n.group is group)
