"""Damaged files of an earlier ``flatbma compare`` end in one line naming the file and the way out (issue #13).

A rerun reuses ``compare_config.yaml`` (which config the directory holds), each row's ``compare.json``,
and each finished run's ``config.yaml`` and ``metrics.json``. A truncated, unreadable or wrong-typed one
printed a traceback (or was silently redone); now it is refused by name, and deleting it or ``--force``
starts over.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from flatbma.errors import FlatbmaError
from flatbma.experiment.cli import main
from flatbma.experiment.config.run_config import config_from_dict
from flatbma.experiment.run.evaluate import CLEAN_KEYS
from flatbma.experiment.study import cache, compare, plan, selection
from flatbma.state_io import sealed
from tests.helpers import DONE

CONFIG = {
    "data": {"name": "digits", "batch_size": 64, "test_limit": 100},
    "model": {"name": "mlp", "width": 8},
    "optim": {"lr": 0.05},
    "train": {"epochs": 1, "progress": False},
    "eval": {"num_samples": 2, "n_bins": 5, "hessian_examples": 16, "hessian_max_iter": 5},
    "compare": {
        "methods": [{"name": "sgd"}],
        "seeds": [0],
        "corruptions": [],
        "bma_curve": [1],
        "flatness": False,
        "landscape": False,
    },
}
ROW = Path("runs/sgd/seed0")


def _config(tmp_path: Path, out: Path) -> str:
    path = tmp_path / "compare.yaml"
    path.write_text(yaml.safe_dump({**CONFIG, "output_dir": str(out)}))
    return str(path)


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A finished comparison (one method, one seed) and a pristine copy of it."""
    root = tmp_path_factory.mktemp("finished")
    assert main(["compare", "--config", _config(root, root / "out")]) in DONE
    shutil.copytree(root / "out", root / "pristine")
    return root / "out", root / "pristine"


@pytest.fixture
def out(finished: tuple[Path, Path]) -> Path:
    """The finished comparison, restored from its copy in place (its runs record their own directory)."""
    out, pristine = finished
    shutil.rmtree(out)
    shutil.copytree(pristine, out)
    return out


def _rerun(tmp_path: Path, out: Path, capsys, *flags: str) -> tuple[int, list[str]]:
    capsys.readouterr()
    code = main(["compare", "--config", _config(tmp_path, out), *flags])
    return code, capsys.readouterr().err.splitlines()


def _laughs(levels: int = 9) -> str:
    lines = ['a0: &a0 "lol"'] + [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


FINGERPRINT = "<fingerprint>"  # replaced by the comparison's own


def _good_row(out: Path) -> dict:
    return json.loads((out / ROW / "compare.json").read_text())


DAMAGE = {
    "compare_config.yaml": [
        lambda good: good[: len(good) // 3] + b"\n- [",  # cut, with the rest of another file
        lambda good: b"- a list\n- not a mapping\n",
        lambda good: b"\xff\xfe\x00\x01",  # not UTF-8
        lambda good: b"fingerprint: [1, 2]\n",  # wrong-typed
        lambda good: _laughs().encode(),  # an expansion bomb: refused by the budget, not expanded
        lambda good: good + b"fingerprint: again\n",  # a duplicate key
    ],
    str(ROW / "compare.json"): [
        lambda good: good[: len(good) // 2],  # truncated JSON
        lambda good: b"[1, 2]",
        lambda good: b"",
        lambda good: json.dumps({"fingerprint": FINGERPRINT, "result": [1]}).encode(),
        lambda good: json.dumps({"fingerprint": FINGERPRINT, "result": {"method": "sgd", "accuracy": "high"}}).encode(),
        lambda good: b"[" * 100_000,  # nested past the recursion limit
    ],
    str(ROW / "config.yaml"): [
        lambda good: good[: len(good) // 3] + b"[",
        lambda good: b"\xff\xfe\x00\x01",
        lambda good: b"just text\n",
    ],
}
CASES = [(name, i) for name, damages in DAMAGE.items() for i in range(len(damages))]


@pytest.mark.parametrize(("name", "i"), CASES, ids=[f"{Path(n).name}-{i}" for n, i in CASES])
def test_a_damaged_file_is_one_line_naming_it(tmp_path: Path, out: Path, capsys, name: str, i: int) -> None:
    path = out / name
    fingerprint = _good_row(out)["fingerprint"]
    path.write_bytes(DAMAGE[name][i](path.read_bytes()).replace(FINGERPRINT.encode(), fingerprint.encode()))
    stamp = (out / ROW / "checkpoint.safetensors").stat().st_mtime_ns
    code, err = _rerun(tmp_path, out, capsys)
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"flatbma: error: {path} is damaged (") and "--force" in err[0]
    assert ("delete it" in err[0]) == (path.name != "compare_config.yaml"), err[0]  # without it: not a compare dir
    assert len(err[0]) < 400
    assert (out / ROW / "checkpoint.safetensors").stat().st_mtime_ns == stamp  # nothing retrained


@pytest.mark.parametrize("content", [b"{bad", b"[1]", b"\xff"])
def test_a_damaged_metrics_json_that_compare_reuses(tmp_path: Path, out: Path, capsys, content: bytes) -> None:
    """Without its row cache, a finished run is measured again from its checkpoint and its metrics.json."""
    (out / ROW / "compare.json").unlink()
    (out / ROW / "metrics.json").write_bytes(content)
    code, err = _rerun(tmp_path, out, capsys)
    assert code == 2 and len(err) == 1 and f"{out / ROW / 'metrics.json'} is damaged" in err[0], err


def test_deleting_the_damaged_file_or_force_starts_over(tmp_path: Path, out: Path, capsys) -> None:
    results = json.loads((out / "results.json").read_text())
    stamp = (out / ROW / "checkpoint.safetensors").stat().st_mtime_ns
    (out / ROW / "compare.json").write_bytes(b"{")
    (out / ROW / "config.yaml").write_bytes(b"\xff")
    assert _rerun(tmp_path, out, capsys)[0] == 2
    (out / ROW / "config.yaml").write_bytes((out.parent / "pristine" / ROW / "config.yaml").read_bytes())
    code, err = _rerun(tmp_path, out, capsys)
    assert code == 2 and "compare.json is damaged" in err[-1]  # the next damaged file is named
    (out / ROW / "compare.json").unlink()  # the way out the message names: delete it
    assert _rerun(tmp_path, out, capsys)[0] in DONE  # measured again from the kept checkpoint, not retrained
    assert (out / ROW / "checkpoint.safetensors").stat().st_mtime_ns == stamp
    (again,) = json.loads((out / "results.json").read_text())["runs"]
    assert {k: again[k] for k in CLEAN_KEYS} == {k: results["runs"][0][k] for k in CLEAN_KEYS}  # the same numbers
    # ... or --force: every damaged file is ignored and written anew
    (out / ROW / "compare.json").write_bytes(b"{")
    (out / ROW / "config.yaml").write_bytes(b"\xff")
    (out / "compare_config.yaml").write_bytes(b"[")
    assert _rerun(tmp_path, out, capsys, "--force")[0] in DONE
    recorded = yaml.safe_load((out / "compare_config.yaml").read_text())
    loaded = plan.load_plan(_config(tmp_path, out))
    assert recorded["fingerprint"] == loaded.fingerprint() and recorded["study"] == loaded.study()
    assert _good_row(out)["fingerprint"] == loaded.row_key(loaded.jobs()[0])
    assert yaml.safe_load((out / ROW / "config.yaml").read_text())["method"]["name"] == "sgd"


def test_a_stale_row_of_another_comparison_is_measured_again(tmp_path: Path, out: Path, capsys) -> None:
    """A readable row of another config (another fingerprint, sealed as flatbma writes it) is not damage: it is
    redone without a word."""
    row = _good_row(out)
    row["fingerprint"] = "0" * 16
    row["result"]["accuracy"] = -1.0
    (out / ROW / "compare.json").write_text(json.dumps(sealed(row)))
    assert _rerun(tmp_path, out, capsys)[0] in DONE
    assert _good_row(out)["result"]["accuracy"] >= 0


@pytest.mark.parametrize(
    "content",
    [b"{", b"[]", json.dumps({"config": {}, "val_nll": "low", "train_time_s": 1, "error": None}).encode(), b"{}"],
)
def test_a_damaged_candidate_record_is_named(tmp_path: Path, content: bytes) -> None:
    """``candidate.json`` (a candidate's validation score) is read the same way."""
    run = {k: v for k, v in CONFIG.items() if k != "compare"}
    cfg = config_from_dict({**run, "method": {"name": "sgd"}, "output_dir": str(tmp_path / "cand")})
    (tmp_path / "cand").mkdir()
    (tmp_path / "cand" / cache.CANDIDATE_FILE).write_bytes(content)
    with pytest.raises(FlatbmaError, match=r"candidate\.json is damaged .*--force"):
        selection.candidate_record(cfg)


def test_a_moved_comparison_is_reused_in_its_new_place(finished, tmp_path, monkeypatch):
    """Runs record their directory, but where a comparison lies is not part of what it computed (stage.run_identity)."""
    _, pristine = finished
    moved = tmp_path / "moved"
    shutil.copytree(pristine, moved)

    def no_training(*args, **kwargs):
        raise AssertionError("a finished run of a moved comparison was trained again")

    monkeypatch.setattr(compare, "train", no_training)
    monkeypatch.setattr(selection, "train_stage", no_training)
    assert main(["compare", "--config", _config(tmp_path, moved), "--quiet"]) in DONE
    before = json.loads((pristine / "results.json").read_text())["runs"]
    after = json.loads((moved / "results.json").read_text())["runs"]
    assert [{k: r[k] for k in CLEAN_KEYS} for r in after] == [{k: r[k] for k in CLEAN_KEYS} for r in before]
    assert [Path(r["run_dir"]) for r in after] == [moved / ROW]  # the rows say where they are now


def test_a_moved_comparison_with_selection_is_reused_in_its_new_place(tmp_path, monkeypatch):
    cfg = {
        **CONFIG,
        "data": {"name": "digits", "k_shot": 10, "val_per_class": 2, "batch_size": 20, "test_limit": 100},
        "compare": {**CONFIG["compare"], "methods": [{"name": "sam", "rho": [0.01, 0.05]}]},
    }
    first, moved = tmp_path / "first", tmp_path / "moved"
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({**cfg, "output_dir": str(first)}))
    assert main(["compare", "--config", str(path), "--quiet"]) in DONE
    shutil.copytree(first, moved)

    def no_work(*args, **kwargs):
        raise AssertionError("a moved comparison trained or measured again")

    for module, name in [(compare, "train"), (compare, "measure"), (compare, "load_run")]:
        monkeypatch.setattr(module, name, no_work)
    for name in ("train_stage", "load_run"):
        monkeypatch.setattr(selection, name, no_work)
    assert main(["compare", "--config", str(path), "--set", f"output_dir={moved}", "--quiet"]) in DONE
    [before] = json.loads((first / "results.json").read_text())["runs"]
    [after] = json.loads((moved / "results.json").read_text())["runs"]
    assert {k: after[k] for k in CLEAN_KEYS} == {k: before[k] for k in CLEAN_KEYS}
    assert after["selection"]["chosen"] == before["selection"]["chosen"]
    dirs = [after["run_dir"], *(c["run_dir"] for c in after["selection"]["candidates"])]
    assert all(Path(d).is_relative_to(moved) for d in dirs), dirs


def test_a_study_grows_in_place_reusing_its_finished_rows(tmp_path: Path, out: Path, capsys) -> None:
    """More methods and seeds in the same output_dir: finished rows are neither retrained nor measured again.

    The row caches are keyed by the measurement settings and the row's label (``Plan.row_key``), not by
    the whole comparison, and the directory guard compares only what every row shares (``Plan.study``).
    """
    before = json.loads((out / "results.json").read_text())["runs"][0]
    stamps = {f: (out / ROW / f).stat().st_mtime_ns for f in ("checkpoint.safetensors", "compare.json")}
    grown = {**CONFIG, "output_dir": str(out)}
    grown["compare"] = {
        **CONFIG["compare"],
        "methods": [{"name": "sgd"}, {"name": "sam", "rho": 0.05}],
        "seeds": [0, 1],
    }
    path = tmp_path / "grown.yaml"
    path.write_text(yaml.safe_dump(grown))
    assert main(["compare", "--config", str(path)]) in DONE
    assert {f: (out / ROW / f).stat().st_mtime_ns for f in stamps} == stamps  # the finished row: untouched
    runs = json.loads((out / "results.json").read_text())["runs"]
    assert [(r["method"], r["seed"]) for r in runs] == [("sgd", 0), ("sgd", 1), ("sam", 0), ("sam", 1)]
    assert {k: runs[0][k] for k in CLEAN_KEYS} == {k: before[k] for k in CLEAN_KEYS}
    # what every row shares may not change in place: another learning rate is another study
    grown["optim"] = {"lr": 0.1}
    path.write_text(yaml.safe_dump(grown))
    capsys.readouterr()
    assert main(["compare", "--config", str(path)]) == 2
    assert "holds the results of a compare config with other shared sections" in capsys.readouterr().err
