"""No shipped config uses a setting that docs/methods.md §5.3 lists as measured not to act.

The table under that heading is the one list: a row names methods, an option, its inert values (``<= x``, ``< x``
or ``== x``) and the other options it applies with (``key: value``). Every run of every ``configs/*.yaml`` is
checked — each candidate of each compare entry, the members' method (``of``) of a mixture and the method of a
``prior`` stage — except the study configs in :data:`EXEMPT`, which rerun past results with such a setting on
purpose and say so in a comment.
"""

from __future__ import annotations

import dataclasses
import operator
import re
from collections.abc import Iterator
from enum import Enum
from pathlib import Path
from typing import Any

import pytest

from flatbma.experiment.config.run_config import RunConfig, load_config
from flatbma.experiment.study.plan import load_plan
from flatbma.methods import MethodConfig

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
METHODS_MD = ROOT / "docs" / "methods.md"
HEADING = "### 5.3 Settings measured not to act"

EXEMPT = {
    "flatness-study.yaml": "reruns the flatness study, FP-BMA's gamma chosen among 0.01, 0.1, 0.5",
    "basins-study.yaml": "shares the flatness study's FP-BMA runs (tests/experiment/test_study_configs.py)",
    "reuse-study.yaml": "shares the flatness study's FP-BMA runs and adds their k = 5 variants",
}
"""Configs that use an inert setting on purpose, each with the reason; each says so in a comment."""

_OPS = {"<=": operator.le, "<": operator.lt, "==": operator.eq}


@dataclasses.dataclass(frozen=True)
class Rule:
    """One row of the table: ``option`` of ``methods`` is inert where ``op(value, bound)`` and ``when`` holds."""

    methods: frozenset[str]
    option: str
    op: str
    bound: float
    when: tuple[tuple[str, str], ...]

    def matches(self, method: str, values: dict[str, Any]) -> bool:
        value = values.get(self.option)
        if method not in self.methods or not isinstance(value, int | float) or isinstance(value, bool):
            return False
        return _OPS[self.op](value, self.bound) and all(str(values.get(k)) == v for k, v in self.when)


def inert_rules(text: str) -> list[Rule]:
    """The rows of the table under :data:`HEADING` in ``text``."""
    lines = text[text.index(HEADING) :].splitlines()[1:]
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    table = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        table.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    assert table[0][:4] == ["methods", "option", "inert values", "with"], table[0]
    rules = []
    for cells in table[2:]:
        code = [re.findall(r"`([^`]+)`", cell) for cell in cells[:4]]
        op, bound = re.fullmatch(r"(<=|<|==)\s*(\S+)", code[2][0]).groups()
        when = tuple(tuple(pair.split(": ", 1)) for pair in code[3])
        rules.append(Rule(frozenset(code[0]), code[1][0], op, float(bound), when))
    return rules


RULES = inert_rules(METHODS_MD.read_text(encoding="utf-8"))


def method_sections(method: MethodConfig) -> Iterator[MethodConfig]:
    """``method`` and, for a mixture, its members' method (``of``), recursively."""
    yield method
    of = method.options.get("of")
    if isinstance(of, MethodConfig):
        yield from method_sections(of)


def option_values(method: MethodConfig) -> dict[str, Any]:
    """Every resolved option of ``method``: its family's and its ascent step's (through an ``Amortized`` wrapper)."""
    out = dict(method.options)
    ascent = method.ascent
    while ascent is not None and dataclasses.is_dataclass(ascent):
        out.update({f.name: getattr(ascent, f.name) for f in dataclasses.fields(ascent)})
        ascent = getattr(ascent, "ascent", None)
    return {k: v.value if isinstance(v, Enum) else v for k, v in out.items()}


def runs(path: Path, overrides: tuple[str, ...] = ()) -> Iterator[tuple[str, RunConfig]]:
    """Every run of a config: each candidate of each compare entry (first seed: the others differ only by seed)."""
    if "compare:" not in path.read_text():
        yield "run", load_config(path, list(overrides))
        return
    plan = load_plan(path, list(overrides))
    for job in plan.jobs():
        if job.seed == plan.compare.seeds[0]:
            for candidate in job.candidates:
                yield f"{job.label} {candidate.options or ''}".strip(), candidate.config


def violations(path: Path, overrides: tuple[str, ...] = ()) -> list[str]:
    """``"<run>: <method>.<option> = <value> (<op> <bound>)"`` for every inert setting a config's runs use."""
    found = []
    for where, cfg in runs(path, overrides):
        stages = [("", cfg.method)] + ([("prior ", cfg.prior.method)] if cfg.prior is not None else [])
        for stage, top in stages:
            for method in method_sections(top):
                values = option_values(method)
                for rule in RULES:
                    if rule.matches(method.name, values):
                        found.append(
                            f"{where}: {stage}{method.name}.{rule.option} = {values[rule.option]} "
                            f"({rule.op} {rule.bound:g}, docs/methods.md §5.3)"
                        )
    return found


def test_the_table_lists_fp_bma_s_gamma():
    rule = next(r for r in RULES if r.option == "gamma")
    assert rule.methods == {"fp-bma", "sa-bma"} and (rule.op, rule.bound) == ("<=", 0.5)
    assert dict(rule.when) == {"metric": "fisher", "blocks": "all"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_no_shipped_config_uses_an_inert_setting(path):
    found = violations(path)
    if path.name in EXEMPT:
        assert found, f"{path.name} is exempt ({EXEMPT[path.name]}) but uses no inert setting: drop the exemption"
        assert "docs/methods.md §5.3" in path.read_text(), f"{path.name} must say in a comment why it is exempt"
    else:
        assert not found, f"{path.name} uses settings docs/methods.md §5.3 lists as inert: {found}"


CIFAR10 = ROOT / "configs" / "cifar10-resnet18-10shot.yaml"


def entry_violations(entry: str) -> list[str]:
    """:func:`violations` of the CIFAR-10 config with ``entry`` as its only compared method."""
    return violations(CIFAR10, (f"compare.methods=[{entry}]", "compare.pairs=[]", "compare.reference=null"))


@pytest.mark.parametrize(
    ("entry", "caught"),
    [
        ("{name: fp-bma, rank: 5, init_std: 0.01, gamma: 0.01}", True),  # the CIFAR configs' former entry
        ("{name: sa-bma, gamma: [0.5, 1.0]}", True),  # one inert candidate of a grid
        ("{name: multi-fp-bma, members: 2, of: {name: fp-bma, gamma: 0.1}}", True),  # a mixture's members
        ("{name: fp-bma, gamma: 0.1, ascent_every: 5}", True),  # through the Amortized wrapper
        ("{name: fp-bma, gamma: 1.0}", False),
        ("{name: fp-bma, gamma: 0.1, blocks: mean}", False),  # another budget: not what was measured
        ("{name: fp-bma, gamma: 0.1, metric: euclidean}", False),  # γ = ρ²/2 on θ: another scale
        ("{name: fp-bma, radius: 0.01}", False),
    ],
)
def test_the_check_catches_inert_entries(entry, caught):
    found = entry_violations(entry)
    assert bool(found) == caught, found


def test_the_check_reads_prior_stages(monkeypatch):
    """A prior stage's method is checked too (no row names a prior method today: a row made up for the test)."""
    monkeypatch.setitem(globals(), "RULES", [Rule(frozenset({"swag"}), "rank", "==", 5.0, ())])
    entry = "{name: fp-bma, rank: 5, prior: {method: {name: swag, rank: 5, start_step: 12, collect_every: 2}}}"
    found = entry_violations(entry)
    assert found and all("prior swag.rank" in f for f in found), found
