import dataclasses
import errno
import json
import os
import pickle
import re
import stat
import tempfile
from pathlib import Path

import pytest
import torch

from flatbma import state_io
from flatbma.errors import FlatbmaError
from flatbma.experiment.run.checkpoint import (
    atomic_write_bytes,
    atomic_write_json,
    check_compatible,
    remove_stale_temps,
    save_state,
)
from flatbma.experiment.run.provenance import Provenance, check_provenance, model_fingerprint
from flatbma.experiment.run.resume import Resume, append_resume, resume_change
from flatbma.types import State
from tests.helpers import load_state


def _state():
    return State(
        params={"fc.weight": torch.randn(3, 2), "fc.bias": torch.zeros(3)},
        buffers={"bn.running_mean": torch.ones(4), "bn.num_batches_tracked": torch.tensor(7)},
        aux={"momentum/fc.weight": torch.randn(3, 2)},
        step=12,
    )


def test_round_trip_is_exact(tmp_path):
    s = _state()
    save_state(s, tmp_path / "c.safetensors")
    t = load_state(tmp_path / "c.safetensors")
    assert t.step == 12
    for section in ("params", "buffers", "aux"):
        a, b = getattr(s, section), getattr(t, section)
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


def test_truncated_checkpoint_is_a_clear_error(tmp_path):
    path = tmp_path / "c.safetensors"
    save_state(_state(), path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(FlatbmaError, match="truncated or corrupted"):
        load_state(path)


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch /tmp/flatbma_pwned",))


def test_pickle_disguised_as_checkpoint_is_refused_and_not_executed(tmp_path):
    path = tmp_path / "c.safetensors"
    path.write_bytes(pickle.dumps({"x": _Evil()}))
    with pytest.raises(FlatbmaError):
        load_state(path)
    assert not os.path.exists("/tmp/flatbma_pwned")


def test_missing_checkpoint(tmp_path):
    with pytest.raises(FlatbmaError, match="does not exist"):
        load_state(tmp_path / "nope.safetensors")


def test_key_order_survives_a_round_trip(tmp_path):
    s = State(params={"z": torch.ones(1), "a": torch.zeros(1), "m": torch.ones(2)}, step=1)
    save_state(s, tmp_path / "c.safetensors")
    assert list(load_state(tmp_path / "c.safetensors").params) == ["z", "a", "m"]


# ---------------------------------------------------------------------------------------------------
# failed writes: one FlatbmaError line, the old file intact, no temporary file left


def _no_space(fd):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_disk_keeps_the_last_checkpoint_and_says_its_step(tmp_path, monkeypatch):
    path = tmp_path / "c.safetensors"
    save_state(_state(), path)  # step 12
    monkeypatch.setattr(os, "fsync", _no_space)
    with pytest.raises(FlatbmaError) as e:
        save_state(dataclasses.replace(_state(), step=13), path)
    assert str(e.value) == (
        f"no space left on {path}: free space or choose another output_dir; the last checkpoint at step 12 is intact"
    )
    monkeypatch.undo()
    assert load_state(path).step == 12
    assert os.listdir(tmp_path) == ["c.safetensors"]
    with monkeypatch.context() as m:
        m.setattr(os, "fsync", _no_space)
        with pytest.raises(FlatbmaError, match=r"; no checkpoint was written yet$"):
            save_state(_state(), tmp_path / "new.safetensors")
    assert os.listdir(tmp_path) == ["c.safetensors"]


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        (errno.ENOSPC, "no space left on {path}: free space or choose another output_dir"),
        (errno.EDQUOT, "disk quota exceeded on {path}: free space or choose another output_dir"),
        (errno.EROFS, "cannot write {path}: read-only file system: choose another output_dir"),
        (errno.EACCES, "cannot write {path}: permission denied: choose another output_dir or fix its permissions"),
        (errno.EIO, "cannot write {path} (Input/output error): choose another output_dir"),
    ],
)
def test_every_failed_write_is_one_line(tmp_path, monkeypatch, code, expected):
    path = tmp_path / "out" / "metrics.json"

    def mkstemp(*args, **kwargs):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
    with pytest.raises(FlatbmaError) as e:
        atomic_write_json(path, {"a": 1}, note="the checkpoint at step 5 is intact")
    assert str(e.value) == expected.format(path=path) + "; the checkpoint at step 5 is intact"


def test_an_interrupted_write_removes_its_temporary_file(tmp_path, monkeypatch):
    def interrupted(fd):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "fsync", interrupted)
    with pytest.raises(KeyboardInterrupt):
        atomic_write_bytes(tmp_path / "x.json", b"{}")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("mask", [0o022, 0o077, 0o002, 0o000])
def test_written_files_get_the_mode_of_the_umask(tmp_path, mask):
    old = os.umask(mask)
    try:
        assert state_io._umask() == mask
        atomic_write_bytes(tmp_path / "x.bin", b"1")
        save_state(_state(), tmp_path / "c.safetensors")
        assert os.umask(mask) == mask  # reading it did not change it
    finally:
        os.umask(old)
    for name in ("x.bin", "c.safetensors"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o666 & ~mask  # mkstemp alone: 0o600


def test_stale_temp_files_of_killed_writes_are_removed(tmp_path):
    stale = [".checkpoint.safetensors.a1b2c3d4.tmp", ".metrics.json.__x_9zz0.tmp", ".report.md.abcdefgh.tmp"]
    kept = [".notes.tmp", "checkpoint.safetensors.a1b2c3d4.tmp", ".x.ABCDEFGH.tmp", ".x.abcdefgh.tmpx", "a.json"]
    for name in stale + kept:
        (tmp_path / name).write_text("x")
    (tmp_path / ".dir.abcdefgh.tmp").mkdir()  # not a file: left alone
    removed = remove_stale_temps(tmp_path)
    assert sorted(p.name for p in removed) == sorted(stale)
    assert sorted(os.listdir(tmp_path)) == sorted([*kept, ".dir.abcdefgh.tmp"])
    assert remove_stale_temps(tmp_path / "missing") == []
    # the names atomic_write_bytes uses are the ones removed
    fd, name = tempfile.mkstemp(dir=tmp_path, prefix=".checkpoint.safetensors.", suffix=".tmp")
    os.close(fd)
    assert remove_stale_temps(tmp_path) == [Path(name)]


# ---------------------------------------------------------------------------------------------------
# a state's structure, and who wrote it


def test_a_state_must_have_the_dtypes_shapes_and_entries_of_the_fresh_one():
    ref = _state()
    check_compatible(_state(), ref, "c")
    bad = {
        "params/fc.weight is float16 instead of float32": {
            "params": {**ref.params, "fc.weight": torch.zeros(3, 2).half()}
        },
        "buffers/bn.num_batches_tracked is int32 instead of int64": {
            "buffers": {**ref.buffers, "bn.num_batches_tracked": torch.tensor(7, dtype=torch.int32)}
        },
        "aux/momentum/fc.weight has shape (2, 3) instead of (3, 2)": {"aux": {"momentum/fc.weight": torch.zeros(2, 3)}},
        "params/fc.bias is missing": {"params": {"fc.weight": ref.params["fc.weight"]}},
        "aux/swag/mean/fc.weight is unexpected": {"aux": {**ref.aux, "swag/mean/fc.weight": torch.zeros(3, 2)}},
        "aux/samples/fc.weight is unexpected": {"aux": {**ref.aux, "samples/fc.weight": torch.zeros(4, 3, 2).double()}},
    }
    for problem, change in bad.items():
        with pytest.raises(FlatbmaError, match=re.escape(f"c does not fit this run ({problem})")):
            check_compatible(dataclasses.replace(ref, **change), ref, "c")
    # a sampler's kept iterates: stacks of copies of a parameter, of its dtype
    grown = dataclasses.replace(
        ref, aux={**ref.aux, "samples/fc.weight": torch.zeros(4, 3, 2), "s/fc.bias": torch.zeros(1, 3)}
    )
    check_compatible(grown, ref, "c")


def _provenance(**changes):
    base = Provenance(
        method="swag",
        options={"name": "swag", "rank": 2, "scale": 1.0},
        model={"name": "mlp", "width": 4},
        model_fingerprint="0123456789abcdef",
    )
    return dataclasses.replace(base, **changes)


def test_provenance_round_trips_and_mismatches_name_both_sides():
    p = _provenance()
    assert Provenance.from_json(p.to_json()) == p
    meta = {"written_by": p.to_json()}
    assert check_provenance(meta, p, "c") == p
    with pytest.raises(FlatbmaError, match="does not record who wrote it"):  # an older layout: refused, not guessed
        check_provenance({}, p, "c")
    cases = {
        "checkpoint c was written by method 'swag' but this run is 'sam': restore": _provenance(method="sam"),
        "checkpoint c was written with other swag options than this run's (rank=2 vs 5; checkpoint vs run)": (
            _provenance(options={"name": "swag", "rank": 5, "scale": 1.0})
        ),
        "another model than this run's (model width=4 vs 8; checkpoint vs run)": _provenance(
            model={"name": "mlp", "width": 8}, model_fingerprint="fedcba9876543210"
        ),
        "same model section, but parameters of other names, shapes or dtypes: fingerprint 0123456789abcdef vs ffff": (
            _provenance(model_fingerprint="ffff")
        ),
    }
    for expected, want in cases.items():
        with pytest.raises(FlatbmaError, match=re.escape(expected)):
            check_provenance(meta, want, "c")
    record = json.loads(p.to_json())
    for damaged in ({**record, "options_fingerprint": "0" * 16}, {**record, "method": 3}, {"method": "swag"}, [1]):
        with pytest.raises(FlatbmaError, match="the record of who wrote it is damaged"):
            check_provenance({"written_by": json.dumps(damaged)}, p, "c")


def test_the_model_fingerprint_is_the_structure_and_config_not_the_values():
    torch.manual_seed(0)
    a, b = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    assert model_fingerprint(a, {"width": 4}) == model_fingerprint(b, {"width": 4})
    differs = [
        model_fingerprint(a, {"width": 5}),
        model_fingerprint(torch.nn.Linear(3, 3), {"width": 4}),
        model_fingerprint(torch.nn.Linear(3, 2).double(), {"width": 4}),
        model_fingerprint(torch.nn.Linear(3, 2, bias=False), {"width": 4}),
    ]
    b.bias.requires_grad_(False)  # another trained subset
    differs.append(model_fingerprint(b, {"width": 4}))
    assert len({model_fingerprint(a, {"width": 4}), *differs}) == 1 + len(differs)


# ---------------------------------------------------------------------------------------------------
# --resume --set


def test_resume_changes_of_the_allowed_keys_and_epochs_below_done(tmp_path):
    old = {"seed": 0, "optim": {"lr": 0.1, "momentum": 0.9}, "train": {"epochs": 4}, "eval": {"n_bins": 15}}
    new = json.loads(json.dumps(old))
    new["optim"]["lr"], new["eval"]["n_bins"], new["train"]["epochs"] = 0.01, 10, 3
    ckpt = tmp_path / "c.safetensors"
    save_state(_state(), ckpt, {"epoch": "2", "batch": "5"})
    change = resume_change(ckpt, old, new)
    assert change.changed == {"eval.n_bins": (15, 10), "optim.lr": (0.1, 0.01), "train.epochs": (4, 3)}
    assert (change.step, change.epoch, change.batch) == (12, 2, 5)
    new["train"]["epochs"] = 2  # 2 epochs done and the third begun
    with pytest.raises(FlatbmaError, match=r"train.epochs=2 is below the 3 epochs .* use train.epochs >= 3$"):
        resume_change(ckpt, old, new)
    new["train"]["epochs"], new["optim"]["momentum"], new["seed"] = 4, 0.5, 1
    with pytest.raises(FlatbmaError, match=r"^--resume cannot change optim.momentum, seed \(it would"):
        resume_change(ckpt, old, new)
    assert resume_change(tmp_path / "none", old, old).changed == {}


def test_resumes_are_appended_to_the_run_record(tmp_path):
    path = tmp_path / "resumes.json"
    change = Resume(changed={"optim.lr": (0.1, 0.01)}, step=3, epoch=0, batch=3, resolved={})
    append_resume(path, change)
    append_resume(path, dataclasses.replace(change, step=9))
    assert [r["step"] for r in json.loads(path.read_text())] == [3, 9]
    assert json.loads(path.read_text())[0]["changed"] == {"optim.lr": {"old": 0.1, "new": 0.01}}
    path.write_text("{")
    with pytest.raises(FlatbmaError, match=r"resumes\.json is damaged"):
        append_resume(path, change)
