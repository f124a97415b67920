"""Imports point downward: every module of flatbma imports only its own unit or units of a lower layer.

The layers (``../shared/STYLE.md``: shared maths below the methods that use it, the experiment layer on
top) are read from the import statements of the source files — module level and inside functions alike,
``if TYPE_CHECKING`` blocks included — so a new upward import fails here with the offending edge.
Within a unit, no modules import each other in a circle, and the experiment layer's subpackages
(``config/``, ``parallel/``, ``run/``, ``report/``, ``study/``, then ``api``/``cli``) import one way.
"""

import ast
import re
from pathlib import Path

import flatbma

SRC = Path(flatbma.__file__).parent

LAYERS: dict[str, int] = {
    "errors": 0,
    "checks": 1,
    "options": 2,
    "rng": 1,
    "types": 1,
    "named": 1,
    "calibration": 1,
    "stats": 1,
    "health": 1,
    "progress": 1,
    "loop": 2,
    "packed": 2,
    "jacobians": 2,
    "metrics": 2,
    "metric_names": 1,
    "regression": 2,
    "plotting": 2,
    "data": 2,
    "models": 2,
    "precision": 2,
    "params": 3,
    "bn": 3,
    "transfer": 3,
    "batching": 3,
    "linearized": 3,
    "predict": 4,
    "gaussian": 4,
    "state_io": 2,
    "predictor_file": 3,
    "likelihood": 3,
    "predictor": 5,
    "ood": 5,
    "optim": 5,
    "curvature": 5,
    "flatness": 5,
    "family": 2,
    "posteriors": 6,
    "methods": 7,
    "prior": 8,
    "training": 8,
    "fit": 9,
    "experiment": 10,
    "": 11,  # the package's __init__: the public API re-exports every library layer
    "__main__": 12,
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


def test_the_library_never_imports_the_experiment_layer():
    """The library — every unit but ``experiment`` and the CLI's entry point ``__main__`` — trains, predicts and
    reloads without it: ``flatbma.fit_posterior`` goes through :mod:`flatbma.training`, as ``flatbma train`` does."""
    up = [f for f, a, b in _edges() if b == "experiment" and a not in ("experiment", "__main__")]
    assert not up, "the library reaches up into the experiment layer: " + ", ".join(up)


def test_the_check_sees_imports():
    edges = _edges()
    assert ("optim/fisher_ball.py", "optim", "gaussian") in edges
    assert any(a == "experiment" and b == "posteriors" for _, a, b in edges)


EXPERIMENT_LAYERS: dict[str, int] = {
    "config": 0,
    "parallel": 1,
    "run": 2,
    "report": 3,
    "study": 4,
    "cli": 5,
    "__main__": 6,
}
"""The experiment layer's subpackages and top modules by layer, lowest first (``flatbma.experiment``'s docstring)."""


def _modules() -> dict[str, Path]:
    modules = {}
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC.parent).with_suffix("")
        modules[".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)] = path
    return modules


def _module_edges() -> dict[str, set[str]]:
    """``importer -> imported modules`` for every flatbma import, ``from package import module`` read as the module."""
    modules = _modules()
    edges: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    target = ".".join([*base, node.module] if node.module else base)
                else:
                    target = node.module or ""
                targets = [target] + [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in modules]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            edges[module] |= {t for t in targets if t in modules and t != module}
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_module_imports_itself_through_others():
    # Package __init__ files that re-export their modules are leaves of the cycle check: a module importing
    # its package's __init__ (which imports it back) is how Python packages work, not a circle of concerns.
    edges = _module_edges()
    packages = {m for m, p in _modules().items() if p.name == "__init__.py"}
    edges = {m: {t for t in ts if t not in packages} for m, ts in edges.items()}
    assert not _cycles(edges), f"modules importing each other in a circle: {_cycles(edges)}"


def test_the_cycle_check_sees_cycles():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def _experiment_part(module: str) -> str:
    parts = module.split(".")
    return parts[2] if len(parts) > 2 else ""


def test_experiment_subpackages_import_one_way():
    parts = {_experiment_part(m) for m in _modules() if _unit(m) == "experiment"} - {""}
    assert parts <= set(EXPERIMENT_LAYERS), f"give these a layer: {sorted(parts - set(EXPERIMENT_LAYERS))}"
    wrong = [
        f"{a} imports {b}"
        for a, targets in _module_edges().items()
        if _unit(a) == "experiment" and _experiment_part(a)
        for b in targets
        if _unit(b) == "experiment"
        and _experiment_part(b)
        and _experiment_part(b) != _experiment_part(a)
        and EXPERIMENT_LAYERS[_experiment_part(b)] >= EXPERIMENT_LAYERS[_experiment_part(a)]
    ]
    assert not wrong, "experiment imports pointing up or sideways:\n" + "\n".join(sorted(wrong))


def test_the_experiment_check_sees_imports():
    edges = _module_edges()
    assert "flatbma.experiment.run.evaluate" in edges["flatbma.experiment.study.compare"]
    assert "flatbma.experiment.parallel.processes" in edges["flatbma.experiment.run.build"]


COMPONENT_NAMES = re.compile(
    r"^(member\d*|point|swag|laplace|samples|sgld|ascent|orthogonal|momentum|mean|log_std|factor|rho|precision|bsam|ivon|hess"
    r"|rng|amp)/"
)
"""Names the families keep a component's state (or ``θ``'s sections) under: only posteriors/ and below read them."""

STATE_NAME_HELPERS = {"flatbma.named", "flatbma.posteriors.members"}
"""Modules whose functions take a composed state apart by its components' names."""


def _reads_component_names(text: str, where: str) -> list[str]:
    """Where ``text`` (a module's source) spells a component's state name or imports a helper that reads them."""
    found = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and COMPONENT_NAMES.match(node.value):
            found.append(f"{where}:{node.lineno}: the key {node.value[:40]!r}")
        elif isinstance(node, ast.ImportFrom) and node.module in STATE_NAME_HELPERS:
            found.append(f"{where}:{node.lineno}: imports {node.module}")
        elif isinstance(node, ast.Import) and any(a.name in STATE_NAME_HELPERS for a in node.names):
            found.append(f"{where}:{node.lineno}: imports a state-name helper")
    return found


def _unit_of(path: Path) -> str:
    rel = path.relative_to(SRC.parent).with_suffix("")
    return _unit(".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts))


def test_nothing_above_the_families_reads_a_components_state_by_its_name():
    """optax's ``named_chain``: a composed method's components keep their state under their names (#24, item 3);
    the experiment layer goes through the ``Posterior`` hooks, never through ``aux`` key prefixes."""
    above = [p for p in sorted(SRC.rglob("*.py")) if LAYERS[_unit_of(p)] > LAYERS["posteriors"]]
    assert any(_unit_of(p) == "experiment" for p in above)
    found = [line for p in above for line in _reads_component_names(p.read_text(), str(p.relative_to(SRC)))]
    assert not found, "reads of a component's state by name above posteriors/:\n" + "\n".join(found)


def test_the_component_name_check_sees_reads():
    text = 'from flatbma.posteriors.members import member\nk = "swag/mean/"\nok = "train/loss"\n'
    assert _reads_component_names(text, "x.py") == [
        "x.py:1: imports flatbma.posteriors.members",
        "x.py:2: the key 'swag/mean/'",
    ]


LONG_FILE = 550  # lines; a module this long says at the top of its docstring why it is one room
LONG_FILE_REASON = "Over 500 lines on purpose:"


def _long_files_without_a_reason(sources: dict[str, str]) -> list[str]:
    """The sources of more than :data:`LONG_FILE` lines whose module docstring does not say why they are one room."""
    missing = []
    for name, text in sorted(sources.items()):
        if len(text.splitlines()) <= LONG_FILE:
            continue
        docstring = ast.get_docstring(ast.parse(text)) or ""
        if LONG_FILE_REASON not in docstring:
            missing.append(f"{name} ({len(text.splitlines())} lines)")
    return missing


def test_every_long_file_says_why_it_is_one_room():
    sources = {str(path.relative_to(SRC)): path.read_text(encoding="utf-8") for path in sorted(SRC.rglob("*.py"))}
    missing = _long_files_without_a_reason(sources)
    assert not missing, (
        f"split these modules, or begin a paragraph of the module docstring with {LONG_FILE_REASON!r}: {missing}"
    )


def test_the_long_file_check_sees_long_files():
    body = "x = 1\n" * (LONG_FILE + 1)
    assert _long_files_without_a_reason({"long.py": '"""A module."""\n' + body}) == [f"long.py ({LONG_FILE + 2} lines)"]
    assert _long_files_without_a_reason({"short.py": '"""A module."""\nx = 1\n'}) == []
    reasoned = f'"""A module.\n\n{LONG_FILE_REASON} one room.\n"""\n' + body
    assert _long_files_without_a_reason({"long.py": reasoned}) == []
