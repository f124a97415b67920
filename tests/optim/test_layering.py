"""Dependencies point downward: the ascent steps and the Gaussian maths import nothing above them.

``flatbma.gaussian`` and ``flatbma.rng`` sit below both ``flatbma.optim`` and ``flatbma.posteriors``;
``flatbma.optim`` never imports ``flatbma.posteriors``. Checked on the import statements of the
source files (module level and inside functions alike).
"""

import ast
import dataclasses
from pathlib import Path

import pytest

import flatbma
from flatbma.optim import ASAM, SAM, FisherBall, FisherSAM
from flatbma.types import AscentSpace, ascent_space

SRC = Path(flatbma.__file__).parent
ALLOWED_BELOW = {"flatbma.errors", "flatbma.checks", "flatbma.packed", "flatbma.params", "flatbma.types", "flatbma.rng"}


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.update(f"{node.module}.{a.name}" if node.module == "flatbma" else node.module for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {m for m in found if m.startswith("flatbma")}


@pytest.mark.parametrize("path", sorted((SRC / "optim").glob("*.py")), ids=lambda p: p.name)
def test_optim_does_not_import_posteriors(path):
    assert not {m for m in _imports(path) if m.startswith("flatbma.posteriors")}


@pytest.mark.parametrize("path", [*sorted((SRC / "gaussian").glob("*.py")), SRC / "rng.py"], ids=lambda p: p.name)
def test_the_gaussian_maths_and_rng_import_only_what_lies_below_them(path):
    own = "flatbma.gaussian"
    above = {m for m in _imports(path) if m not in ALLOWED_BELOW and not m.startswith(own + ".") and m != own}
    assert not above
    if path.name == "rng.py":
        assert not _imports(path)


def test_every_ascent_step_declares_where_it_acts():
    for ascent in (SAM(), ASAM(), FisherSAM()):
        assert ascent.space is AscentSpace.WEIGHTS and ascent_space(ascent) is AscentSpace.WEIGHTS
    assert FisherBall().space is AscentSpace.THETA and ascent_space(FisherBall()) is AscentSpace.THETA

    class Bare:  # a user's ascent step that says nothing acts on weights, as every step before FisherBall
        def perturb(self, params, grads):
            return dict(grads)

    assert ascent_space(Bare()) is ascent_space(None) is AscentSpace.WEIGHTS
    assert AscentSpace("theta") is AscentSpace.THETA
    assert "space" not in {f.name for f in dataclasses.fields(FisherBall)}  # a class constant, not a config option
