"""Options as frozen dataclasses: parsed from plain mappings (:func:`parse_dataclass`), resolved (:func:`resolved`).

A run's identity is its resolved configuration (``config.yaml``): ``flatbma compare`` reuses a finished run
whose resolved section is the same, and ``--resume`` checks it. An option declared with :func:`added` is left
out by :func:`resolved` while it holds its default, so adding it keeps existing runs' identity.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import re
import types
import typing
from collections.abc import Mapping
from enum import Enum
from typing import Any, TypeVar, Union

from flatbma.checks import is_int, is_number, shown
from flatbma.errors import FlatbmaError, suggest

T = TypeVar("T")

ADDED = "flatbma.added"
"""Metadata key of a dataclass field declared with :func:`added`."""


def added(default: Any) -> Any:
    """A dataclass field with ``default`` that :func:`resolved` omits while it holds that default."""
    return dataclasses.field(default=default, metadata={ADDED: True})


def resolved(options: Any) -> dict[str, Any]:
    """``dataclasses.asdict(options)`` without the :func:`added` fields that hold their default, recursively."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(options):
        value = getattr(options, f.name)
        if f.metadata.get(ADDED) and (value is f.default or (type(value) is type(f.default) and value == f.default)):
            continue
        out[f.name] = resolved(value) if dataclasses.is_dataclass(value) else copy.deepcopy(value)
    return out


_FLOAT_TEXT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def type_name(tp: Any) -> str:
    """How a config annotation reads in messages: ``int``, ``'auto'``, ``null``, a union's parts joined by ``or``."""
    if typing.get_origin(tp) in (Union, types.UnionType):
        return " or ".join(type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    if typing.get_origin(tp) is typing.Literal:
        return " or ".join(repr(v) for v in typing.get_args(tp))
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def coerce(value: Any, tp: Any, where: str) -> Any:
    """Check ``value`` against the annotation ``tp`` (ints are accepted for floats; tuples from lists).

    A ``str`` Enum annotation accepts its members and their values and returns the member.
    """
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        if value is None and type(None) in typing.get_args(tp):
            return None  # before a section option, which would read None as "all defaults"
        errors = []
        for option in typing.get_args(tp):
            try:
                return coerce(value, option, where)
            except FlatbmaError as e:
                if isinstance(option, type) and isinstance(value, option) and not isinstance(value, bool):
                    raise  # the right type but a bad value (e.g. an integer too large): that option says why
                if dataclasses.is_dataclass(option) and isinstance(value, Mapping):
                    raise  # a section with a bad key or value: the section says which
                errors.append(str(e))
        names = type_name(tp)
        raise FlatbmaError(f"{where} must be {names}, got {shown(value)}")
    if tp is type(None):
        if value is None:
            return None
        raise FlatbmaError(f"{where} must be null, got {shown(value)}")
    if origin is typing.Literal:
        allowed = typing.get_args(tp)
        if value in allowed:
            return value
        raise FlatbmaError(_not_one_of(where, allowed, value))
    if isinstance(tp, type) and issubclass(tp, Enum):
        try:
            return tp(value)
        except (ValueError, TypeError):
            raise FlatbmaError(_not_one_of(where, tuple(m.value for m in tp), value)) from None
    if origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(value, (list, tuple)):
            raise FlatbmaError(f"{where} must be a list, got {shown(value)}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(coerce(v, args[0], f"{where}[{i}]") for i, v in enumerate(value))
        if len(args) != len(value):
            raise FlatbmaError(f"{where} must be a list of {len(args)} values, got {shown(value)}")
        return tuple(coerce(v, a, f"{where}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise FlatbmaError(f"{where} must be true or false, got {shown(value)}")
    if tp is int:
        if is_int(value):
            if not -(2**63) <= value < 2**63:  # torch and numpy take 64-bit integers
                raise FlatbmaError(f"{where} must be a 64-bit integer, got one of {value.bit_length()} bits")
            return value
        raise FlatbmaError(f"{where} must be an integer, got {shown(value)}")
    if tp is float:
        if is_number(value):
            try:
                return float(value)
            except OverflowError:
                raise FlatbmaError(f"{where} must be a number within float range (about ±1.8e308)") from None
        if isinstance(value, str) and _FLOAT_TEXT.fullmatch(value.strip()):  # YAML 1.1 reads 1e-3 as text
            raise FlatbmaError(
                f"{where} must be a number, got the text {shown(value)} (YAML reads an exponent as a number only "
                f"with a dot and a sign, like 1.0e-3): write {yaml_float(float(value))}"
            )
        raise FlatbmaError(f"{where} must be a number, got {shown(value)}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise FlatbmaError(f"{where} must be a string, got {shown(value)}")
    if dataclasses.is_dataclass(tp):
        return parse_dataclass(tp, value, where)
    raise TypeError(f"unsupported config annotation {tp!r} at {where}")


def _not_one_of(where: str, allowed: tuple[Any, ...], value: Any) -> str:
    hint = suggest(str(value), [str(a) for a in allowed])
    return f"{where} must be one of {', '.join(map(repr, allowed))}, got {shown(value)}.{hint}"


def yaml_float(x: float) -> str:
    """``x`` spelled so that YAML 1.1 (PyYAML) reads a float: ``1.0e-3``, not ``1e-3`` (which is text)."""
    if not math.isfinite(x):
        return ".nan" if math.isnan(x) else ("-.inf" if x < 0 else ".inf")
    mantissa, _, exponent = repr(float(x)).partition("e")
    if not exponent:
        return mantissa
    return f"{mantissa if '.' in mantissa else mantissa + '.0'}e{int(exponent):+d}"


def parse_dataclass(cls: type[T], data: Any, where: str) -> T:
    """Build the frozen dataclass ``cls`` from a mapping, rejecting unknown keys with a suggestion.

    Field annotations drive the type checks and defaults fill gaps (``data=None``: all defaults); ``where`` is the
    dotted config path the messages name.
    """
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise FlatbmaError(f"{where or 'the config'} must be a mapping of keys to values, got {shown(data)}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs = {}
    for key, value in data.items():
        path = f"{where}.{key}" if where else str(key)
        if key not in fields:
            raise FlatbmaError(
                f"unknown config key {shown(path)}.{suggest(str(key), fields)} "
                f"Valid keys here: {', '.join(sorted(fields))}"
            )
        kwargs[key] = coerce(value, hints[key], path)
    missing = [
        name
        for name, f in fields.items()
        if name not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING  # type: ignore[misc]
    ]
    if missing:
        raise FlatbmaError(f"missing config key(s) {', '.join(f'{where}.{m}' for m in missing)}")
    try:
        return cls(**kwargs)
    except FlatbmaError as e:  # a message that already names its key (``compare.pairs[1] ...``) is not prefixed again
        text = str(e)
        raise FlatbmaError(
            f"{where}: {text}" if where and not text.startswith((f"{where}.", f"{where}[")) else text
        ) from None


def plain(section: Any) -> dict[str, Any]:
    """The :func:`resolved` ``section`` with every Enum member spelled as its value (as YAML and JSON hold it)."""
    return plain_values(resolved(section))


def plain_values(mapping: Mapping[str, Any]) -> dict[str, Any]:
    """``mapping`` with every Enum member spelled as its value, and tuples and lists as lists (as YAML reads back)."""
    return {k: _plain_value(v) for k, v in mapping.items()}


def _plain_value(value: Any) -> Any:
    if isinstance(value, Mapping):  # a nested section (multi's method.of)
        return plain_values(value)
    if isinstance(value, (tuple, list)):
        return [_plain_value(v) for v in value]
    return value.value if isinstance(value, Enum) else value
