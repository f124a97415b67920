"""Imports point downward: every module of flatbma imports only its own unit or units of a lower layer.

The layers (``../shared/STYLE.md``: shared maths below the methods that use it, the experiment layer on
top) are read from the import statements of the source files — module level and inside functions alike,
``if TYPE_CHECKING`` blocks included — so a new upward import fails here with the offending edge.
"""

import ast
from pathlib import Path

import flatbma

SRC = Path(flatbma.__file__).parent

LAYERS: dict[str, int] = {
    "errors": 0,
    "checks": 1,
    "options": 1,
    "rng": 1,
    "types": 1,
    "calibration": 1,
    "stats": 1,
    "progress": 1,
    "packed": 2,
    "jacobians": 2,
    "metrics": 2,
    "regression": 2,
    "plotting": 2,
    "data": 2,
    "models": 2,
    "precision": 2,
    "params": 3,
    "bn": 3,
    "transfer": 3,
    "predict": 3,
    "gaussian": 4,
    "state_io": 2,
    "predictor": 5,
    "optim": 5,
    "curvature": 5,
    "flatness": 5,
    "posteriors": 6,
    "experiment": 7,
    "": 8,  # the package's __init__: the public API re-exports every library layer
    "__main__": 9,
}
"""Units (top-level modules and subpackages of flatbma) by layer, lowest first."""

ROOT_ATTRIBUTES = {"__version__"}
"""What a unit may read from the package root (``import flatbma``) without importing a layer through it."""


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _edges() -> list[tuple[str, str, str]]:
    """``(file, importing unit, imported unit)`` for every flatbma import across units."""
    edges = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC.parent).with_suffix("")
        module = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        own = _unit(module)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "flatbma":
                if node.module == "flatbma":
                    targets = [f"flatbma.{a.name}" for a in node.names if a.name not in ROOT_ATTRIBUTES]
                else:
                    targets = [node.module]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name.split(".")[0] == "flatbma"]
            else:
                continue
            for target in targets:
                if target == "flatbma" and own == "experiment":
                    continue  # `import flatbma` for flatbma.__version__ (the run's environment record)
                if _unit(target) != own:
                    edges.append((str(path.relative_to(SRC)), own, _unit(target)))
    return edges


def test_every_unit_has_a_layer():
    units = {_unit(".".join(("flatbma", *p.relative_to(SRC).with_suffix("").parts))) for p in SRC.rglob("*.py")}
    units = {"" if u == "__init__" else u for u in units}
    assert units <= set(LAYERS), f"give these units a layer: {sorted(units - set(LAYERS))}"


def test_imports_point_downward():
    upward = [f"{f}: {a} imports {b}" for f, a, b in _edges() if LAYERS[b] >= LAYERS[a]]
    assert not upward, "imports pointing up or sideways:\n" + "\n".join(upward)


def test_the_check_sees_imports():
    edges = _edges()
    assert ("optim/fisher_ball.py", "optim", "gaussian") in edges
    assert any(a == "experiment" and b == "posteriors" for _, a, b in edges)
