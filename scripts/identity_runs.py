"""Tiny CLI runs of every family whose numbers a refactor must keep bit for bit, and their diff against a reference.

    python scripts/identity_runs.py run OUT [--src OTHER/src] [--only NAME ...] [--resume-from REFERENCE]
    python scripts/identity_runs.py diff REFERENCE OUT

``run`` trains each run of :data:`RUNS` (digits or diabetes with the MLP, 1-2 epochs: seconds each) with
``python -m flatbma`` in a fresh process — with ``--src`` the flatbma of another tree (a worktree of the commit
to compare against, e.g. ``git worktree add --detach /tmp/ref main``), first on ``PYTHONPATH`` — into
``OUT/<name>``. The resumed run trains its first epoch into ``OUT/resumed-start`` and continues a copy of it in
``OUT/resumed``; with ``--resume-from`` it continues a copy of ``REFERENCE/resumed-start`` instead (a checkpoint
another version wrote). ``diff`` compares every ``metrics.json``, ``results.json``, ``log.csv``, ``config.yaml`` and the
tensors of every ``*.safetensors`` file, bit for bit, leaving out what differs between two runs of the same code
(timings, paths, library versions, checksums over metadata that holds them); it prints each difference and exits 1
when there is one. The runs cover every family and composition, fp16 and bf16, a two-stage prior run, a resumed
run, ``flatbma evaluate``, ``flatbma compare`` with a prior and with a regression, and two transfer runs from the
pretrained MobileNetV2 of ``fpbma-transfer`` (its two stages; a MultiSWAG whose members re-draw only what is not
pretrained).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
import yaml

DIGITS = ["data.test_limit=200", "train.epochs=2", "eval.num_samples=3", "train.log=[csv]"]
"""The overrides every digits run gets (the config is the shipped ``digits-sam``)."""

RUNS: dict[str, list[list[str]]] = {
    "sgd": [["method={name: sgd}"]],
    "sam-fp16": [["method={name: sam}", "train.precision=fp16"]],
    "asam-bf16": [["method={name: asam}", "train.precision=bf16"]],
    "fsam": [["method={name: fsam}"]],
    "swag": [["method={name: swag, rank: 3, collect_every: 1}"]],
    "swag-diag": [["method={name: swag-diag, collect_every: 1}"]],
    "f-swag": [["method={name: f-swag, rank: 3, collect_every: 1}"]],
    "mfvi": [["method={name: mfvi}"]],
    "lowrank-vi": [["method={name: lowrank-vi, rank: 3}"]],
    "f-mfvi": [["method={name: f-mfvi}"]],
    "f-lowrank-vi": [["method={name: f-lowrank-vi, rank: 3}"]],
    "bsam": [["method={name: bsam}"]],
    "ivon": [["method={name: ivon}", "optim.lr=0.1"]],
    "f-ivon": [["method={name: f-ivon}", "optim.lr=0.1"]],
    "mc-dropout": [["method={name: mc-dropout}"]],
    "f-mc-dropout": [["method={name: f-mc-dropout}"]],
    "ensemble": [["method={name: ensemble, size: 2}"]],
    "f-ensemble": [["method={name: f-ensemble, size: 2}"]],
    "sgld": [["method={name: sgld, burn_in: 10, thin: 5}"]],
    "csgld": [["method={name: csgld, cycle_length: 19}"]],
    "f-sgld": [["method={name: f-sgld, burn_in: 10, thin: 5}"]],
    "fp-bma": [["method={name: fp-bma, rank: 3}"]],
    "fp-bma-amortized": [["method={name: fp-bma, rank: 3, ascent_every: 2}"]],
    "multiswag": [["method={name: multiswag, members: 2, of: {name: swag, rank: 2, collect_every: 1}}"]],
    "laplace": [["method={name: laplace}"]],
    "laplace-full-glm": [["method={name: laplace, subset: all, hessian: diag, of: {name: sam}}"]],
    "f-laplace": [["method={name: f-laplace, predictive: probit}"]],
    "fp-bma-prior": [
        [
            "method={name: fp-bma, rank: 3}",
            "prior={method: {name: swag, rank: 3, collect_every: 1}, epochs: 2, init: true}",
        ]
    ],
    "multi-fp-bma-prior": [
        [
            "method={name: multi-fp-bma, members: 2, of: {name: fp-bma, rank: 2}}",
            "prior={method: {name: swag, rank: 2, collect_every: 1}, epochs: 2}",
        ]
    ],
    "flatness": [["method={name: swag, rank: 3, collect_every: 1}", "eval.flatness=true", "eval.flatness_samples=2"]],
    "early-stopping": [
        ["method={name: sgd}", "data.val_fraction=0.1", "train.early_stopping={patience: 1}", "train.epochs=3"]
    ],
    "resumed": [
        ["--start", "method={name: swag, rank: 3, collect_every: 1}", "train.epochs=1"],
        ["--resume", "train.epochs=2"],
    ],
    "evaluated": [["method={name: mfvi}"], ["--evaluate"]],
    "regression": [["method={name: sgd}", "--diabetes"]],
    "regression-swag": [["method={name: swag, rank: 3, collect_every: 2}", "--diabetes"]],
    "transfer-prior": [["--transfer", "prior.epochs=2", "prior.method.start_step=2", "prior.method.collect_every=1"]],
    "transfer-multiswag": [
        [
            "--transfer",
            "method={name: multiswag, members: 2, of: {name: swag, rank: 2, start_step: 1, collect_every: 1}}",
            "prior=null",
        ]
    ],
    "compare-prior": [["--compare"]],
    "compare-regression": [["--compare-regression"]],
}
"""Name → the commands of the run (``--set`` overrides; a first word ``--resume``/``--evaluate``/``--compare`` says
which command)."""

COMPARE = """
seed: 0
output_dir: {out}
data: {{name: digits, batch_size: 64, test_limit: 200}}
model: {{name: mlp}}
optim: {{lr: 0.05}}
train: {{epochs: 2, log: [csv]}}
eval: {{num_samples: 3, flatness_samples: 2, hessian_max_iter: 20}}
compare:
  methods:
    - {{name: sgd}}
    - {{name: sam}}
    - {{name: fp-bma, rank: 3, prior: {{method: {{name: swag, rank: 3, collect_every: 1}}, epochs: 2}}}}
  seeds: [0]
  corruptions: [gaussian_noise]
  severities: [3]
  corruption_samples: 2
  bma_curve: [1, 3]
  flatness: true
  landscape: true
"""

REGRESSION = ["data.test_limit=50", "train.epochs=2", "eval.num_samples=3", "train.log=[csv]"]
TRANSFER = ["data.test_limit=100", "train.epochs=1", "eval.num_samples=3", "train.log=[csv]"]
"""The overrides of a transfer run (the shipped ``fpbma-transfer``: an ImageNet MobileNetV2, norm+classifier)."""

IGNORED = {
    "environment",
    "output_dir",
    "run_dir",
    "path",
    "checksum",
    "written_by",
    "flatbma",
    "git",
    "code",
    "host",
    "date",
    "config_file",
    "created",
}
"""Keys whose values differ between two runs of the same code (or only name where the run is)."""


def _ignored(key: str) -> bool:
    k = key.lower()
    return k in IGNORED or any(w in k for w in ("time", "seconds", "elapsed", "_s_", "wall", "duration", "started"))


def _command(args: list[str], out: Path, name: str) -> list[str]:
    run_dir = out / name
    if args[0] == "--resume":
        return ["train", "--quiet", "--resume", str(run_dir), *[a for x in args[1:] for a in ("--set", x)]]
    if args[0] == "--start":
        run_dir = out / f"{name}-start"
        args = args[1:]
    if args[0] == "--evaluate":
        return ["evaluate", "--quiet", str(run_dir)]
    if args[0] in ("--compare", "--compare-regression"):
        config = out / f"{name}.yaml"
        if args[0] == "--compare":
            config.write_text(COMPARE.format(out=run_dir))
            return ["compare", "--quiet", "--config", str(config)]
        return [
            "compare",
            "--quiet",
            "--config",
            "diabetes-regression",
            *[a for x in [*REGRESSION, "train.epochs=4", f"output_dir={run_dir}"] for a in ("--set", x)],
        ]
    if "--diabetes" in args:
        sets = [*REGRESSION, *[a for a in args if a != "--diabetes"]]
        config = "diabetes-regression"
    elif "--transfer" in args:
        sets = [*TRANSFER, *[a for a in args if a != "--transfer"]]
        config = "fpbma-transfer"
    else:
        sets, config = [*DIGITS, *args], "digits-sam"
    sets = [*sets, f"output_dir={run_dir}"]
    return ["train", "--quiet", "--config", config, *[a for x in sets for a in ("--set", x)]]


def run(out: Path, src: str | None, only: list[str], resume_from: Path | None = None) -> int:
    """Train every run of :data:`RUNS` (or those of ``only``) into ``out``; 1 when one failed.

    A ``--resume`` command continues a copy of ``<name>-start``: this run's, or ``resume_from``'s.
    """
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if src is not None:
        env["PYTHONPATH"] = str(Path(src).resolve()) + os.pathsep + env.get("PYTHONPATH", "")
    where = subprocess.run(
        [sys.executable, "-c", "import flatbma; print(flatbma.__file__)"], env=env, capture_output=True, text=True
    )
    print(f"flatbma from {where.stdout.strip()}", flush=True)
    failed = 0
    for name, commands in RUNS.items():
        if only and name not in only:
            continue
        start = time.perf_counter()
        for stale in (out / name, out / f"{name}-start"):  # never reuse a finished run of the same config
            shutil.rmtree(stale, ignore_errors=True)
        for args in commands:
            if args[0] == "--resume":
                shutil.rmtree(out / name, ignore_errors=True)
                shutil.copytree((resume_from or out) / f"{name}-start", out / name)
            argv = [sys.executable, "-m", "flatbma", *_command(args, out, name)]
            done = subprocess.run(argv, env=env, capture_output=True, text=True, cwd=out)
            if done.returncode not in (0, 3):  # 3: finished, flagged by a health rule (its files are written)
                failed += 1
                print(f"{name}: FAILED ({' '.join(argv[3:])})\n{done.stderr[-2000:]}", flush=True)
                break
        print(f"{name}: {time.perf_counter() - start:.1f} s", flush=True)
    return 1 if failed else 0


def _compare_json(a: object, b: object, where: str, out: list[str]) -> None:
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b), key=str):
            if _ignored(str(key)):
                continue
            if key not in a or key not in b:
                out.append(f"{where}.{key}: only in {'reference' if key in a else 'new'}")
            else:
                _compare_json(a[key], b[key], f"{where}.{key}", out)
    elif isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            out.append(f"{where}: {len(a)} entries vs {len(b)}")
        for i, (x, y) in enumerate(zip(a, b, strict=False)):
            _compare_json(x, y, f"{where}[{i}]", out)
    elif isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return
    elif a != b or type(a) is not type(b):
        out.append(f"{where}: {a!r} vs {b!r}")


def _text(path: Path, root: Path) -> str:
    """``path``'s text with the runs' root directory written ``<OUT>`` (paths in messages and records)."""
    return "" if path.suffix == ".safetensors" else path.read_text().replace(str(root.resolve()), "<OUT>")


def _csv_rows(text: str) -> list[dict[str, str]]:
    return [{k: v for k, v in row.items() if not _ignored(k)} for row in csv.DictReader(io.StringIO(text))]


def _tensors(path: Path) -> dict[str, object]:
    from safetensors.torch import load_file

    return load_file(str(path))


def _compare_tensors(a: Path, b: Path, where: str, out: list[str]) -> None:
    ta, tb = _tensors(a), _tensors(b)
    for key in sorted(set(ta) | set(tb)):
        if key not in ta or key not in tb:
            out.append(f"{where}: tensor {key!r} only in {'reference' if key in ta else 'new'}")
            continue
        x, y = ta[key], tb[key]
        same = x.dtype == y.dtype and x.shape == y.shape
        if not (same and torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))):
            out.append(f"{where}: tensor {key!r} differs")  # bit for bit: NaNs included


def diff(reference: Path, new: Path) -> int:
    """Print every difference between the runs in ``reference`` and ``new``; 1 when there is one."""
    out: list[str] = []
    files = sorted(p.relative_to(reference) for p in reference.rglob("*") if p.is_file())
    compared = 0
    for rel in files:
        a, b = reference / rel, new / rel
        suffix = rel.suffix
        if suffix not in (".json", ".csv", ".yaml", ".safetensors") or rel.name.endswith(".lock"):
            continue
        if not b.is_file():
            out.append(f"{rel}: missing in {new}")
            continue
        compared += 1
        ta, tb = (_text(p, root) for p, root in ((a, reference), (b, new)))
        if suffix == ".json":
            _compare_json(json.loads(ta), json.loads(tb), str(rel), out)
        elif suffix == ".yaml":
            _compare_json(yaml.safe_load(ta), yaml.safe_load(tb), str(rel), out)
        elif suffix == ".csv":
            _compare_json(_csv_rows(ta), _csv_rows(tb), str(rel), out)
        else:
            _compare_tensors(a, b, str(rel), out)
    extra = sorted(
        str(p.relative_to(new)) for p in new.rglob("*") if p.is_file() and not (reference / p.relative_to(new)).exists()
    )
    out += [f"{e}: only in {new}" for e in extra if not e.endswith(".lock")]
    for line in out:
        print(line)
    print(f"{compared} files compared, {len(out)} differences")
    return 1 if out else 0


def main() -> int:
    """The command line (the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run")
    r.add_argument("out", type=Path)
    r.add_argument("--src", help="the src/ directory of the flatbma to run (default: the installed one)")
    r.add_argument("--only", nargs="*", default=[])
    r.add_argument("--resume-from", type=Path, help="continue the resumed run from this reference's checkpoint")
    d = sub.add_parser("diff")
    d.add_argument("reference", type=Path)
    d.add_argument("new", type=Path)
    args = parser.parse_args()
    if args.command == "run":
        return run(args.out.resolve(), args.src, args.only, args.resume_from)
    return diff(args.reference, args.new)


if __name__ == "__main__":
    sys.exit(main())
