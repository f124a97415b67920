"""A key written twice in one YAML mapping is an error naming the key, the file and the line (issue #13).

PyYAML's safe loader keeps the last value silently, so a config with two ``method:`` sections trained
the second one without a word.
"""

from pathlib import Path

import pytest
import yaml

from flatbma.errors import FlatbmaError
from flatbma.experiment.cli import main
from flatbma.experiment.config.parse import load_yaml
from flatbma.experiment.config.run_config import load_config, load_raw, parse_override

TWO_METHODS = """\
seed: 0
method: {name: sgd}
optim: {lr: 0.05}
method:
  name: sam
"""


def test_pyyaml_alone_keeps_the_last_value():
    """The defect: without the check the second ``method`` silently wins."""
    assert yaml.safe_load(TWO_METHODS)["method"] == {"name": "sam"}


def test_a_duplicate_top_level_key_names_the_file_and_line(tmp_path: Path):
    path = tmp_path / "two.yaml"
    path.write_text(TWO_METHODS)
    with pytest.raises(FlatbmaError) as info:
        load_raw(path)
    assert str(info.value).startswith(f"duplicate key 'method' in {path} line 4 (first on line 2)")


def test_the_cli_prints_one_line_and_trains_nothing(tmp_path: Path, capsys):
    path = tmp_path / "two.yaml"
    path.write_text(TWO_METHODS + f"output_dir: {tmp_path / 'run'}\n")
    assert main(["train", "--config", str(path)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("flatbma: error: duplicate key 'method'") and "line 4" in err[0]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("text", "key", "line"),
    [
        ("optim:\n  lr: 0.1\n  momentum: 0.9\n  lr: 0.2\n", "lr", 4),  # nested
        ("method: {name: sgd, name: sam}\n", "name", 1),  # flow style, one line
        ('method: {name: sgd}\n"method": {name: sam}\n', "method", 2),  # quoting does not make it another key
        ("compare:\n  methods:\n    - {name: sgd}\n    - name: sam\n      rho: 0.1\n      rho: 0.2\n", "rho", 6),
        ("a: &x {k: 1, k: 2}\nb: *x\n", "k", 1),  # inside an anchor: reported once, where it is written
    ],
    ids=["nested", "flow", "quoted", "list-entry", "anchored"],
)
def test_duplicates_anywhere_are_found(text: str, key: str, line: int):
    with pytest.raises(FlatbmaError, match=f"duplicate key '{key}' in c.yaml line {line}"):
        load_yaml(text, "c.yaml")


@pytest.mark.parametrize(
    "text",
    [
        "a: {k: 1}\nb: {k: 1}\n",  # the same key in two mappings
        "1: a\n'1': b\n",  # an integer and a text are two keys
        "base: &b {lr: 0.1, momentum: 0.9}\noptim:\n  <<: *b\n  lr: 0.2\n",  # a merge, then an override
        "x: [{k: 1}, {k: 2}]\n",
    ],
    ids=["two-mappings", "int-vs-text", "merge-override", "list-of-mappings"],
)
def test_what_is_not_a_duplicate_still_reads(text: str):
    assert load_yaml(text, "c.yaml") == yaml.safe_load(text)


def test_a_duplicate_in_set_is_refused():
    with pytest.raises(FlatbmaError, match="duplicate key 'name' in --set method line 1"):
        parse_override("method={name: sgd, name: sam}")


def test_the_shipped_configs_have_no_duplicates():
    for path in sorted(Path("configs").glob("*.yaml")):
        load_raw(path)
    assert load_config("configs/demo.yaml").method.name
