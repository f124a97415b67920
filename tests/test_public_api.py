"""The public API: every ``__all__`` name imports, the README's names resolve, importing is light."""

import importlib
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import pytest

import flatbma

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def _modules() -> list[str]:
    """Every module of flatbma except ``__main__`` (which runs the CLI)."""
    names = ["flatbma"]
    for info in pkgutil.walk_packages(flatbma.__path__, "flatbma."):
        if not info.name.endswith("__main__"):
            names.append(info.name)
    return names


MODULES = _modules()


@pytest.mark.parametrize("name", MODULES)
def test_every_name_in_all_imports(name):
    module = importlib.import_module(name)
    exported = getattr(module, "__all__", None)
    if exported is None:
        return
    assert len(exported) == len(set(exported)), f"{name}.__all__ lists a name twice"
    missing = [n for n in exported if not hasattr(module, n)]
    assert not missing, f"{name}.__all__ names what it does not define: {missing}"
    namespace: dict = {}
    exec(f"from {name} import *", namespace)  # the star import a user would write
    assert set(exported) <= set(namespace)


def test_top_level_exports_the_subpackages_and_contract():
    for name in ("bn", "calibration", "data", "flatness", "metrics", "models", "optim", "plotting", "posteriors"):
        assert name in flatbma.__all__ and importlib.import_module(f"flatbma.{name}") is getattr(flatbma, name)
    assert "transfer" in flatbma.__all__ and flatbma.transfer is importlib.import_module("flatbma.transfer")
    from flatbma import Posterior, State, Transform, bma_log_probs, evaluate, predict  # noqa: F401


def test_flatness_reexports_every_public_name_of_its_modules():
    from flatbma import flatness

    for sub in ("hutchinson", "hvp", "lanczos", "landscape", "posterior", "slq"):
        module = importlib.import_module(f"flatbma.flatness.{sub}")
        assert set(module.__all__) <= set(flatness.__all__), sub


def test_landscape_plots_moved_to_plotting_keep_their_flatness_names():
    from flatbma import flatness, plotting

    for name in ("landscape_1d_png", "landscape_2d_png", "plot_landscape_1d", "plot_landscape_2d"):
        assert getattr(flatness, name) is getattr(plotting, name)


def _fresh_modules(statement: str) -> set[str]:
    code = f"import sys\n{statement}\nprint('\\n'.join(sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    return set(out.stdout.split())


@pytest.mark.parametrize(
    "statement",
    [
        "import flatbma",
        "import flatbma.plotting, flatbma.flatness",
        "import flatbma.experiment.report.tables",
    ],
)
def test_import_does_not_load_matplotlib(statement):
    loaded = _fresh_modules(statement)
    assert not {m for m in loaded if m == "matplotlib" or m.startswith("matplotlib.")}


def test_import_flatbma_does_not_load_the_experiment_layer():
    assert "flatbma.experiment" not in _fresh_modules("import flatbma")


DOCUMENTS = [README, *sorted((ROOT / "docs").rglob("*.md"))]
"""The README and the documentation pages: their code and the names they mention must exist."""


def _readme_python() -> list[str]:
    return [b for doc in DOCUMENTS for b in re.findall(r"```python\n(.*?)```", doc.read_text(), flags=re.S)]


def test_readme_imports_work():
    statements = [
        line
        for block in _readme_python()
        for line in block.splitlines()
        if line.startswith(("import flatbma", "from flatbma"))
    ]
    assert statements, "the README shows no flatbma import"
    for line in statements:
        exec(line, {})


def _resolve(dotted: str) -> object:
    """The object a dotted ``flatbma.a.b.c`` names: the longest importable module, then attributes."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(dotted)


def test_readme_dotted_names_resolve():
    text = "\n".join(doc.read_text() for doc in DOCUMENTS)
    dotted = sorted(set(re.findall(r"\bflatbma(?:\.[A-Za-z_]\w*)+", text)))
    assert dotted, "the README names no flatbma.x"
    unresolved = []
    for name in dotted:
        try:
            _resolve(name)
        except (AttributeError, ModuleNotFoundError):
            unresolved.append(name)
    assert not unresolved, f"README names that do not exist: {unresolved}"


def test_readme_top_level_names_are_exported():
    """What the README's code reaches as ``flatbma.x`` after ``import flatbma`` is in ``flatbma.__all__``."""
    lines = [line for block in _readme_python() for line in block.splitlines()]
    code = [line for line in lines if not line.startswith(("import", "from"))]
    used = set(re.findall(r"\bflatbma\.([A-Za-z_]\w*)", "\n".join(code)))
    assert used and used <= set(flatbma.__all__)
