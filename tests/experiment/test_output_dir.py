"""Where ``flatbma train`` and ``flatbma compare`` may write (issue #13): :mod:`flatbma.experiment.run.outdir`.

``output_dir: /`` wrote config.yaml, the checkpoint and metrics.json into ``/``; any directory full of
other files was written into without a word. Now: never a file system root, a mount point or the home
directory (not even with ``--force``); a directory holding files only when it is a flatbma directory of
the command's kind, or with ``--force``.
"""

from __future__ import annotations

import contextlib
import io
import os
from pathlib import Path

import pytest
import yaml

from flatbma.errors import FlatbmaError
from flatbma.experiment.cli import main
from flatbma.experiment.run import outdir, stage
from flatbma.experiment.run.outdir import check_compare_output, check_run_output
from tests.helpers import DONE

RUN = {
    "seed": 0,
    "method": {"name": "sgd"},
    "data": {"name": "digits", "test_limit": 100},
    "model": {"name": "mlp", "width": 8},
    "optim": {"lr": 0.05},
    "train": {"epochs": 1, "progress": False},
    "eval": {"num_samples": 1, "hessian_examples": 16},
}
COMPARE = {
    **{k: v for k, v in RUN.items() if k != "method"},
    "compare": {"methods": [{"name": "sgd"}], "seeds": [0], "bma_curve": [1], "flatness": False, "landscape": False},
}


def cli(tmp_path: Path, command: str, config: dict, output_dir: str | Path, *flags: str) -> tuple[int, list[str]]:
    path = tmp_path / f"{command}.yaml"
    path.write_text(yaml.safe_dump({**config, "output_dir": str(output_dir)}))
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = main([command, "--config", str(path), *flags])
    return code, [line for line in err.getvalue().splitlines() if line.startswith("flatbma: error")]


def tree(root: Path) -> dict[str, int]:
    """Every file under ``root`` with its modification time: what a command wrote, and where."""
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in root.rglob("*") if p.is_file()}


@pytest.fixture
def no_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail any run-directory write: a test of a refusal can never write into ``/`` even if it regresses."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a run directory was written")

    monkeypatch.setattr(stage, "write_config", refuse)
    monkeypatch.setattr("flatbma.experiment.study.compare.atomic_write_bytes", refuse)


# ---------------------------------------------------------------------------------------------------
# never: roots, the home directory, mount points


@pytest.mark.parametrize("spelling", ["/", "/tmp/..", "//", "/./"])
@pytest.mark.parametrize("force", [False, True])
def test_the_root_is_refused_even_with_force(spelling: str, force: bool) -> None:
    for check in (check_run_output, check_compare_output):
        with pytest.raises(FlatbmaError, match=r"is a file system root.*--force does not change this"):
            check(spelling, force=force)


def test_a_symlink_to_the_root_is_refused(tmp_path: Path) -> None:
    (tmp_path / "link").symlink_to("/")
    with pytest.raises(FlatbmaError, match=r"link \(that is /\) is a file system root"):
        check_run_output(tmp_path / "link", force=True)


def test_the_home_directory_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    with pytest.raises(FlatbmaError, match="is your home directory"):
        check_run_output(home, force=True)
    with pytest.raises(FlatbmaError, match="is your home directory"):
        check_compare_output(home / "sub" / "..", force=False)  # empty, but still the home directory
    check_run_output(home / "runs" / "run", force=False)  # inside it: fine


def test_a_mount_point_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mounted = tmp_path / "disk"
    mounted.mkdir()
    real_ismount = os.path.ismount
    monkeypatch.setattr(outdir.os.path, "ismount", lambda p: Path(p) == mounted or real_ismount(p))
    with pytest.raises(FlatbmaError, match=r"is a mount point.*such as .*disk/runs/run \("):
        check_run_output(mounted, force=True)
    check_run_output(mounted / "runs" / "run", force=False)


def test_train_into_the_root_is_one_line_and_writes_nothing(tmp_path: Path, no_writes: None) -> None:
    code, err = cli(tmp_path, "train", RUN, "/", "--force")
    assert code == 2 and len(err) == 1 and "output_dir / is a file system root" in err[0], err
    code, err = cli(tmp_path, "compare", COMPARE, "/tmp/..", "--force")
    assert code == 2 and len(err) == 1 and "(that is /) is a file system root" in err[0], err


# ---------------------------------------------------------------------------------------------------
# missing, empty, a file


def test_missing_and_empty_directories_are_fine(tmp_path: Path) -> None:
    for check in (check_run_output, check_compare_output):
        check(tmp_path / "new" / "run", force=False)
        (tmp_path / "empty").mkdir(exist_ok=True)
        check(tmp_path / "empty", force=False)


def test_temporary_files_of_a_killed_write_do_not_count(tmp_path: Path) -> None:
    (tmp_path / ".checkpoint.safetensors.ab3_x9z0.tmp").write_bytes(b"partial")
    (tmp_path / ".config.yaml.k2j4h5g6.tmp").write_bytes(b"partial")
    check_run_output(tmp_path, force=False)
    (tmp_path / ".notes.tmp").write_text("the user's")  # not flatbma's name pattern
    with pytest.raises(FlatbmaError, match="already holds files"):
        check_run_output(tmp_path, force=False)


def test_a_file_is_no_output_dir(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(FlatbmaError, match=r"notes\.txt is a file, not a directory"):
        check_run_output(tmp_path / "notes.txt", force=True)


# ---------------------------------------------------------------------------------------------------
# a directory with files: flatbma's own of the command's kind, or --force


def _run_dir(path: Path, **change: object) -> Path:
    """A directory holding what ``flatbma train`` writes as config.yaml (the resolved config)."""
    from flatbma.experiment.config.run_config import config_from_dict

    path.mkdir(parents=True, exist_ok=True)
    resolved = config_from_dict({**RUN, "output_dir": str(path)}).to_dict() | change
    (path / "config.yaml").write_text(yaml.safe_dump(resolved))
    (path / "metrics.json").write_text("{}")
    return path


def test_a_run_directory_is_a_run_directory(tmp_path: Path) -> None:
    run = _run_dir(tmp_path / "run")
    assert outdir.is_run_dir(run) and not outdir.is_compare_dir(run)
    check_run_output(run, force=False)
    with pytest.raises(FlatbmaError, match=r"not a flatbma compare directory.*no compare_config\.yaml"):
        check_compare_output(run, force=False)


@pytest.mark.parametrize(
    "content",
    [
        "name: my-other-tool\nlr: 0.1\n",  # another program's config.yaml
        "method: {name: sgd}\n",  # a hand-written flatbma config is not a run directory's resolved config
        "seed: [\n",
        "\xff\xfe",
        "- a\n- b\n",
    ],
    ids=["other-tool", "hand-written", "broken", "binary", "list"],
)
def test_a_config_yaml_flatbma_did_not_write_is_no_run_directory(tmp_path: Path, content: str) -> None:
    (tmp_path / "config.yaml").write_bytes(content.encode("latin-1"))
    assert not outdir.is_run_dir(tmp_path)
    with pytest.raises(FlatbmaError) as info:
        check_run_output(tmp_path, force=False)
    message = str(info.value)
    assert "already holds files and is not a flatbma run directory" in message and "--force" in message
    assert "config.yaml written by flatbma train" in message
    check_run_output(tmp_path, force=True)


def test_a_compare_directory_is_a_compare_directory(tmp_path: Path) -> None:
    (tmp_path / "compare_config.yaml").write_text("fingerprint: abc\n")
    (tmp_path / "results.json").write_text("{}")
    check_compare_output(tmp_path, force=False)
    with pytest.raises(FlatbmaError, match="not a flatbma run directory"):
        check_run_output(tmp_path, force=False)


def test_a_foreign_directory_is_refused_and_untouched(tmp_path: Path) -> None:
    """The user's project: refused by train and compare (nothing written), then written into with --force."""
    project = tmp_path / "project"
    project.mkdir()
    (project / "notes.md").write_text("mine")
    (project / "config.yaml").write_text("name: my-other-tool\n")
    before = tree(project)
    for command, config in (("train", RUN), ("compare", COMPARE)):
        code, err = cli(tmp_path, command, config, project)
        assert code == 2 and len(err) == 1, err
        kind = command if command == "compare" else "run"
        assert f"output_dir {project} already holds files and is not a flatbma {kind} directory" in err[0], err
        assert "--force" in err[0]
        assert tree(project) == before


def test_train_writes_only_inside_output_dir(tmp_path: Path) -> None:
    """A run into a new directory, then again into the same (its own run directory): nothing written elsewhere."""
    sandbox = tmp_path / "sandbox"
    sandbox.mkdir()
    (sandbox / "keep.txt").write_text("x")
    before = tree(sandbox)
    for _ in range(2):
        code, err = cli(tmp_path, "train", RUN, sandbox / "run")
        assert code in DONE and not err, err
        after = tree(sandbox)
        written = {name for name in after if after[name] != before.get(name)}
        assert written and all(name.startswith("run/") for name in written), written
        assert {name for name in after if not name.startswith("run/")} == set(before)
    # and into the user's directory only with --force, writing flatbma's files beside theirs
    code, err = cli(tmp_path, "train", RUN, sandbox, "--force")
    assert code in DONE and (sandbox / "keep.txt").read_text() == "x" and (sandbox / "config.yaml").is_file()
