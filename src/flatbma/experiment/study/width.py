"""Width-matched posteriors (``match_width``): a Gaussian posterior measured at another row's width ``tr Σ``.

An entry whose posterior is a low-rank plus diagonal Gaussian may name an earlier entry in ``match_width``; it
trains (and selects) as usual but is measured as ``N(μ, cΣ)`` with ``c = tr Σ_ref / tr Σ`` (docs/cli.md).
Everything here goes through the posterior's Gaussian (:attr:`~flatbma.types.Capabilities.gaussian`,
:mod:`flatbma.posteriors.gaussians`): no method or family is named.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from torch import nn

from flatbma.errors import FlatbmaError, suggest
from flatbma.experiment.config import entries
from flatbma.experiment.config.entries import label_of
from flatbma.experiment.config.parse import shown
from flatbma.experiment.run.build import Experiment
from flatbma.methods import METHODS, parse_method
from flatbma.optim import SGD
from flatbma.params import Objective
from flatbma.posteriors import gaussians
from flatbma.prior import gaussian_methods
from flatbma.types import State

SAMPLER = "low-rank Gaussian sampler over the scaled θ (SWAG's sampler distribution)"
"""How a width-matched row's posterior is sampled (recorded in its ``width_matched``)."""


def check_match_width(compare: Any) -> None:
    """Refuse a ``match_width`` the comparison cannot honour, before anything trains.

    The entry's posterior must be a low-rank plus diagonal Gaussian with its options (:func:`gaussian_posterior`), the
    label that of an earlier entry measured as trained, and the comparison must measure widths (``compare.flatness``).
    """
    earlier: dict[str, dict[str, Any]] = {}
    for i, entry in enumerate(compare.methods):
        target = entry.get(entries.MATCH_WIDTH)
        where = f"compare.methods[{i}] ({label_of(entry)!r}).match_width"
        if target is not None:
            if not isinstance(target, str):
                raise FlatbmaError(f"{where} must be the label of an earlier entry (a text), got {shown(target)}")
            if not gaussian_posterior(entry):
                raise FlatbmaError(
                    f"{where}: method {entry.get('name')!r} with these options has no low-rank plus diagonal Gaussian "
                    f"posterior to rescale; match_width works for {', '.join(gaussian_methods())} with the low-rank "
                    "part on"
                )
            if target not in earlier:
                raise FlatbmaError(
                    f"{where} is {target!r}, which is not the label of an earlier entry"
                    f".{suggest(str(target), list(earlier))} Put the entry it is matched to first"
                )
            if earlier[target].get(entries.MATCH_WIDTH) is not None:
                raise FlatbmaError(
                    f"{where}: {target!r} is itself width-matched; match to an entry measured as trained"
                )
            if not compare.flatness:
                raise FlatbmaError(f"{where} needs the reference's measured width: set compare.flatness: true")
        earlier[label_of(entry)] = entry


def gaussian_posterior(entry: Any) -> bool:
    """Whether a compare entry's method, with its options, has a low-rank plus diagonal Gaussian posterior.

    Its family's registry entry says so (:attr:`~flatbma.family.Family.gaussian`) and the posterior built with the
    entry's (first candidate's) options has a :attr:`~flatbma.types.Capabilities.gaussian`: an option may turn the
    low-rank part off. Building is cheap and draws nothing (a one-weight probe model). An entry whose options do
    not parse counts as one: its config's own check names the problem.
    """
    name = entry.get("name")
    spec = METHODS.get(name) if isinstance(name, str) else None
    if spec is None or not spec.family.gaussian:
        return False
    try:
        method = parse_method(entries.first_run_sections(entry)["method"])
    except FlatbmaError:
        return True
    return method.build(Objective(model=nn.Linear(1, 1)), SGD(lr=1.0)).can.gaussian is not None


def width_matched(
    exp: Experiment, state: State, label: str, trace_ref: float
) -> tuple[Experiment, State, dict[str, Any]]:
    """``exp`` and ``state`` with the Gaussian posterior's covariance scaled to ``tr Σ = trace_ref``.

    Returns the experiment measuring :func:`flatbma.posteriors.gaussians.rescaled` (the scaled ``θ``,
    sampled by the low-rank sampler), its state and the row's ``width_matched`` record.
    """
    if exp.method.can.gaussian is None:
        raise FlatbmaError(f"{exp.config.method.name} has no Gaussian posterior to rescale (match_width)")
    own = gaussians.covariance_trace(exp.method, state)
    if not (own > 0 and math.isfinite(own) and math.isfinite(trace_ref) and trace_ref > 0):
        raise FlatbmaError(f"match_width needs positive widths; got tr Σ = {own} here and {trace_ref} for {label!r}")
    factor = trace_ref / own
    posterior, scaled = gaussians.rescaled(exp.method, state, factor)
    record = {"to": label, "factor": factor, "reference_trace": trace_ref, "trained_trace": own, "sampler": SAMPLER}
    return dataclasses.replace(exp, method=posterior), scaled, record
