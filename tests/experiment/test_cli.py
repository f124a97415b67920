import json
import subprocess
import sys

import pytest
import yaml

from flatbma.experiment.cli import main

DIGITS = {
    "seed": 0,
    "method": {"name": "sam", "rho": 0.05},
    "data": {"name": "digits", "batch_size": 64},
    "model": {"name": "mlp"},
    "optim": {"lr": 0.05},
    "train": {"epochs": 8, "progress": False},
    "eval": {"num_samples": 1},
}


def _write(tmp_path, cfg, name="c.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def _run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_methods_lists_the_sam_family():
    out = subprocess.run(
        [sys.executable, "-m", "flatbma", "methods"], capture_output=True, text=True, check=True
    ).stdout
    names = [line.split()[0] for line in out.splitlines()]
    assert {"sgd", "sam", "asam", "fsam"} <= set(names)


def test_train_then_evaluate_on_digits(tmp_path, capsys):
    out_dir = tmp_path / "run"
    cfg = _write(tmp_path, DIGITS)
    code, out, err = _run(capsys, "train", "--config", cfg, "--set", f"output_dir={out_dir}")
    assert code == 0, err
    metrics = json.loads((out_dir / "metrics.json").read_text())
    for key in ("accuracy", "nll", "ece", "aece", "brier", "train_time_s", "environment"):
        assert key in metrics
    assert metrics["accuracy"] > 0.85
    assert (out_dir / "checkpoint.safetensors").is_file()
    resolved = yaml.safe_load((out_dir / "config.yaml").read_text())
    assert resolved["method"] == {"name": "sam", "rho": 0.05}
    code, out, err = _run(capsys, "evaluate", str(out_dir))
    assert code == 0, err
    again = json.loads((out_dir / "metrics.json").read_text())
    for key in ("accuracy", "nll", "ece", "brier"):
        assert again[key] == pytest.approx(metrics[key], rel=1e-6)
    # same config + seed -> identical metrics
    code, _, err = _run(capsys, "train", "--config", cfg, "--set", f"output_dir={tmp_path / 'run2'}")
    assert code == 0, err
    rerun = json.loads((tmp_path / "run2" / "metrics.json").read_text())
    assert all(rerun[k] == metrics[k] for k in ("accuracy", "nll", "ece", "brier"))


def _error(capsys, *argv):
    code, out, err = _run(capsys, *argv)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("flatbma: error: "), err
    return lines[0]


def test_bad_inputs_give_one_line_errors(tmp_path, capsys):
    cfg = _write(tmp_path, DIGITS)
    out = f"output_dir={tmp_path / 'x'}"
    assert "Did you mean 'sam'" in _error(capsys, "train", "--config", cfg, "--set", "method.name=sma")
    assert "Did you mean 'epochs'" in _error(capsys, "train", "--config", cfg, "--set", "train.epoch=2")
    msg = _error(
        capsys,
        "train",
        "--config",
        cfg,
        "--set",
        out,
        "--set",
        "data.name=idx",
        "--set",
        f"data.root={tmp_path / 'missing'}",
    )
    assert "idx" in msg or "missing" in msg
    msg = _error(capsys, "train", "--config", cfg, "--set", out, "--set", "data.k_shot=1000")
    assert "k" in msg
    _error(capsys, "train", "--config", str(tmp_path / "nope.yaml"))
    _error(capsys, "evaluate", str(tmp_path))
    _error(capsys, "frobnicate")


def test_divergence_stops_and_keeps_last_good_checkpoint(tmp_path, capsys):
    cfg = _write(tmp_path, {**DIGITS, "method": {"name": "sgd"}, "optim": {"lr": 1e12, "schedule": "constant"}})
    msg = _error(
        capsys, "train", "--config", cfg, "--set", f"output_dir={tmp_path / 'div'}", "--set", "train.checkpoint_every=1"
    )
    assert "at step" in msg and "the last checkpoint is kept: resume with" in msg and "--set optim.lr=" in msg
    assert not (tmp_path / "div" / "metrics.json").exists()


def test_run_dir_with_another_config_is_not_overwritten(tmp_path, capsys):
    cfg = _write(tmp_path, DIGITS)
    out = f"output_dir={tmp_path / 'run'}"
    assert _run(capsys, "train", "--config", cfg, "--set", out)[0] == 0
    before = (tmp_path / "run" / "metrics.json").read_text()
    msg = _error(capsys, "train", "--config", cfg, "--set", out, "--set", "optim.lr=0.01")
    assert "--force" in msg
    assert (tmp_path / "run" / "metrics.json").read_text() == before
    assert _run(capsys, "train", "--config", cfg, "--set", out, "--set", "optim.lr=0.01", "--force")[0] == 0


def test_version_and_method_options(capsys):
    import flatbma
    from flatbma.experiment.cli import main
    from flatbma.methods import METHODS, parse_method

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.startswith(f"flatbma {flatbma.__version__} ")
    assert main(["methods", "fp-bma"]) == 0
    out = capsys.readouterr().out
    defaults = parse_method("fp-bma")
    table = out.split("\n\n")[0]  # the option rows; the ascent step's notes follow a blank line
    rows = {line.split()[0]: line.split()[1] for line in table.splitlines()[2:]}
    assert rows["gamma"] == repr(defaults.ascent.gamma) and rows["rank"] == repr(defaults.options["rank"])
    assert "fisher | euclidean | data-fisher" in out  # an Enum option lists its spellings
    for name in METHODS:  # every registered method describes itself
        assert main(["methods", name]) == 0
    capsys.readouterr()
    assert main(["methods", "fpbma"]) == 2
    assert "Did you mean 'fp-bma'?" in capsys.readouterr().err


def test_flatbma_warnings_are_one_line_and_other_libraries_are_not_shown(capsys, monkeypatch):
    """A FlatbmaWarning prints as one line ``flatbma: warning: ...``, a line break in it escaped (a path quoted in it
    may hold one: #38 — the line was cut there); torch's or matplotlib's do not print (#23)."""
    import warnings

    from flatbma.errors import FlatbmaWarning
    from flatbma.experiment import cli

    def describe(name: str) -> str:
        warnings.warn("Detected pickle protocol 5 in the checkpoint", UserWarning, stacklevel=1)  # as torch does
        warnings.warn("the solver stopped early\nsecond line", FlatbmaWarning, stacklevel=1)
        return name

    monkeypatch.setattr(cli, "_describe_method", describe)
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        code, out, err = _run(capsys, "methods", "sgd")
    assert code == 0 and out == "sgd\n"
    assert err == "flatbma: warning: the solver stopped early\\nsecond line\n"
