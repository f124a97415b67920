"""The time left of ``flatbma compare``, learned from the measured times of its rows and of their phases.

A row (a method and a seed) is training plus the evaluation's phases (BMA, corruptions, flatness, ...), each
timed by :meth:`flatbma.progress.Reporter.phase`. Their costs differ by orders of magnitude between methods (a
point estimate has one distinct sample), so a row's work is counted per phase in units its config gives
(:func:`row_work`), and :class:`TimeLeft` estimates

* a row of a method already timed: the mean time of that method's rows;
* any other row: ``Σ_phase units · rate(phase) + rest``, with ``rate(phase)`` the costliest time per unit
  that phase took in the rows so far and ``rest`` the costliest time a row spent outside its phases.

It is re-estimated after every row; a row that ran no timed phase was read whole from its cache and is not learned.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from flatbma.experiment.config.run_config import RunConfig
from flatbma.experiment.study.plan import CompareConfig
from flatbma.methods import point_methods

Work = Mapping[str, float]
"""A row's work by phase name (``train``, ``BMA``, ``corruptions``, ``flatness``, ...), in that phase's units."""


def row_work(cfg: RunConfig, compare: CompareConfig) -> dict[str, float]:
    """The work of the row of run ``cfg`` in a comparison: its phases and their units.

    ``train``: epochs (both stages of a two-stage run, the family's extra epochs); ``BMA`` and ``OOD``: the
    distinct samples (1 for a point estimate); ``corruptions``: corrupted sets × their samples; ``flatness``,
    ``repeatability`` and ``landscape``: the samples measured (1 for a point estimate); ``temperature``: 1.
    """
    point = cfg.method.name in point_methods()
    samples = 1 if point else cfg.eval.num_samples
    spectra = 1 if point else cfg.eval.flatness_samples
    work: dict[str, float] = {
        "train": cfg.epochs + (cfg.prior.epochs if cfg.prior is not None else 0),
        "BMA": samples,
        "temperature": 1,
        "OOD": samples,
    }
    if compare.corruptions:
        shifted = min(compare.corruption_samples or samples, samples)
        work["corruptions"] = len(compare.corruptions) * len(compare.severities) * shifted
    if compare.flatness:
        work["flatness"] = spectra
        if cfg.eval.repeatability:
            work["repeatability"] = spectra
    if compare.landscape:
        work["landscape"] = spectra
    return work


@dataclass
class TimeLeft:
    """What the rows measured so far say about the time the others will take (module docstring).

    Attributes:
        rows: the measured times of the rows, by kind (the method's label).
        rates: the costliest seconds per unit of work of each phase measured so far.
        rest: the costliest time a row spent outside its timed phases.
    """

    rows: dict[str, list[float]] = field(default_factory=dict)
    rates: dict[str, float] = field(default_factory=dict)
    rest: float = 0.0

    def add(self, kind: str, seconds: float, phases: Sequence[tuple[str, float]], work: Work | None) -> bool:
        """Learn from a finished row: its kind, time, ``(phase, seconds)`` of its phases and its work.

        Returns whether it was learned: a row without phases was read from its cache and is not.
        """
        if not phases:
            return False
        self.rows.setdefault(kind, []).append(seconds)
        spent: dict[str, float] = {}
        for name, s in phases:
            spent[name] = spent.get(name, 0.0) + s
        for name, s in spent.items():
            units = (work or {}).get(name)
            if units:
                self.rates[name] = max(self.rates.get(name, 0.0), s / units)
        self.rest = max(self.rest, seconds - sum(spent.values()))
        return True

    def estimate(self, kind: str, work: Work | None) -> float:
        """The expected time of a row: its kind's mean, or for a kind not timed yet its work at the learned rates.

        Without ``work`` an untimed kind counts at the costliest kind's mean.
        """
        if self.rows.get(kind):
            return sum(self.rows[kind]) / len(self.rows[kind])
        if work is None:
            return max((sum(ts) / len(ts) for ts in self.rows.values() if ts), default=0.0)
        return self.rest + sum(units * self.rates.get(name, 0.0) for name, units in work.items())

    def text(self, remaining: Sequence[tuple[str, Work | None]]) -> str:
        """``about N min left`` for the ``(kind, work)`` rows still to do, saying which kinds are not yet timed."""
        if not remaining:
            return "nothing left"
        if not self.rows:
            return "time left known once a row is measured"
        left = sum(self.estimate(kind, work) for kind, work in remaining)
        text = f"about {left / 60:.1f} min left"
        untimed = list(dict.fromkeys(kind for kind, _ in remaining if not self.rows.get(kind)))
        if untimed:
            measured = all(w is not None for k, w in remaining if k in untimed)
            how = "from the phases measured so far" if measured else "at the slowest so far"
            text += f" ({', '.join(untimed)} not yet timed: counted {how})"
        return text
