"""The probes of issues #13 and #23: every hostile input they list, as data in three tables.

* :data:`ROWS`: inputs run through ``flatbma.experiment.cli.main`` in-process (below);
* :data:`PROCESS_ROWS`: what needs a process of its own — a closed pipe, ``/dev/full``, SIGTERM — with
  the exit code and the last line expected (:func:`test_signals_and_pipes_end_in_one_line_or_quietly`);
* :data:`API_ROWS`: calls of the Python API, with the error's class and first words
  (:func:`test_a_bad_api_call_is_one_flatbma_error`).

:data:`ROWS` has one row per input. Each row builds its input in its own temporary
directory — from tiny finished runs made once for the module (SAM and SWAG on the same 4-unit MLP,
digits with 10 images per class: 4 updates per epoch, 2 epochs), or a one-run comparison it makes
itself — and runs the command in-process, in an empty working directory. Every row must end with

* exit code 2 and stderr exactly one line ``flatbma: error: ...`` of at most :data:`MAX_LINE`
  characters (no traceback, no progress line, no warning: warnings are shown as a command line shows
  them, not recorded by pytest), holding the row's expected text;
* nothing written outside the row's own directory: the rest of pytest's temporary tree, the working
  directory and ``/`` are as they were; rows refused before any write (``untouched``) leave even
  their own directory as it was.

Full disks are simulated by patching the write (``os.fsync`` of the temporary file fails with
``ENOSPC``), read-only file systems by failing the temporary file's creation with ``EROFS``; one row
makes a real read-only directory (a permission-less directory, or as root a read-only bind mount in a
private mount namespace, run as a subprocess) and is skipped where neither is possible. No command
reads ``.npy`` files (CIFAR-C is read by the library only), so the corrupt ``.npy`` header is probed
through :func:`flatbma.data.load_cifar_c`.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

from flatbma.data import load_cifar_c
from flatbma.errors import FlatbmaError
from flatbma.experiment.cli import main
from tests.data.test_bad_headers import idx_bytes, idx_dir, image_folder, npy_with_header, png_bytes, with_png_size
from tests.experiment.test_checkpoint_tamper import _rewrite

MAX_LINE = 400
CKPT = "checkpoint.safetensors"
RUN: dict[str, Any] = {
    "seed": 0,
    "method": {"name": "sam", "rho": 0.05},
    "data": {"name": "digits", "k_shot": 10, "batch_size": 25, "test_limit": 100},  # 100 images: 4 updates/epoch
    "model": {"name": "mlp", "width": 4},
    "optim": {"lr": 0.05},
    "train": {"epochs": 2, "checkpoint_every": 4, "progress": False},  # checkpoints at steps 4 and 8
    "eval": {"num_samples": 1},
}
SWAG = {"name": "swag", "rank": 2, "start_step": 0, "collect_every": 1}
COMPARE = {
    **{k: v for k, v in RUN.items() if k != "method"},
    "train": {**RUN["train"], "epochs": 1},
    "compare": {
        "methods": [{"name": "sgd"}],
        "seeds": [0],
        "corruptions": [],
        "bma_curve": [1],
        "flatness": False,
        "landscape": False,
    },
}
ROW = Path("runs/sgd/seed0")  # the comparison's one row


def _config(out: Path, **sections: Any) -> dict[str, Any]:
    """:data:`RUN` writing into ``out``, with whole sections replaced (``method``) or updated (the others)."""
    cfg = json.loads(json.dumps(RUN))
    for key, value in sections.items():
        cfg[key] = {**cfg[key], **value} if isinstance(value, dict) and key != "method" else value
    return {**cfg, "output_dir": str(out)}


def _write(path: Path, cfg: dict[str, Any]) -> str:
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def _cli(argv: list[str]) -> tuple[Any, str]:
    """``main(argv)`` in-process: its exit code (``SystemExit`` caught) and everything it wrote to stderr."""
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code
    return code, err.getvalue()


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Finished SAM and SWAG runs of the same model."""
    root = tmp_path_factory.mktemp("made")
    out = {}
    for name, method in (("sam", RUN["method"]), ("swag", SWAG)):
        code, err = _cli(["train", "--config", _write(root / f"{name}.yaml", _config(root / name, method=method))])
        assert code in (0, 3), err  # 3: finished, flagged by a health rule (these tiny runs are at chance)
        out[name] = root / name
    return out


# ---------------------------------------------------------------------------------------------------
# the rows


@dataclass
class Ctx:
    """What a row builds its input from: its own directory, the module's finished runs, monkeypatch."""

    tmp: Path
    made: dict[str, Path]
    monkeypatch: pytest.MonkeyPatch

    def copy(self, name: str) -> Path:
        """A copy of the finished run ``name`` in the row's directory."""
        dst = self.tmp / name
        shutil.copytree(self.made[name], dst)
        return dst

    def compare(self) -> tuple[Path, list[str]]:
        """A finished comparison in the row's directory, and the command that runs it again.

        Made anew in each row: its runs record their directory, so a copy elsewhere would be retrained.
        """
        out = self.tmp / "compare"
        argv = ["compare", "--config", _write(self.tmp / "compare.yaml", {**COMPARE, "output_dir": str(out)})]
        code, err = _cli(argv)
        assert code in (0, 3), err  # 3: its tiny row is flagged by a health rule
        return out, argv

    def train(self, **sections: Any) -> list[str]:
        return ["train", "--config", _write(self.tmp / "c.yaml", _config(self.tmp / "run", **sections))]

    def yaml_train(self, text: str) -> list[str]:
        (self.tmp / "c.yaml").write_text(text)
        return ["train", "--config", str(self.tmp / "c.yaml")]


@dataclass(frozen=True)
class Row:
    """A hostile input: ``argv`` builds it and returns the command; ``expected`` is in its error line.

    ``untouched``: refused before any change, so even the row's own directory holds what it held (a file
    may be written again with the same bytes: a rerun of ``compare`` records its config first), and
    before any work, so it runs without ``--quiet`` (nothing but the error line on stderr). The other
    rows fail after training or evaluating, whose progress lines (one per phase when stderr is no
    terminal) are by design: they run with ``--quiet``.
    """

    id: str
    argv: Callable[[Ctx], list[str]]
    expected: str
    untouched: bool = True


def bomb(levels: int) -> str:
    """A billion-laughs value in YAML flow style: ``levels`` anchors, each a list of 10 of the one before.

    The last level expands to ``10**(levels - 1)`` strings; the value, to ``Σ 10**i`` values.
    """
    parts = ['&a0 "lol"'] + [f"&a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, levels)]
    return "[" + ", ".join(parts) + "]"


def _with_bomb(cfg: dict[str, Any], key: str, levels: int) -> str:
    """``cfg`` as YAML with the value at the dotted ``key`` replaced by :func:`bomb` (JSON is YAML)."""
    node = cfg
    *path, last = key.split(".")
    for part in path:
        node = node[int(part)] if isinstance(node, list) else node[part]
    node[last] = "@BOMB@"
    return json.dumps(cfg).replace('"@BOMB@"', bomb(levels))


def bomb_train(key: str, levels: int = 9, method: dict[str, Any] | None = None) -> Callable[[Ctx], list[str]]:
    def argv(ctx: Ctx) -> list[str]:
        cfg = _config(ctx.tmp / "run", **({"method": method} if method else {}))
        return ctx.yaml_train(_with_bomb(cfg, key, levels))

    return argv


def bomb_compare_label(ctx: Ctx) -> list[str]:
    cfg = {**json.loads(json.dumps(COMPARE)), "output_dir": str(ctx.tmp / "out")}
    (ctx.tmp / "compare.yaml").write_text(_with_bomb(cfg, "compare.methods.0.label", 9))
    return ["compare", "--config", str(ctx.tmp / "compare.yaml")]


def png_bomb(ctx: Ctx) -> list[str]:
    """A 30 000 × 30 000 PNG header (9·10⁸ pixels, over PIL's limit) over 4 × 4 pixels of data."""
    root = image_folder(ctx.tmp / "images", with_png_size(png_bytes(), 30_000, 30_000))
    return ctx.train(data={"name": "image-folder", "root": str(root), "image_size": 4, "k_shot": None})


def idx_overflow(ctx: Ctx) -> list[str]:
    """An idx header of 2³¹ × 2³¹ × 4 images: as int64 the size product wraps to 0, an empty file's length."""
    root = idx_dir(ctx.tmp / "idx")
    (root / "train-images-idx3-ubyte").write_bytes(idx_bytes((2**31, 2**31, 4), b""))
    return ctx.train(data={"name": "idx", "root": str(root), "k_shot": None})


def _failing_write(ctx: Ctx, name: str, error: int, nth: int = 1) -> None:
    """The ``nth`` atomic write of a file named ``name`` fails with ``error`` (from then on, every one).

    ``ENOSPC`` comes from ``os.fsync`` of the temporary file (the data did not fit: the temporary file
    must be removed); ``EROFS`` from creating the temporary file, as on a read-only file system.
    """
    prefix = f".{name}."
    calls: list[int] = []
    if error == errno.EROFS:
        real_mkstemp = tempfile.mkstemp

        def mkstemp(*args: Any, **kwargs: Any) -> tuple[int, str]:
            if kwargs.get("prefix") == prefix:
                calls.append(1)
                if len(calls) >= nth:
                    raise OSError(errno.EROFS, os.strerror(errno.EROFS))
            return real_mkstemp(*args, **kwargs)

        ctx.monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
        return
    if not Path("/proc/self/fd").is_dir():
        pytest.skip("needs /proc/self/fd to tell the writes apart")
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        if Path(os.readlink(f"/proc/self/fd/{fd}")).name.startswith(prefix):
            calls.append(fd)
            if len(calls) >= nth:
                raise OSError(error, os.strerror(error))
        real_fsync(fd)

    ctx.monkeypatch.setattr(os, "fsync", fsync)


def full_disk_checkpoint(ctx: Ctx) -> list[str]:
    _failing_write(ctx, CKPT, errno.ENOSPC, nth=2)  # the checkpoint of step 8; the one of step 4 stays
    return ctx.train()


def full_disk_metrics(ctx: Ctx) -> list[str]:
    run = ctx.copy("sam")
    _failing_write(ctx, "metrics.json", errno.ENOSPC)
    return ["evaluate", str(run)]


def read_only_checkpoint(ctx: Ctx) -> list[str]:
    _failing_write(ctx, CKPT, errno.EROFS)
    return ctx.train()


def read_only_metrics(ctx: Ctx) -> list[str]:
    run = ctx.copy("sam")
    _failing_write(ctx, "metrics.json", errno.EROFS)
    return ["evaluate", str(run)]


def full_disk_compare(name: str) -> Callable[[Ctx], list[str]]:
    def argv(ctx: Ctx) -> list[str]:
        _, again = ctx.compare()
        _failing_write(ctx, name, errno.ENOSPC)
        return again

    return argv


def read_only_compare(ctx: Ctx) -> list[str]:
    _, again = ctx.compare()
    _failing_write(ctx, "results.json", errno.EROFS)
    return again


def damaged_compare(name: str, content: bytes) -> Callable[[Ctx], list[str]]:
    def argv(ctx: Ctx) -> list[str]:
        out, again = ctx.compare()
        (out / name).write_bytes(content)
        return again

    return argv


def tampered(**changes: Any) -> Callable[[Ctx], list[str]]:
    """``flatbma train --resume`` of a copy of the SAM run whose checkpoint is rewritten with ``changes``."""

    def argv(ctx: Ctx) -> list[str]:
        run = ctx.copy("sam")
        _rewrite(run / CKPT, **changes)
        return ["train", "--resume", str(run)]

    return argv


def _meta(**values: Any) -> Callable[[dict[str, str]], None]:
    return lambda meta: meta.update({k: str(v) for k, v in values.items()})


def _params(dtype: torch.dtype) -> Callable[[dict[str, torch.Tensor]], None]:
    return lambda t: t.update({k: v.to(dtype) for k, v in t.items() if k.startswith("params/")})


def _rng(change: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[dict[str, torch.Tensor]], None]:
    return lambda t: t.update({"extra/torch_rng": change(t["extra/torch_rng"])})


def swag_in_sam(command: str) -> Callable[[Ctx], list[str]]:
    def argv(ctx: Ctx) -> list[str]:
        run = ctx.copy("sam")
        shutil.copy(ctx.made["swag"] / CKPT, run / CKPT)
        return ["evaluate", str(run)] if command == "evaluate" else ["train", "--resume", str(run)]

    return argv


def duplicate_method(ctx: Ctx) -> list[str]:
    text = yaml.safe_dump(_config(ctx.tmp / "run", method={"name": "sgd"}))
    return ctx.yaml_train(text + "method:\n  name: sam\n")


def root_output_dir(ctx: Ctx) -> list[str]:
    """``output_dir: /`` with ``--force``; should the guard regress, writes into ``/`` fail instead of landing."""
    real_mkstemp = tempfile.mkstemp

    def mkstemp(*args: Any, **kwargs: Any) -> tuple[int, str]:
        if Path(kwargs.get("dir") or ".").resolve() == Path("/"):
            raise AssertionError("a file was about to be written into /")
        return real_mkstemp(*args, **kwargs)

    ctx.monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
    return ["train", "--config", _write(ctx.tmp / "c.yaml", _config(Path("/"))), "--force"]


def resume_set(item: str) -> Callable[[Ctx], list[str]]:
    def argv(ctx: Ctx) -> list[str]:
        return ["train", "--resume", str(ctx.copy("sam")), "--set", item]

    return argv


# --- issue #23 (hardening round 3): data, models, configs, messages ----------------------------------------


def folder(ctx: Ctx, train: dict[str, int], test: dict[str, int], size: tuple[int, int] = (6, 6)) -> Path:
    """``images/{train,test}/<class>/<i>.png`` of random grey pixels, ``(height, width)`` each: counts per class."""
    root = ctx.tmp / "images"
    rng = np.random.default_rng(0)
    for split, classes in (("train", train), ("test", test)):
        for name, count in classes.items():
            (root / split / name).mkdir(parents=True, exist_ok=True)
            for i in range(count):
                Image.fromarray(rng.integers(0, 255, size).astype(np.uint8)).save(root / split / name / f"{i}.png")
    return root


def folder_train(ctx: Ctx, train: dict[str, int], test: dict[str, int], **data: Any) -> list[str]:
    root = folder(ctx, train, test, **data)
    data = {"name": "image-folder", "root": str(root), "k_shot": None, "test_limit": None}
    return ctx.train(data=data, eval={"n_bins": 2})  # 4 test images


def empty_class_folder(ctx: Ctx) -> list[str]:
    argv = folder_train(ctx, {"a": 4, "b": 4}, {"a": 2, "b": 2, "c": 2})
    (ctx.tmp / "images" / "train" / "c").mkdir()
    (ctx.tmp / "images" / "train" / "c" / ".DS_Store").write_bytes(b"\0")
    return argv


def one_class_idx(ctx: Ctx) -> list[str]:
    rng = np.random.default_rng(0)
    root = ctx.tmp / "idx"
    root.mkdir()
    for split, n in (("train", 40), ("t10k", 12)):
        pixels = rng.integers(0, 255, n * 36, np.uint8).tobytes()
        (root / f"{split}-images-idx3-ubyte").write_bytes(idx_bytes((n, 6, 6), pixels))
        (root / f"{split}-labels-idx1-ubyte").write_bytes(idx_bytes((n,), bytes(n)))
    return ctx.train(data={"name": "idx", "root": str(root), "k_shot": None, "test_limit": None}, eval={"n_bins": 2})


def unlistable_class_folder(ctx: Ctx) -> list[str]:
    """A class folder without read permission, simulated (as root the permission is ignored)."""
    argv = folder_train(ctx, {"a": 4, "b": 4}, {"a": 2, "b": 2})
    locked, real = ctx.tmp / "images" / "train" / "b", Path.iterdir

    def iterdir(self: Path) -> Any:
        if self == locked:
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return real(self)

    ctx.monkeypatch.setattr(Path, "iterdir", iterdir)
    return argv


def compare_with(ctx: Ctx, **changes: Any) -> list[str]:
    """:data:`COMPARE` in the row's directory, its compare section updated (keys given ``None`` removed)."""
    section = {**COMPARE["compare"], **changes}
    cfg = {
        **COMPARE,
        "compare": {k: v for k, v in section.items() if v is not None},
        "output_dir": str(ctx.tmp / "out"),
    }
    return ["compare", "--config", _write(ctx.tmp / "compare.yaml", cfg)]


USER_MODELS = """
import torch
from torch import nn


def net(num_classes, in_channels, image_size):
    return nn.Sequential(nn.Flatten(), nn.Linear(in_channels * image_size**2, num_classes))


def too_few_logits(num_classes, in_channels, image_size):
    return net(num_classes - 1, in_channels, image_size)


def float64(num_classes, in_channels, image_size):
    return net(num_classes, in_channels, image_size).double()


def on_meta(num_classes, in_channels, image_size):
    return net(num_classes, in_channels, image_size).to("meta")


class _Pair(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x), x


def a_tuple(num_classes, in_channels, image_size):
    return _Pair(net(num_classes, in_channels, image_size))


def wrong_input_size(num_classes, in_channels, image_size):
    return nn.Sequential(nn.Flatten(), nn.Linear(10, num_classes))


def raises(num_classes):
    raise RuntimeError("out of coffee")
"""


def user_model(factory: str, module: str = USER_MODELS) -> Callable[[Ctx], list[str]]:
    """Train with ``model.name: <a module of the row's own>:<factory>`` (a unique module name: nothing cached)."""

    def argv(ctx: Ctx) -> list[str]:
        name = f"hostile_models_{abs(hash(str(ctx.tmp))):x}"
        (ctx.tmp / f"{name}.py").write_text(module)
        ctx.monkeypatch.syspath_prepend(str(ctx.tmp))
        ctx.monkeypatch.setattr(sys, "dont_write_bytecode", True)  # no __pycache__ in the row's directory
        return ctx.train(model={"name": f"{name}:{factory}", "width": None})

    return argv


def nan_weights(ctx: Ctx) -> list[str]:
    """``model.pretrained``: the MLP's own state dict with a NaN (the loss was then blamed on the learning rate)."""
    from flatbma.models import build_model

    state = build_model("mlp", num_classes=10, in_channels=1, image_size=8, width=4, seed=0).state_dict()
    state[next(iter(state))][0, 0] = float("nan")
    torch.save(state, ctx.tmp / "nan.pth")
    return ctx.train(model={"pretrained": str(ctx.tmp / "nan.pth")})


def pickle_protocol_5(ctx: Ctx) -> list[str]:
    """A ``.pth`` pickled with protocol 5 (refused): torch's warning about the protocol used to print too."""
    torch.save({"w": torch.zeros(2)}, ctx.tmp / "p5.pth", _use_new_zipfile_serialization=False, pickle_protocol=5)
    return ctx.train(model={"pretrained": str(ctx.tmp / "p5.pth")})


def fifo_config(ctx: Ctx) -> list[str]:
    os.mkfifo(ctx.tmp / "c.yaml")
    return ["train", "--config", str(ctx.tmp / "c.yaml")]


def huge(section: str, key: str) -> Callable[[Ctx], list[str]]:
    """A 100 KB value (or, for ``key`` ``"<key>"``, a 100 KB unknown key) in ``section``: the line stays short."""

    def argv(ctx: Ctx) -> list[str]:
        big = "x" * 100_000
        value = {big: 1} if key == "<key>" else {key: big}
        return ctx.train(**{section: value if section != "method" else {**value}})

    return argv


def long_output_dir(ctx: Ctx) -> list[str]:
    return ["train", "--config", _write(ctx.tmp / "c.yaml", _config(ctx.tmp / ("a" * 300)))]


def unknown_prior_key(ctx: Ctx) -> list[str]:
    cfg = {**_config(ctx.tmp / "run", method={"name": "fp-bma"}), "prior": {"method": {"name": "swag"}, "bogus": 1}}
    return ["train", "--config", _write(ctx.tmp / "c.yaml", cfg)]


ROWS = [
    # YAML bombs in typed fields (9 levels: ~10⁸ values), a 6-level one, and a 5-level one the budget lets through
    Row("bomb-optim.lr", bomb_train("optim.lr"), "through its aliases"),
    Row("bomb-seed", bomb_train("seed"), "through its aliases"),
    Row("bomb-method.rho", bomb_train("method.rho"), "through its aliases"),
    Row("bomb-compare-label", bomb_compare_label, "through its aliases"),
    Row("bomb-6-levels", bomb_train("optim.lr", levels=6), "expands to over 100,000 YAML values"),
    Row("bomb-5-levels-under-budget", bomb_train("optim.lr", levels=5), "optim.lr"),
    # data files
    Row("png-decompression-bomb", png_bomb, "decompression bomb"),
    Row("idx-dims-overflow", idx_overflow, "train-images-idx3-ubyte is truncated"),
    # full disks and read-only file systems
    Row("enospc-checkpoint", full_disk_checkpoint, "the last checkpoint at step 4 is intact", untouched=False),
    Row("enospc-metrics.json", full_disk_metrics, "no space left on", untouched=False),
    Row("enospc-compare-results.json", full_disk_compare("results.json"), "no space left on", untouched=False),
    Row("enospc-compare-report.html", full_disk_compare("report.html"), "no space left on", untouched=False),
    Row("erofs-checkpoint", read_only_checkpoint, "read-only file system", untouched=False),
    Row("erofs-metrics.json", read_only_metrics, "read-only file system", untouched=False),
    Row("erofs-compare-results.json", read_only_compare, "read-only file system", untouched=False),
    # damaged caches of an earlier comparison
    Row("corrupt-compare.json", damaged_compare(str(ROW / "compare.json"), b'{"fingerprint": "ab'), "is damaged"),
    Row("corrupt-compare_config.yaml", damaged_compare("compare_config.yaml", b"fingerprint: [\n"), "is damaged"),
    # tampered checkpoints (train --resume)
    Row("ckpt-float16-params", tampered(tensors=_params(torch.float16)), "is float16 instead of float32"),
    Row("ckpt-int64-params", tampered(tensors=_params(torch.int64)), "is int64 instead of float32"),
    Row("ckpt-partial-malformed", tampered(meta=_meta(partial="[1.0, 2.0]")), "partial sums"),
    Row("ckpt-partial-text", tampered(meta=_meta(partial='"abc"')), "partial sums"),
    Row("ckpt-rng-short", tampered(tensors=_rng(lambda r: r[:100])), "uint8 (100,) instead of uint8 (5056,)"),
    Row("ckpt-rng-int64", tampered(tensors=_rng(lambda r: r.long())), "torch RNG state: int64"),
    Row("ckpt-step-minus-1000", tampered(meta=_meta(step=-1000)), "step -1000 is not in [0, 8]"),
    Row("ckpt-batch-1000", tampered(meta=_meta(epoch=1, batch=1000)), "batch 1000 of epoch 1 is not in [0, 4]"),
    Row("ckpt-epoch-minus-3", tampered(meta=_meta(epoch=-3)), "epoch -3 is not in [0, train.epochs=2]"),
    # a SWAG checkpoint in a SAM run directory
    Row("swag-ckpt-in-sam-run-evaluate", swag_in_sam("evaluate"), "was written by method 'swag' but this run is 'sam'"),
    Row("swag-ckpt-in-sam-run-resume", swag_in_sam("resume"), "was written by method 'swag' but this run is 'sam'"),
    # configs
    Row("duplicate-method-key", duplicate_method, "duplicate key 'method'"),
    Row("output_dir-root", root_output_dir, "is a file system root"),
    Row(
        "hessian_k-over-max_iter",
        lambda ctx: ctx.train(eval={"hessian_k": 50, "hessian_max_iter": 10}),
        "hessian_max_iter (10) must be >= hessian_k (50)",
    ),
    Row("absurd-n_bins", lambda ctx: ctx.train(eval={"n_bins": 10**9}), "use eval.n_bins <= 100"),
    Row(
        "sgld-burn_in-longer-than-run",
        lambda ctx: ctx.train(method={"name": "sgld", "burn_in": 1000}),
        "sgld stores its first sample after method.burn_in",
    ),
    Row(
        "swag-too-few-snapshots",
        lambda ctx: ctx.train(method={"name": "swag", "rank": 20}),
        "swag needs >= 20 snapshots for method.rank=20",
    ),
    Row(
        "laplace-of-swag",
        lambda ctx: ctx.train(method={"name": "laplace", "of": {"name": "swag"}}),
        "Laplace needs a MAP: method.of must be a point method (sgd, sam, asam, fsam), got 'swag'",
    ),
    Row("resume-set-model.width", resume_set("model.width=8"), "--resume cannot change model.width"),
    Row("resume-set-seed", resume_set("seed=3"), "--resume cannot change seed"),
    # issue #23: data (items 10, 15, 16)
    Row(
        "class-only-in-test",
        lambda ctx: folder_train(ctx, {"a": 4, "b": 4}, {"a": 2, "b": 2, "c": 2}),
        "1 of its 3 classes has no training example (['c'])",
    ),
    Row("class-folder-of-hidden-files", empty_class_folder, "1 of its 3 classes has no training example (['c'])"),
    Row("one-class-idx", one_class_idx, "dataset 'idx' has 1 class ('0'): a classifier needs at least two"),
    Row("unlistable-class-folder", unlistable_class_folder, "cannot list"),
    Row(
        "non-square-images-mlp",
        lambda ctx: folder_train(ctx, {"a": 3, "b": 3}, {"a": 2, "b": 2}, size=(6, 9)),
        "the images are 6x9, not square: set data.image_size",
    ),
    # compare and method options (items 9, 12)
    Row(
        "compare-duplicate-seeds",
        lambda ctx: compare_with(ctx, seeds=[0, 0, 0]),
        "compare.seeds lists seed 0 more than once",
    ),
    Row(
        "quick-without-compare.quick",
        lambda ctx: [*compare_with(ctx), "--quick"],
        "--quick runs the reduced setting of the config's compare.quick section, but it sets none",
    ),
    Row(
        "quick-unknown-method",
        lambda ctx: [*compare_with(ctx, quick={"methods": ["bogus"]}), "--quick"],
        "compare.quick.methods names 'bogus', which is no entry",
    ),
    Row(
        "mc-dropout-rate-0",
        lambda ctx: ctx.train(method={"name": "mc-dropout", "rate": 0.0}),
        "method.rate=0.0 sets every dropout layer to p=0",
    ),
    # output_dir, memory (items 14, 20)
    Row("output_dir-name-over-255", long_output_dir, "output_dir has a directory name of 300 bytes"),
    Row(
        "ensemble-of-a-billion",
        lambda ctx: ctx.train(method={"name": "ensemble", "size": 10**9}),
        "method.size=1000000000 members of 330 trained weights need at least 1,320.0 GB",
    ),
    # user models (item 17)
    Row(
        "model-too-few-logits", user_model("too_few_logits"), "returns 9 logits per example but the data has 10 classes"
    ),
    Row("model-float64", user_model("float64"), "has float64 weights but its inputs are float32"),
    Row("model-on-meta", user_model("on_meta"), "has weights on the meta device"),
    Row("model-returns-a-tuple", user_model("a_tuple"), "returns a tuple, not a tensor of logits"),
    Row(
        "model-wrong-input-size",
        user_model("wrong_input_size"),
        "fails on a batch of inputs of shape [2, 1, 8, 8] (RuntimeError: mat1",
    ),
    Row(
        "model-factory-raises",
        user_model("raises"),
        "failed when called with ['num_classes'] (RuntimeError: out of coffee)",
    ),
    Row("model-module-exits-at-import", user_model("net", "import sys\nsys.exit(0)\n"), "(it called sys.exit(0))"),
    Row(
        "model-is-flatbma-cli",
        lambda ctx: ctx.train(model={"name": "flatbma.experiment.cli:main"}),
        "names flatbma's own code, not a model factory",
    ),
    Row("model-nan-weights", nan_weights, "has NaN or infinite weights (features.1.weight) before training"),
    # messages
    Row("pickle-protocol-5-no-warning", pickle_protocol_5, "torch.load(weights_only=True) accepts"),
    Row("huge-unknown-key", huge("data", "<key>"), "unknown config key 'data.xxx"),
    Row("huge-method-name", huge("method", "name"), "unknown method 'xxx"),
    Row("huge-dataset-name", huge("data", "name"), "unknown dataset 'xxx"),
    Row("huge-model-name", huge("model", "name"), "unknown model 'xxx"),
    Row("huge-device-name", huge("train", "device"), "train.device 'xxx"),
    Row("config-is-a-directory", lambda ctx: ["train", "--config", str(ctx.tmp)], "is a directory: give the YAML file"),
    Row("config-is-a-fifo", fifo_config, "is not a regular file (a FIFO or a device)"),
    Row(
        "compare-entry-key",
        lambda ctx: compare_with(ctx, methods=[{"name": "sgd", "bogus": 1}]),
        "unknown config key 'compare.methods[0].bogus' for method 'sgd'",
    ),
    Row("prior-unknown-key", unknown_prior_key, "Valid keys here: epochs, init, method, min_std, optim"),
]


def tree(root: Path, skip: Path | None = None) -> dict[str, tuple[int, int]]:
    """Every file and directory under ``root`` (but ``skip``) with its size and modification time."""
    found = {}
    for path in root.rglob("*"):
        if skip is not None and (path == skip or skip in path.parents):
            continue
        stat = path.lstat()
        found[str(path)] = (stat.st_size, stat.st_mtime_ns)
    return found


def contents(root: Path) -> dict[str, bytes | None]:
    """Every file under ``root`` with its bytes, and every directory (``None``): what a refusal must leave."""
    return {str(p): p.read_bytes() if p.is_file() else None for p in root.rglob("*")}


def _show_on_stderr(
    message: Any, category: type, filename: str, lineno: int, file: Any = None, line: Any = None
) -> None:
    """Python's own way of showing a warning outside pytest: two lines on stderr."""
    sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))


def assert_one_line(code: Any, err: str, expected: str) -> str:
    lines = err.splitlines()
    assert code == 2, (code, err[-2000:])
    assert "Traceback" not in err and len(lines) == 1, err[-2000:]
    assert lines[0].startswith("flatbma: error: "), lines[0]
    assert len(lines[0]) <= MAX_LINE, f"{len(lines[0])} characters: {lines[0][:500]}"
    assert expected in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("row", ROWS, ids=[row.id for row in ROWS])
def test_a_hostile_input_is_one_line_and_writes_nowhere_else(
    row: Row, made: dict[str, Path], tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, monkeypatch
) -> None:
    cwd = tmp_path_factory.mktemp("cwd")  # outside the row's directory: it must stay empty
    monkeypatch.chdir(cwd)
    own = tmp_path / "row"
    own.mkdir()
    ctx = Ctx(own, made, monkeypatch)
    argv = row.argv(ctx) + ([] if row.untouched else ["--quiet"])
    base = tmp_path_factory.getbasetemp()
    outside, in_root, inside = tree(base, skip=own), sorted(os.listdir("/")), contents(own)

    with warnings.catch_warnings():  # warnings printed as a command line prints them (pytest would record them)
        warnings.simplefilter("default")
        warnings.showwarning = _show_on_stderr
        code, err = _cli(argv)
    monkeypatch.undo()  # the patched writes, before anything else is checked

    assert_one_line(code, err, row.expected)
    assert tree(base, skip=own) == outside, "written outside the row's directory"
    assert sorted(os.listdir("/")) == in_root and not list(cwd.iterdir())
    if row.untouched:
        assert contents(own) == inside, "a refusal changed files"
    assert not [p for p in own.rglob("*.tmp")], "a temporary file was left"


# ---------------------------------------------------------------------------------------------------
# the rows that do not fit the table


def test_a_real_read_only_run_directory_is_one_line(made: dict[str, Path], tmp_path: Path) -> None:
    """``flatbma evaluate`` of a run in a directory it cannot write: without write permission (other users),
    or bind-mounted read-only in a private mount namespace (root, who ignores the permission)."""
    run = tmp_path / "ro"
    shutil.copytree(made["sam"], run)
    before = tree(run)
    evaluate = [sys.executable, "-m", "flatbma", "evaluate", str(run), "--quiet"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    os.chmod(run, 0o500)
    try:
        if os.access(run, os.W_OK):
            if shutil.which("unshare") is None:
                pytest.skip("root, and no unshare to mount a read-only file system")
            quoted = shlex.quote(str(run))
            script = (
                f"mount --bind {quoted} {quoted} && mount -o remount,bind,ro {quoted} && exec {shlex.join(evaluate)}"
            )
            done = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, env=env)
            if "mount:" in done.stderr or "unshare:" in done.stderr:
                pytest.skip(f"cannot mount a read-only file system here: {done.stderr.strip()[:200]}")
            expected = "read-only file system"
        else:
            done = subprocess.run(evaluate, capture_output=True, text=True, env=env, cwd=tmp_path)
            expected = "permission denied"
    finally:
        os.chmod(run, 0o755)
    assert_one_line(done.returncode, done.stderr, f"cannot write {run / 'metrics.json'}: {expected}")
    assert tree(run) == before


def _cifar_c_error(tmp_path: Path) -> str:
    """The error of :func:`load_cifar_c` reading a ``.npy`` file whose header's shape is ``(2**64, 4, 4, 3)``."""
    root = tmp_path / "cifar-c"
    root.mkdir()
    np.save(root / "labels.npy", np.arange(10) % 2)
    (root / "fog.npy").write_bytes(npy_with_header("(2**64, 4, 4, 3)"))
    with pytest.raises(FlatbmaError) as info:
        load_cifar_c(root, "fog", 1)
    return str(info.value)


def test_a_corrupt_npy_header_is_one_flatbma_error(tmp_path: Path) -> None:
    """No command reads ``.npy`` (CIFAR-C is the library's): :func:`load_cifar_c` raises one line naming the file."""
    message = _cifar_c_error(tmp_path)
    assert "fog.npy" in message and "not a valid .npy file" in message and "\n" not in message, message


def test_a_corrupt_npy_header_error_is_short(tmp_path: Path) -> None:
    message = _cifar_c_error(tmp_path)
    assert len(f"flatbma: error: {message}") <= MAX_LINE and " object at 0x" not in message, message


# ---------------------------------------------------------------------------------------------------
# the rows that need a process of their own: signals and the ends of pipes (issue #23, items 19 and 21)


def _command(*args: str) -> list[str]:
    return [sys.executable, "-m", "flatbma", *args]


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "default"}


def _closed_pipe(tmp_path: Path) -> tuple[int, str]:
    """``flatbma methods | head -0``: the reader is gone before the first write."""
    read, write = os.pipe()
    os.close(read)
    try:
        done = subprocess.run(_command("methods"), stdout=write, stderr=subprocess.PIPE, text=True, env=_env())
    finally:
        os.close(write)
    return done.returncode, done.stderr


def _dev_full(tmp_path: Path) -> tuple[int, str]:
    """``flatbma methods > /dev/full``: every write of the output fails with ENOSPC."""
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full here")
    with open("/dev/full", "w") as full:
        done = subprocess.run(_command("methods"), stdout=full, stderr=subprocess.PIPE, text=True, env=_env())
    return done.returncode, done.stderr


def _sigterm(tmp_path: Path) -> tuple[int, str]:
    """SIGTERM to ``flatbma train`` once its first progress line shows it is training (it ended with -15, silently)."""
    cfg = {**_config(tmp_path / "run"), "train": {**RUN["train"], "epochs": 10_000, "progress": True}}
    proc = subprocess.Popen(
        _command("train", "--config", _write(tmp_path / "c.yaml", cfg)),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
    )
    assert proc.stderr is not None
    first = proc.stderr.readline()  # "train: sam into ..., 10000 epochs of 4 steps"
    proc.send_signal(signal.SIGTERM)
    rest = proc.stderr.read()
    return proc.wait(timeout=60), first + rest


PROCESS_ROWS = [
    # id, how the process runs, expected exit code, expected last line of stderr (None: stderr empty)
    ("closed-pipe", _closed_pipe, 141, None),
    ("dev-full", _dev_full, 2, "flatbma: error: cannot write to stdout (No space left on device)"),
    ("sigterm", _sigterm, 143, "flatbma: terminated (SIGTERM); finished checkpoints are kept"),
]


@pytest.mark.parametrize(("how", "code", "last"), [r[1:] for r in PROCESS_ROWS], ids=[r[0] for r in PROCESS_ROWS])
def test_signals_and_pipes_end_in_one_line_or_quietly(
    tmp_path: Path, how: Callable[[Path], tuple[int, str]], code: int, last: str | None
) -> None:
    returncode, err = how(tmp_path)
    assert returncode == code and "Traceback" not in err and "Exception ignored" not in err, (returncode, err)
    lines = [line for line in err.splitlines() if not line.startswith(("train:", "epoch "))]  # progress lines
    assert lines == ([] if last is None else [lines[-1]]), err
    assert last is None or lines[-1].startswith(last), err


# ---------------------------------------------------------------------------------------------------
# the Python API (issue #23, item 18): FlatbmaError subclasses with the command line's wording


def _loader(x: torch.Tensor, *rest: torch.Tensor, dataset: Any = None) -> Any:
    from torch.utils.data import DataLoader, TensorDataset

    return DataLoader(dataset if dataset is not None else TensorDataset(x, *rest), batch_size=16)


class _Dicts(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"features": torch.zeros(5), "y": torch.tensor(0)}  # no input key (x, input, image, ...)


def _net() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


X, Y = torch.randn(32, 5, generator=torch.Generator().manual_seed(0)), torch.arange(32) % 3


def _fit(model: Any = None, loader: Any = None, **kwargs: Any) -> Any:
    import flatbma

    model = _net() if model is None else model
    return flatbma.fit_posterior(model, _loader(X, Y) if loader is None else loader, "sgd", epochs=1, **kwargs)


@pytest.fixture(scope="module")
def predictor(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    bma = _fit(num_samples=2)
    path = tmp_path_factory.mktemp("api") / "sgd.safetensors"
    bma.save(path)
    return bma, path


def _load(path: Any, model: Any) -> Any:
    import flatbma

    return flatbma.load_posterior(path, model)


API_ROWS = [
    # id, the call (given the module's saved predictor and its path), the error type, its first words
    ("loader-of-dicts", lambda b, p: _fit(loader=_loader(X, dataset=_Dicts())), TypeError, "a dict batch must hold"),
    ("loader-of-3-tuples", lambda b, p: _fit(loader=_loader(X, Y, Y)), TypeError, "a training batch must be"),
    ("loader-of-1-tuples", lambda b, p: _fit(loader=_loader(X)), TypeError, "a training batch must be"),
    ("float-labels", lambda b, p: _fit(loader=_loader(X, Y.float())), TypeError, "labels must be integer"),
    ("labels-out-of-range", lambda b, p: _fit(loader=_loader(X, Y + 5)), ValueError, "label 5 is out of range"),
    ("2-d-labels", lambda b, p: _fit(loader=_loader(X, Y[:, None])), ValueError, "labels must be 1-D"),
    ("nothing-trainable", lambda b, p: _fit(_net().requires_grad_(False)), ValueError, "the model has no trainable"),
    ("meta-model", lambda b, p: _fit(_net().to("meta")), ValueError, "the model has weights on the meta device"),
    ("float64-model", lambda b, p: _fit(_net().double()), ValueError, "the model has float64 weights but its inputs"),
    ("float16-model", lambda b, p: _fit(_net().half()), ValueError, "the model has float16 weights: flatbma trains"),
    ("cuda-without-cuda", lambda b, p: _fit(device="cuda"), ValueError, "device is 'cuda' but CUDA is not available"),
    ("seed-2**70", lambda b, p: _fit(seed=2**70), ValueError, "seed must be an integer in [0, 2**63)"),
    ("predict-wrong-features", lambda b, p: b.predict_proba(torch.randn(4, 7)), ValueError, "the model fails on"),
    ("predict-int-tensor", lambda b, p: b.predict_proba(torch.ones(4, 5, dtype=torch.long)), TypeError, "inputs must"),
    ("load-posterior-net", lambda b, p: _load(p, "net"), TypeError, "model must be a torch.nn.Module, got a str"),
    ("load-posterior-dir", lambda b, p: _load(p.parent, _net()), ValueError, "/"),  # "<dir> is a directory"
]


@pytest.mark.parametrize(("call", "kind", "start"), [r[1:] for r in API_ROWS], ids=[r[0] for r in API_ROWS])
def test_a_bad_api_call_is_one_flatbma_error(
    predictor: tuple[Any, Path], call: Callable[..., Any], kind: type, start: str
) -> None:
    with pytest.raises(FlatbmaError) as info:
        call(*predictor)
    message = str(info.value)
    assert isinstance(info.value, kind) and message.startswith(start), message
    if start == "/":
        assert message.endswith("is a directory, not a predictor file: give the path bma.save(path) wrote"), message
    assert "\n" not in message and len(f"flatbma: error: {message}") <= MAX_LINE, message
