"""Read configs: YAML (:func:`load_yaml`, safe, with an alias-expansion budget) and ``--set`` (:func:`set_dotted`)."""

from __future__ import annotations

from typing import Any, TypeVar

import yaml

from flatbma.checks import shown
from flatbma.errors import FlatbmaError

T = TypeVar("T")

MAX_YAML_NODES = 100_000
"""Budget of :func:`load_yaml`: scalars, lists and mappings of a document with every alias expanded (a
config has a few hundred; a 9-level billion-laughs document has ~10⁹)."""

def load_yaml(text: str, where: str) -> Any:
    """The YAML document ``text``, read with the safe loader and a budget on its expanded size.

    The expanded size is counted by one memoized walk of the composed node graph (aliases share nodes), in time
    linear in the text, before any Python object is built; the same walk refuses duplicate keys.

    Raises:
        FlatbmaError: over :data:`MAX_YAML_NODES` nodes, a recursive alias or a duplicate key, naming ``where``.
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

    Keys compare by tag and text (``method`` and ``"method"`` are the same key, ``1`` and ``"1"`` are not). A merge
    key (``<<: *defaults``) is not a key of its own: the keys beside it override the merged ones.
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
