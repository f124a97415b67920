"""The ``flatbma`` command line: ``train``, ``evaluate``, ``compare``, ``methods``.

Every :class:`~flatbma.errors.FlatbmaError` ends the command with one line on stderr and exit code 2
(:func:`main` lists every way a command ends).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import io
import json
import os
import signal
import sys
import threading
import typing
import warnings
from collections.abc import Iterator, Sequence
from enum import Enum
from pathlib import Path

import torch

import flatbma
from flatbma import progress
from flatbma.checks import shown
from flatbma.errors import FlatbmaError, FlatbmaWarning, suggest
from flatbma.experiment.config.run_config import load_config
from flatbma.experiment.parallel import processes
from flatbma.experiment.report.repeatability import repeat_disagreement
from flatbma.experiment.report.tables import summary_table
from flatbma.experiment.run.build import resolve_device
from flatbma.experiment.run.pipeline import evaluate_run, load_run_config, resume_config, train
from flatbma.experiment.study.compare import run_compare
from flatbma.experiment.study.plan import load_plan
from flatbma.health import is_flagged
from flatbma.methods import METHODS, MethodConfig, parse_method
from flatbma.metric_names import SUMMARY
from flatbma.optim import Amortized
from flatbma.options import plain_values, type_name

# What str.splitlines() breaks on: escaped in error messages (user values such as keys and paths may hold them).
_ESCAPE_LINE_BREAKS = {ord(c): repr(c)[1:-1] for c in "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"}
SUMMARY_KEYS = SUMMARY
"""What ``flatbma train`` prints on its last line (:data:`flatbma.metric_names.SUMMARY`)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2, like every other flatbma error
        raise FlatbmaError(f"{message} (see '{self.prog} --help')")


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="flatbma", description="Flat-posterior-aware Bayesian deep learning.")
    parser.add_argument(
        "--version", action="version", version=f"flatbma {flatbma.__version__} (torch {torch.__version__})"
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    train = sub.add_parser("train", help="train a method from a YAML config and evaluate its BMA")
    train.add_argument("--config", help="YAML config (see configs/)")
    train.add_argument("--resume", metavar="RUN_DIR", help="continue an interrupted run from its last checkpoint")
    train.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value, e.g. --set optim.lr=0.1 --set method.rho=0.1 (repeatable)",
    )
    train.add_argument(
        "--force",
        action="store_true",
        help="train anew over the run in output_dir (another config's, or this one's finished or interrupted); "
        "it is replaced only once the new run writes its first checkpoint",
    )
    _add_quiet(train)

    evaluate = sub.add_parser("evaluate", help="re-evaluate a finished run directory")
    evaluate.add_argument("run_dir", help="the output_dir of a run")
    evaluate.add_argument(
        "--flatness", action="store_true", help="add Hessian spectra and distribution-level flatness to metrics.json"
    )
    evaluate.add_argument(
        "--ood",
        metavar="SET",
        help="OOD detection against SET (a corruption at severity 5, or a data set; eval.ood): AUROC of the "
        "predictive entropy and of the mutual information",
    )
    _add_quiet(evaluate)

    compare = sub.add_parser("compare", help="compare methods x seeds: BMA metrics, corruptions, flatness, reports")
    compare.add_argument("--config", required=True, help="YAML config with a 'compare' section (configs/demo.yaml)")
    compare.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help="override a config value"
    )
    compare.add_argument("--quick", action="store_true", help="the reduced setting of the config's compare.quick")
    compare.add_argument("--force", action="store_true", help="replace results of a different config")
    _add_quiet(compare)

    methods = sub.add_parser("methods", help="list the registered methods, or one method's options and defaults")
    methods.add_argument("name", nargs="?", help="a method name: show its options, their types and defaults")
    return parser


def _add_quiet(command: argparse.ArgumentParser) -> None:
    command.add_argument(
        "--quiet",
        action="store_true",
        help="no progress on stderr: no bars on a terminal, no line per epoch or phase elsewhere (errors still print)",
    )


def _reporting(args: argparse.Namespace, *, every_process: bool = False) -> contextlib.AbstractContextManager:
    """The command's :class:`~flatbma.progress.Reporter`, set once for the whole command.

    Quiet with ``--quiet`` and, unless ``every_process`` (compare: each process runs its own runs), on every
    process but rank 0.
    """
    quiet = args.quiet or not (every_process or processes.is_main())
    return progress.reporting(progress.Reporter(quiet=quiet))


def _plain(value: object) -> object:
    if isinstance(value, MethodConfig):  # a nested method section (multi's of)
        return plain_values(value.to_dict())
    return value.value if isinstance(value, Enum) else value


def _describe_method(name: str) -> str:
    """A method's summary and every option it takes, with its type and default (``flatbma methods NAME``)."""
    if name not in METHODS:
        raise FlatbmaError(f"unknown method {shown(name)}.{suggest(name, METHODS)} Run 'flatbma methods' to list them")
    spec = METHODS[name]
    defaults = parse_method(name)
    hints = spec.family_options()
    rows = [(key, hints.get(key), value) for key, value in defaults.options.items()]
    if defaults.ascent is not None:
        ascent_hints = typing.get_type_hints(type(defaults.ascent))
        rows += [
            (f.name, ascent_hints.get(f.name), getattr(defaults.ascent, f.name))
            for f in dataclasses.fields(defaults.ascent)
        ]
        amortized_hints = typing.get_type_hints(Amortized)  # optional: the plain step when none is given
        rows += [(k, amortized_hints[k], f.default) for k, f in spec.amortized_options().items()]
    lines = [f"{name}: {spec.summary}"]
    ascent = f" + {spec.ascent.__name__}" if spec.ascent is not None else ""
    lines.append(f"  family: {spec.family.build.__module__}.{spec.family.build.__name__}{ascent}")
    if not rows:
        lines.append("  (no options)")
    width = max((len(key) for key, _, _ in rows), default=0)
    for key, tp, value in rows:
        if isinstance(tp, type) and issubclass(tp, Enum):
            kind = " | ".join(str(member.value) for member in tp)  # the spellings a config may use
        else:
            kind = type_name(tp).replace(" or ", " | ")
        lines.append(f"  {key:<{width}}  {_plain(value)!r:<12}  {kind}")
    for part in (spec.family.options, spec.ascent):  # what the family's and the ascent's options mean, in a few lines
        notes = getattr(part, "NOTES", None)
        if notes:
            lines += ["", *(f"  {line}" for line in notes.strip().splitlines())]
    return "\n".join(lines)


def _out_of_memory(e: BaseException) -> str:
    """``"out of memory (...)"`` when ``e`` reports a failed allocation (CPU or CUDA), else ``""``."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    too_large = "can't allocate memory" in text or "Storage size calculation overflowed" in text
    if not (isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError" or too_large):
        return ""
    detail = text.split("DefaultCPUAllocator: ")[-1].translate(_ESCAPE_LINE_BREAKS)
    return f"out of memory ({detail})" if detail else "out of memory"


def _print_metrics(metrics: dict) -> None:
    print("  ".join(f"{k}={metrics[k]:.4f}" for k in SUMMARY_KEYS if isinstance(metrics.get(k), (int, float))))
    ood = metrics.get("ood")
    if isinstance(ood, dict):
        mi = ood.get("auroc_mutual_information")
        print(
            f"OOD ({ood.get('set')}): AUROC of entropy={ood.get('auroc_entropy'):.4f}  AUROC of mutual "
            f"information={'–' if mi is None else format(mi, '.4f')}"
        )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``flatbma`` command: its exit code.

    Exit codes: 0 (done); :data:`FLAGGED` (3: done and written, but a training-health rule flags the run or a
    compared row diverged, said in a ``flatbma: warning:`` line); 2 with one line ``flatbma: error: ...`` (an input
    error, a machine too small for the config, an unwritable output); 130 (SIGINT) or 143 (SIGTERM) with one line
    saying finished checkpoints are kept; 141 silently when the output's reader went away (SIGPIPE). flatbma's own
    warnings print as one ``flatbma: warning: ...`` line each, other libraries' not at all.
    """
    try:
        with _terminated_on_sigterm(), _warnings_as_lines():
            code = _command(argv)
            sys.stdout.flush()  # here, not at exit: a full or closed output ends as every other error
    except FlatbmaError as e:
        _error(str(e))
        return 2
    except BrokenPipeError:
        _discard_stdout()
        return 141
    except OSError as e:
        if e.filename is not None:  # a path the user gave (too long a name, no permission) that no check caught
            _error(f"cannot use {shown(str(e.filename), 80)} ({e.strerror or type(e).__name__}): check the path")
            return 2
        if e.errno not in _OUTPUT_ERRNOS:
            raise
        _discard_stdout()
        _error(f"cannot write to stdout ({e.strerror}): send the output elsewhere or free space")
        return 2
    except (MemoryError, RuntimeError) as e:  # a config too large for this machine (torch's OOM is a RuntimeError)
        if not _out_of_memory(e):
            raise
        _error(
            f"{_out_of_memory(e)}: lower data.batch_size, data.eval_batch_size, data.image_size, model.width or "
            "eval.num_samples"
        )
        return 2
    except KeyboardInterrupt:
        print("flatbma: interrupted; finished checkpoints are kept", file=sys.stderr)
        return 130
    except _Terminated:
        print("flatbma: terminated (SIGTERM); finished checkpoints are kept", file=sys.stderr)
        return 143
    return code


FLAGGED = 3
"""The exit code of a command that wrote its results but whose run a training-health rule flags
(:mod:`flatbma.health`), or of a comparison with a flagged or diverged row. Under ``torchrun`` the processes exit 0
(torchrun reports any other code as a crash); the warning lines still say it."""


_OUTPUT_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO)
"""Errors of writing to stdout that end the command in one line (a full disk or ``/dev/full``)."""


def _error(message: str) -> None:
    print(f"flatbma: error: {message.translate(_ESCAPE_LINE_BREAKS)}", file=sys.stderr)


def _discard_stdout() -> None:
    """Point stdout at ``/dev/null``, so that the interpreter's last flush of what it still holds cannot fail."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError, io.UnsupportedOperation):  # no file descriptor: nothing to flush
        pass


class _Terminated(BaseException):
    """SIGTERM arrived (:func:`_terminated_on_sigterm`); a ``BaseException`` like ``KeyboardInterrupt``."""


def _raise_terminated(signum: int, frame: object) -> None:
    raise _Terminated


@contextlib.contextmanager
def _terminated_on_sigterm() -> Iterator[None]:
    """Within the block SIGTERM raises :class:`_Terminated` (in the main thread; elsewhere signals are not ours)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


def _show_warning(message: Warning | str, category: type[Warning], *args: object, **kwargs: object) -> None:
    if issubclass(category, FlatbmaWarning):  # one line: a break in a value it quotes (a path) is escaped
        text = str(message).strip().translate(_ESCAPE_LINE_BREAKS) or category.__name__
        text = text if len(text) <= 300 else text[:297] + "..."
        print(f"flatbma: warning: {text}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _warnings_as_lines() -> Iterator[None]:
    """The warnings of flatbma (:class:`~flatbma.errors.FlatbmaWarning`) as one line each; no other library's."""
    with warnings.catch_warnings():
        warnings.showwarning = _show_warning
        yield


def _command(argv: Sequence[str] | None) -> int:
    """Parse ``argv`` and run the command (its errors are :func:`main`'s): 0, or :data:`FLAGGED`."""
    args = _build_parser().parse_args(argv)
    flagged, alone = False, True
    if args.command == "methods" and args.name:
        print(_describe_method(args.name))
    elif args.command == "methods":
        width = max(map(len, METHODS))
        for name, spec in METHODS.items():
            print(f"{name:<{width}}  {spec.summary}")
        sys.stdout.flush()  # the list is the output: a failure to write it ends the command before the hint
        print("('flatbma methods NAME' shows a method's options, their types and defaults)", file=sys.stderr)
    elif args.command == "train":
        resumed = None
        if args.resume:
            if args.config:
                raise FlatbmaError(
                    "--resume continues a run with its own config: drop --config (--set may change the "
                    "learning rate, epochs, checkpoint cadence or eval options)"
                )
            cfg, resumed = resume_config(args.resume, args.overrides)
        elif args.config:
            cfg = load_config(args.config, args.overrides)
        else:
            raise FlatbmaError("train needs --config FILE (or --resume RUN_DIR)")
        device = resolve_device(cfg.train.device)
        with processes.process_group(device), _reporting(args):  # under torchrun: data-parallel
            trained = train(cfg, force=args.force, resume=bool(args.resume), resumed=resumed)
            main_process, alone = processes.is_main(), processes.world_size() == 1
        flagged = is_flagged(trained.metrics.get("health"))
        if main_process:
            _print_metrics(trained.metrics)
            run_dir = Path(cfg.output_dir)
            if trained.reused:
                print(f"{run_dir} holds this run, finished: nothing trained or written (--force trains again)")
            else:
                print(f"wrote {run_dir / 'metrics.json'}")
    elif args.command == "compare":
        plan = load_plan(args.config, args.overrides, quick=args.quick)
        device = resolve_device(plan.base.train.device)
        with processes.process_group(device), _reporting(args, every_process=True):  # torchrun: runs spread
            results = run_compare(plan, force=args.force)
            main_process, alone = processes.is_main(), processes.world_size() == 1
        flagged = any(is_flagged(row.get("health")) or "error" in row for row in results["runs"])
        if main_process:
            print(summary_table(results))
            print(f"wrote {plan.out_dir / 'results.json'}, results.csv, report.md and report.html")
    elif args.command == "evaluate":
        device = resolve_device(load_run_config(args.run_dir).train.device)
        with processes.process_group(device), _reporting(args):  # under torchrun: each evaluates a shard
            metrics = evaluate_run(args.run_dir, flatness=args.flatness, ood=args.ood)
            main_process, alone = processes.is_main(), processes.world_size() == 1
        flagged = is_flagged(metrics.get("health"))
        if main_process:
            _print_metrics(metrics)
            print(json.dumps({k: metrics[k] for k in SUMMARY_KEYS if k in metrics}))
            disagreement = repeat_disagreement(metrics.get("repeatability")) if args.flatness else None
            if disagreement:  # the numbers above hold a λ₁ that a second measurement did not reproduce
                sys.stdout.flush()
                print(f"flatbma: warning: {disagreement}", file=sys.stderr, flush=True)
    return FLAGGED if flagged and alone else 0
