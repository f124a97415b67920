"""The amortization options in configs: resolved only when given, refused where they cannot apply (one line
through the CLI), grids in compare entries, and a run stopped in mid-cycle resumes bit-identically."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import yaml

from flatbma.experiment.cli import main
from flatbma.experiment.config import entries
from flatbma.experiment.config.run_config import config_from_dict
from flatbma.experiment.run.pipeline import train
from flatbma.experiment.run.stage import run_identity
from flatbma.experiment.study.plan import load_plan
from flatbma.methods import parse_method
from flatbma.optim import SAM, Amortized, FisherBall, Reuse
from flatbma.options import plain_values
from tests.helpers import interrupt_after_first_epoch, load_state

AMORTIZED = {"ascent_every": 5, "reuse": "orthogonal", "reuse_alpha": 0.7, "ascent_fraction": 1.0}


def test_the_options_resolve_only_when_given():
    assert plain_values(parse_method({"name": "sam"}).to_dict()) == {"name": "sam", "rho": 0.05}
    method = parse_method({"name": "sam", "ascent_every": 5})
    assert method.ascent == Amortized(SAM(0.05), ascent_every=5)
    assert plain_values(method.to_dict()) == {"name": "sam", "rho": 0.05, **AMORTIZED}
    method = parse_method({"name": "fp-bma", "gamma": 0.1, "reuse": "none", "ascent_fraction": 0.5})
    assert method.ascent == Amortized(FisherBall(gamma=0.1), reuse=Reuse.NONE, ascent_fraction=0.5)
    resolved = plain_values(method.to_dict())
    assert resolved["gamma"] == 0.1 and resolved["reuse"] == "none" and resolved["ascent_every"] == 1
    assert parse_method(resolved) == method  # a resolved section parses back to the same method


def test_multi_takes_them_in_its_members_section():
    method = parse_method({"name": "multi-fp-bma", "of": {"name": "fp-bma", "ascent_every": 5}})
    assert method.options["of"].ascent == Amortized(FisherBall(), ascent_every=5)


def test_compare_entries_take_candidate_lists_of_them():
    entry = {"name": "sam", "ascent_every": [1, 5], "reuse": ["orthogonal", "none"]}
    assert len(entries.points(entry, "compare.methods[0]")) == 4


DIGITS = {
    "seed": 1,
    "method": {"name": "sam"},
    "data": {"name": "digits", "batch_size": 128},
    "model": {"name": "mlp", "width": 16},
    "optim": {"lr": 0.05},
    "train": {"epochs": 2, "progress": False},
    "eval": {"num_samples": 1},
}


@pytest.mark.parametrize(
    ("method", "expected"),
    [
        ({"name": "sam", "ascent_every": 0}, "method.ascent_every must be an integer >= 1"),
        ({"name": "f-swag", "ascent_every": True}, "method.ascent_every must be an integer"),
        ({"name": "fp-bma", "ascent_fraction": 0}, "method.ascent_fraction must be a number in (0, 1]"),
        ({"name": "f-mfvi", "ascent_fraction": 1.5}, "method.ascent_fraction must be a number in (0, 1]"),
        ({"name": "sam", "reuse": "orthogonl"}, "Did you mean 'orthogonal'?"),
        ({"name": "asam", "reuse_alpha": -0.5}, "method.reuse_alpha must be a number >= 0"),
        ({"name": "swag", "ascent_every": 5}, "method.ascent_every: method 'swag' has no ascent step"),
        ({"name": "sgd", "ascent_fraction": 0.5}, "method 'sgd' has no ascent step"),
        ({"name": "multiswag", "ascent_every": 5}, "give it in method.of"),
    ],
)
def test_refusals_are_one_line_cli_errors(tmp_path, capsys, method, expected):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({**DIGITS, "method": method, "output_dir": str(tmp_path / "run")}))
    assert main(["train", "--config", str(path)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("flatbma: error: "), lines
    assert expected in lines[0]
    assert not (tmp_path / "run").exists()


def test_a_run_stopped_in_mid_cycle_resumes_bit_identically(tmp_path, monkeypatch):
    method = {"name": "fp-bma", "rank": 3, "gamma": 0.05, "ascent_every": 4, "ascent_fraction": 0.5}
    cfg = config_from_dict({**DIGITS, "method": method, "optim": {"name": "adam", "lr": 0.01}})
    reference = train(dataclasses.replace(cfg, output_dir=str(tmp_path / "ref")), evaluate=False)

    stopped = dataclasses.replace(cfg, output_dir=str(tmp_path / "run"))
    interrupt_after_first_epoch(monkeypatch)  # at an epoch end
    with pytest.raises(KeyboardInterrupt):
        train(stopped, evaluate=False)
    saved = load_state(tmp_path / "run" / "checkpoint.safetensors")
    assert saved.step % 4 != 0 and int(saved.aux["ascent/position"]) == saved.step % 4  # in mid-cycle
    resumed = train(stopped, resume=True, evaluate=False)
    for part in ("params", "buffers", "aux"):
        a, b = getattr(reference.state, part), getattr(resumed.state, part)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), part


def test_the_reuse_studys_full_methods_are_the_flatness_studys_runs():
    """configs/reuse-study.yaml's sam and fp-bma runs are the flatness study's (its finished runs are reused)."""
    configs = Path(__file__).resolve().parents[2] / "configs"

    def identities(path):
        return {
            (job.label, job.seed, n): run_identity(json.loads(json.dumps(c.config.to_dict(), default=str)))
            for job in load_plan(path).jobs()
            for n, c in enumerate(job.candidates)
        }

    flatness, reuse = identities(configs / "flatness-study.yaml"), identities(configs / "reuse-study.yaml")
    shared = [key for key in reuse if key[0] in ("sam", "fp-bma")]
    assert len(shared) == 2 * 3 * 3  # two methods, three seeds, three candidates each
    assert all(reuse[key] == flatness[key] for key in shared)
    for label in ("sam-k5", "f-swag-k5", "fp-bma-k5"):  # the variants differ from their method by the option alone
        variant = next(v for k, v in reuse.items() if k[0] == label)
        assert variant["method"]["ascent_every"] == 5 and variant["method"]["reuse"] == "orthogonal"
