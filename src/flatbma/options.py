"""Options added to a frozen options dataclass after runs with it existed, and the resolved form of such a dataclass.

A run's identity is its resolved configuration (every option spelled out, ``config.yaml``): ``flatbma
compare`` reuses a finished run when the resolved section of its config is the same, and ``--resume``
checks it. An option added later would appear in every resolved section — with its default — and make
every run resolved before it a different run, although its numbers are the same. So an option added
later is declared with :func:`added` and :func:`resolved` leaves it out while it holds its default:
configs that do not use it resolve exactly as before, and a run that uses it is a new run. The same
rule serves the config sections (:mod:`flatbma.experiment.config.sections`) and the ascent steps' options
(:mod:`flatbma.optim`, e.g. FP-BMA's ``radius``).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

ADDED = "flatbma.added"
"""Metadata key of a dataclass field declared with :func:`added`."""


def added(default: Any) -> Any:
    """A dataclass field with ``default`` that :func:`resolved` omits while it holds that default."""
    return dataclasses.field(default=default, metadata={ADDED: True})


def resolved(options: Any) -> dict[str, Any]:
    """``dataclasses.asdict(options)`` without the :func:`added` fields that hold their default.

    Nested dataclasses (a section inside a section) are resolved the same way.
    """
    out: dict[str, Any] = {}
    for f in dataclasses.fields(options):
        value = getattr(options, f.name)
        if f.metadata.get(ADDED) and (value is f.default or (type(value) is type(f.default) and value == f.default)):
            continue
        out[f.name] = resolved(value) if dataclasses.is_dataclass(value) else copy.deepcopy(value)
    return out
