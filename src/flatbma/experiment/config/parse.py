"""Parse plain mappings (from YAML or ``--set``) into typed frozen dataclasses, once, with clear errors.

YAML is read by :func:`load_yaml`: the safe loader, with a budget on the size of the document once its
aliases are expanded, so that an expansion bomb ("billion laughs") is refused before anything iterates
it. Values quoted in error messages are :func:`shown` at a bounded size.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from collections.abc import Mapping
from enum import Enum
from typing import Any, TypeVar, Union

import yaml

from flatbma.checks import is_int, is_number, shown
from flatbma.errors import FlatbmaError, suggest

T = TypeVar("T")

MAX_YAML_NODES = 100_000
"""Budget of :func:`load_yaml`: scalars, lists and mappings of a document with every alias expanded (a
config has a few hundred; a 9-level billion-laughs document has ~10⁹)."""

def load_yaml(text: str, where: str) -> Any:
    """The YAML document ``text``, read with the safe loader and a budget on its expanded size.

    It is refused when it expands to over :data:`MAX_YAML_NODES` nodes or refers to itself, in time
    linear in the text's size: the composed node graph shares the node of every alias, so its expanded
    size is counted with one memoized walk before any Python object is built. The same walk refuses a
    mapping that names a key twice (:func:`_check_unique_keys`).

    Raises:
        FlatbmaError: an expansion bomb, a recursive alias or a duplicate key, naming ``where``.
        yaml.YAMLError: invalid YAML (callers word that error themselves).
    """
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        size = _expanded_size(node, {}, where)
        if size > MAX_YAML_NODES:
            raise FlatbmaError(
                f"{where} expands to over {MAX_YAML_NODES:,} YAML values through its aliases (&anchor / *alias), "
                "more than a config may hold: write the values out instead of nesting aliases"
            )
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _expanded_size(node: yaml.Node, sizes: dict[int, int | None], where: str) -> int:
    key = id(node)
    if key in sizes:
        size = sizes[key]
        if size is None:  # still being counted: the node contains itself
            raise FlatbmaError(f"{where} has an alias that refers to itself (a recursive &anchor): remove it")
        return size
    sizes[key] = None
    if isinstance(node, yaml.SequenceNode):
        total = 1 + sum(_expanded_size(child, sizes, where) for child in node.value)
    elif isinstance(node, yaml.MappingNode):
        _check_unique_keys(node, where)
        total = 1 + sum(_expanded_size(k, sizes, where) + _expanded_size(v, sizes, where) for k, v in node.value)
    else:
        total = 1
    sizes[key] = total = min(total, MAX_YAML_NODES + 1)  # saturate: the counts stay small integers
    return total


def _check_unique_keys(node: yaml.MappingNode, where: str) -> None:
    """Refuse a mapping that names a key twice, which PyYAML reads silently as its last value.

    Keys are compared as the loader resolves them: by tag and text, so ``method`` and ``"method"`` are
    the same key and ``1`` and ``"1"`` are not. A merge key (``<<: *defaults``) is not a key of its own:
    the keys written beside it override the merged ones, as YAML specifies.
    """
    first_line: dict[tuple[str, str], int] = {}
    for key, _ in node.value:
        if not isinstance(key, yaml.ScalarNode) or key.tag == "tag:yaml.org,2002:merge":
            continue
        line = key.start_mark.line + 1
        if (key.tag, key.value) in first_line:
            raise FlatbmaError(
                f"duplicate key {shown(key.value)} in {where} line {line} (first on line "
                f"{first_line[key.tag, key.value]}): YAML would keep only the last value; remove one of them"
            )
        first_line[key.tag, key.value] = line


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

    Args:
        cls: the dataclass type; field annotations drive the type checks, field defaults fill gaps.
        data: a mapping (``None`` means all defaults).
        where: the dotted config path, used in error messages.
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


def set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    """``tree['a']['b'] = value`` for ``dotted='a.b'``, creating mappings on the way."""
    keys = dotted.split(".")
    node = tree
    for key in keys[:-1]:
        child = node.get(key)
        if child is None:
            child = node[key] = {}
        if not isinstance(child, dict):
            raise FlatbmaError(f"--set {dotted}: '{key}' is the value {shown(child)}, not a section of keys")
        node = child
    node[keys[-1]] = value
