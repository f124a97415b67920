"""Name-spaced state: each component of a composed method keeps its state under its own name.

The flat-dict form of optax's ``named_chain``: a composed method (SWAG = optimizer state + moments; a mixture =
its members) holds component ``c``'s entries ``k`` as ``"<c>/<k>"`` in :attr:`flatbma.types.State.aux` (or
``params``/``buffers``), so a state stays a flat ``dict[str, Tensor]`` that saves to safetensors. Only the
family that composes a state reads its names.

A family's own component is a typed ``NamedTuple`` of tensors, dicts of tensors by weight name, or optional
tensors; :func:`entries` lays it out flat (``"f"``, ``"f/k"``) and :func:`typed` reads it back.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple, TypeVar

from torch import Tensor

from flatbma.errors import FlatbmaError

SEP = "/"
"""What separates a component's name from its entries' keys."""

OPTIMIZER = "optimizer"
"""The name every family that trains with a :class:`~flatbma.types.GradientTransformation` keeps its optimizer's
state under (SGD's ``optimizer/momentum/<w>``, Adam's ``optimizer/exp_avg/<w>`` and ``optimizer/exp_avg_sq/<w>``)."""


def nest(name: str, tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """``tensors`` as component ``name``'s entries: keys ``"<name>/<key>"`` (the same tensors)."""
    return {f"{name}{SEP}{k}": v for k, v in tensors.items()}


def part(name: str, tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Component ``name``'s entries of ``tensors``, without its name (the same tensors, in their order)."""
    head = name + SEP
    return {k[len(head) :]: v for k, v in tensors.items() if k.startswith(head)}


def without(name: str, tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Every entry of ``tensors`` but component ``name``'s (the same tensors, in their order)."""
    head = name + SEP
    return {k: v for k, v in tensors.items() if not k.startswith(head)}


def chain(*components: tuple[str, Mapping[str, Tensor]]) -> dict[str, Tensor]:
    """Every ``(name, entries)`` component's entries under its name, in the order given (optax's ``named_chain``)."""
    out: dict[str, Tensor] = {}
    for name, tensors in components:
        out.update(nest(name, tensors))
    return out


def split(tensors: Mapping[str, Tensor], *names: str) -> tuple[dict[str, Tensor], ...]:
    """Every named component's :func:`part` of ``tensors``, in the order of ``names``.

    Raises:
        FlatbmaError: an entry under none of ``names`` (a state of another layout).
    """
    heads = tuple(n + SEP for n in names)
    stray = next((k for k in tensors if not k.startswith(heads)), None)
    if stray is not None:
        raise FlatbmaError(f"state entry {stray!r} belongs to none of the components {', '.join(names)}")
    return tuple(part(n, tensors) for n in names)


def names(tensors: Mapping[str, Tensor]) -> list[str]:
    """The components whose entries ``tensors`` holds, in the order they first appear."""
    return list(dict.fromkeys(k.partition(SEP)[0] for k in tensors if SEP in k))


T = TypeVar("T", bound=NamedTuple)


def entries(structure: NamedTuple) -> dict[str, Tensor]:
    """A typed state's entries in field order: field ``f`` as ``"f"``, its dict's entry ``k`` as ``"f/k"``."""
    out: dict[str, Tensor] = {}
    for field, value in zip(structure._fields, structure, strict=True):
        if isinstance(value, Mapping):
            out.update(nest(field, value))
        elif value is not None:
            out[field] = value
    return out


def typed(cls: type[T], tensors: Mapping[str, Tensor]) -> T:
    """The typed state ``cls`` (a ``NamedTuple``) of its :func:`entries` ``tensors`` (the same tensors).

    A ``dict`` field takes the entries under its name; another field its entry, or ``None`` if absent and allowed.

    Raises:
        FlatbmaError: an entry of no field, or a missing entry of a field that cannot be ``None`` (a state of
            another layout).
    """
    values: dict[str, Any] = {}
    for field in cls._fields:
        annotation = _annotation(cls, field)
        if annotation.startswith("dict"):
            values[field] = part(field, tensors)
        elif field in tensors:
            values[field] = tensors[field]
        elif "None" in annotation:
            values[field] = None
        else:
            raise FlatbmaError(f"the state has no entry {field!r}: it is not a {cls.__name__}")
    known = set(entries(cls(**values)))
    stray = next((k for k in tensors if k not in known), None)
    if stray is not None:
        raise FlatbmaError(f"state entry {stray!r} belongs to no field of {cls.__name__}")
    return cls(**values)


def _annotation(cls: type, field: str) -> str:
    """The annotation of ``cls``'s ``field`` as written (a NamedTuple keeps a postponed one as a ``ForwardRef``)."""
    annotation = cls.__annotations__[field]
    return str(getattr(annotation, "__forward_arg__", annotation))
