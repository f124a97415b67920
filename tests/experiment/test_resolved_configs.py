"""The resolved config of every shipped config's runs and of every method's defaults is unchanged.

``flatbma compare`` reuses a finished run only when its resolved config (``config.yaml`` in its run
directory, :func:`flatbma.experiment.run.stage.run_identity`) is identical, and long studies depend on that:
a new option must not show in the resolved config of a run that does not use it. The fixture holds a
hash of every resolved run config of ``configs/*.yaml`` (each compare run, every candidate) and of each
registered method's default section: the configs and methods that existed before the options of issue #16
(``ascent_every``, ...) as the code resolved them then (cross-checked against the unmodified tree), the
ones added since as they were first resolved. A config or method whose resolution changes on purpose gets
its fixture line rewritten (a new config or method gets one):

    PYTHONPATH=src python tests/experiment/test_resolved_configs.py --write
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest

from flatbma.experiment.config.run_config import load_config
from flatbma.experiment.run.stage import run_identity
from flatbma.experiment.study.plan import load_plan
from flatbma.methods import METHODS, parse_method

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = Path(__file__).with_name("fixtures") / "resolved_configs.json"


def digest(resolved: object) -> str:
    """Short hash of a resolved config (as it is written to a run directory's config.yaml: JSON values)."""
    text = json.dumps(run_identity(json.loads(json.dumps(resolved, default=str))), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def resolved_digests(names: list[str] | None = None) -> dict[str, str]:
    """``{"<config>#run": hash, "<config>#<label> seed<s> [<n>]": hash, "method:<name>": hash}``."""
    out: dict[str, str] = {}
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        if names is not None and path.name not in names:
            continue
        out[f"{path.name}#run"] = digest(load_config(path).to_dict())
        if "compare:" in path.read_text():
            plan = load_plan(path)
            for job in plan.jobs():
                for n, candidate in enumerate(job.candidates):
                    out[f"{path.name}#{job.label} seed{job.seed} [{n}]"] = digest(candidate.config.to_dict())
    for name in METHODS:
        out[f"method:{name}"] = digest(parse_method(name).to_dict())
    return out


def _snapshot() -> dict[str, str]:
    return json.loads(FIXTURE.read_text())


def test_shipped_configs_resolve_as_before():
    expected = _snapshot()
    configs = sorted({key.partition("#")[0] for key in expected if "#" in key})
    got = resolved_digests(configs)
    changed = sorted(k for k in expected if got.get(k) != expected[k])
    assert not changed, f"resolved configs changed (finished runs would not be reused): {changed[:5]}"


@pytest.mark.parametrize("name", ["sam", "f-swag", "fp-bma", "f-mfvi", "asam", "fsam", "f-sgld", "f-ensemble"])
def test_flat_method_defaults_resolve_as_before(name):
    assert f"method:{name}" in _snapshot()
    assert digest(parse_method(name).to_dict()) == _snapshot()[f"method:{name}"]


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    FIXTURE.parent.mkdir(exist_ok=True)
    FIXTURE.write_text(json.dumps(resolved_digests(), indent=1, sort_keys=True) + "\n")
