"""Compare entries as written: candidate grids and the run config sections of one candidate.

A ``compare.methods`` entry is a method section with optional ``label``, ``prior`` and ``optim`` keys
(:func:`run_sections`). Any scalar option of the method, of its ``optim`` or of a nested method ``of`` may be a
list of values, e.g. ``{name: sam, rho: [0.01, 0.05], optim: {lr: [0.01, 0.05]}}``; never a tuple-typed option or
anything in ``prior``. Every combination, in the order written (:func:`points`), is a *candidate*, a run of its
own (docs/cli.md, "Hyperparameter selection on validation data"). The module works on the raw config mappings.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
import types
import typing
from collections.abc import Mapping
from enum import Enum
from typing import Any, Literal, Union

from flatbma.checks import shown
from flatbma.errors import FlatbmaError
from flatbma.methods import METHODS
from flatbma.optim import Amortized
from flatbma.optim.config import OptimConfig

OWN_SECTIONS = ("optim", "train", "data")
"""Run config sections an entry may give its own keys of (they override the shared section's)."""

ENTRY_KEYS = ("name", "label", "prior", *OWN_SECTIONS, "match_width")
"""Keys of a compare entry that are not method options (``match_width``: :mod:`flatbma.experiment.study.compare`)."""

MATCH_WIDTH = "match_width"
"""The entry key naming the entry whose posterior width this one is measured at (a measurement, not a run option)."""

OPTIM = "optim"
"""The entry's own optimizer section; its keys take lists too (``optim.lr`` in a candidate's options)."""

NESTED = (OPTIM, "of")
"""Entry keys holding a section whose keys take lists too: ``optim``, and ``of`` (a nested method section)."""

_DIR_TEXT = re.compile(r"[A-Za-z0-9_.+=,-]{1,80}")


def is_scalar(tp: Any) -> bool:
    """Whether the annotation ``tp`` holds one number, flag or name (``None`` allowed), not a list."""
    if typing.get_origin(tp) in (Union, types.UnionType):
        return all(is_scalar(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is Literal:
        return True
    return tp in (int, float, bool, str, type(None)) or (isinstance(tp, type) and issubclass(tp, Enum))


def _option_types(name: Any) -> dict[str, Any]:
    """The annotation of every option of method ``name`` (family, ascent step, amortization; ``{}``: unknown)."""
    spec = METHODS.get(name) if isinstance(name, str) else None
    if spec is None:
        return {}  # the entry's parse reports the unknown method
    out = dict(spec.family_options())
    if spec.ascent is not None:
        ascent = typing.get_type_hints(spec.ascent)
        out.update({k: ascent.get(k, Any) for k in spec.ascent_options()})
        amortized = typing.get_type_hints(Amortized)
        out.update({k: amortized[k] for k in spec.amortized_options()})
    return out


def grid(entry: Mapping[str, Any], where: str) -> dict[str, list[Any]]:
    """The lists of candidate values of a compare entry: ``{option: values}``, ``optim.<key>`` for its optimizer.

    A list counts only where the option's type is a scalar (:func:`is_scalar`); any other list is left
    to the option's own parse.

    Raises:
        FlatbmaError: an empty list of candidates, or an ``optim`` entry that is not a mapping.
    """
    axes = _scalar_lists(entry, _option_types(entry.get("name")), skip=ENTRY_KEYS)
    optim = entry.get(OPTIM)
    if optim is not None and not isinstance(optim, Mapping):
        raise FlatbmaError(
            f"{where}.optim must be a mapping of optim keys (e.g. {{lr: [0.01, 0.05]}}), got {shown(optim)}"
        )
    for key, value in _scalar_lists(optim or {}, typing.get_type_hints(OptimConfig)).items():
        axes[f"{OPTIM}.{key}"] = value
    of = entry.get("of")
    if isinstance(of, Mapping):  # anything else is left to the option's own parse
        for key, value in _scalar_lists(of, _option_types(of.get("name")), skip=("name",)).items():
            axes[f"of.{key}"] = value
    for key, values in axes.items():
        if not values:
            raise FlatbmaError(f"{where}.{key} is an empty list: give the candidate values, e.g. [0.01, 0.05]")
    return axes


def _scalar_lists(section: Mapping[str, Any], hints: Mapping[str, Any], skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """The keys of ``section`` whose value is a list and whose type in ``hints`` is a scalar (:func:`is_scalar`)."""
    return {k: v for k, v in section.items() if k not in skip and isinstance(v, list) and is_scalar(hints.get(k, Any))}


def points(entry: Mapping[str, Any], where: str) -> list[dict[str, Any]]:
    """Every combination of the entry's candidate lists (:func:`grid`), in the order written; ``[{}]`` without lists."""
    axes = grid(entry, where)
    return [dict(zip(axes, values, strict=True)) for values in itertools.product(*axes.values())]


def at(entry: Mapping[str, Any], point: Mapping[str, Any]) -> dict[str, Any]:
    """The entry with each candidate list replaced by its value at ``point`` (a result of :func:`points`)."""
    out = dict(entry)
    nested = {k: dict(out[k]) for k in NESTED if isinstance(out.get(k), Mapping)}
    for key, value in point.items():
        section, _, sub = key.partition(".")
        if sub and section in nested:
            nested[section][sub] = value
        else:
            out[key] = value
    return {**out, **nested}


def directory_names(grid_points: list[dict[str, Any]]) -> list[str]:
    """A directory name per candidate: ``cand-rho=0.05,optim.lr=0.01``, or ``cand-<hash of the point>``.

    The readable names are used when every candidate has one (path-safe characters, at most 80) and no
    two coincide.
    """
    readable = [",".join(f"{k}={_text(v)}" for k, v in p.items()) for p in grid_points]
    if all(_DIR_TEXT.fullmatch(r) for r in readable) and len(set(readable)) == len(readable):
        return [f"cand-{r}" for r in readable]
    return [f"cand-{hashlib.sha256(json.dumps(p, sort_keys=True).encode()).hexdigest()[:8]}" for p in grid_points]


def _text(value: Any) -> str:
    return repr(value) if isinstance(value, float) else str(value.value if isinstance(value, Enum) else value)


def run_sections(method: Any, shared: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The run config sections of one ``compare.methods`` entry (at one point of its candidate grid).

    Its ``prior`` becomes the run's ``prior`` section (a two-stage run, e.g. ``{name: fp-bma, prior: {method:
    {name: swag}, epochs: 15}}``); its ``optim``, ``train`` and ``data`` override the keys they give of ``shared``
    (the config's raw sections by name); ``label`` and ``match_width`` are dropped (measurement, not run, keys).
    """
    if not isinstance(method, dict):
        return {"method": method}
    method = {k: v for k, v in method.items() if k not in ("label", MATCH_WIDTH)}  # measurement keys, not the run's
    sections: dict[str, Any] = {}
    for name in OWN_SECTIONS:
        if name in method:
            own = method.pop(name)
            base = (shared or {}).get(name)
            sections[name] = {**(base if isinstance(base, dict) else {}), **own} if isinstance(own, dict) else own
    if "prior" in method:
        sections["prior"] = method.pop("prior")
    sections["method"] = method
    return sections


def first_run_sections(entry: Any, shared: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The run config sections of the first candidate of a ``compare.methods`` entry (``flatbma train`` trains it)."""
    if isinstance(entry, dict):
        entry = at(entry, points(entry, "compare.methods[0]")[0])
    return run_sections(entry, shared)


def label_of(method: Any) -> str:
    """The name of a ``compare.methods`` entry in tables and plots: its ``label``, else its method name."""
    if isinstance(method, dict):
        return str(method.get("label", method.get("name")))
    return str(method)
