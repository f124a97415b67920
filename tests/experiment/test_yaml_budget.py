"""YAML expansion bombs and huge values end in one short error line (issue #13), without expanding anything."""

import pytest
import yaml

from flatbma.errors import FlatbmaError
from flatbma.experiment.config.parse import MAX_YAML_NODES, load_yaml, shown
from flatbma.experiment.config.run_config import load_config, load_raw, parse_override
from flatbma.options import coerce


def _laughs(levels: int, width: int = 10) -> str:
    lines = ['a0: &a0 "lol"']
    for i in range(1, levels):
        refs = ", ".join([f"*a{i - 1}"] * width)
        lines.append(f"a{i}: &a{i} [{refs}]")
    return "\n".join(lines) + f"\noptim:\n  lr: *a{levels - 1}\n"


def _count(value) -> int:
    """Values in a constructed document, every shared reference counted again (the expanded size)."""
    if isinstance(value, dict):
        return 1 + sum(_count(k) + _count(v) for k, v in value.items())
    if isinstance(value, list):
        return 1 + sum(_count(v) for v in value)
    return 1


def test_a_billion_laughs_config_is_refused_with_one_line(tmp_path):
    path = tmp_path / "bomb.yaml"
    path.write_text(_laughs(9))  # ~10⁸ values under optim.lr alone
    with pytest.raises(FlatbmaError) as info:
        load_raw(path)
    message = str(info.value)
    assert "aliases" in message and str(path) in message and "\n" not in message and len(message) < 300


def test_the_expanded_size_is_counted_exactly(monkeypatch):
    text = _laughs(5, 7)
    document = yaml.safe_load(text)
    size = _count(document)
    assert 1000 < size < MAX_YAML_NODES
    assert load_yaml(text, "x") == document  # within the budget: the safe loader's document
    monkeypatch.setattr("flatbma.experiment.config.parse.MAX_YAML_NODES", size)
    load_yaml(text, "x")  # exactly at the budget: read
    monkeypatch.setattr("flatbma.experiment.config.parse.MAX_YAML_NODES", size - 1)
    with pytest.raises(FlatbmaError, match=f"over {size - 1:,} YAML values"):
        load_yaml(text, "x")


def test_a_recursive_alias_is_refused():
    with pytest.raises(FlatbmaError, match="refers to itself"):
        load_yaml("a: &a [*a]\n", "c.yaml")


def test_a_bomb_in_set_is_refused_and_plain_text_still_reads_as_text():
    bomb = "[" + ", ".join(["*x"] * 10) + "]"
    with pytest.raises(FlatbmaError, match=r"refers to itself|aliases"):
        parse_override("optim.lr=&x [&y [*y]]")
    assert parse_override("data.root=/some/path") == ("data.root", "/some/path")
    assert parse_override(f"method.name={bomb}")[1] == bomb  # an undefined alias is not YAML: kept as text


def test_error_messages_show_a_bounded_value():
    huge = {"k": [list(range(1000))] * 1000}
    text = shown(huge)
    assert len(text) <= 80 and text.endswith(("...", "}"))
    with pytest.raises(FlatbmaError) as info:
        coerce(huge, float, "optim.lr")
    assert len(str(info.value)) < 200


def test_real_configs_still_load():
    cfg = load_config("configs/demo.yaml")
    assert cfg.model.trainable.value == "norm+classifier"
