"""Who wrote a run's checkpoint (:class:`Provenance`) and what a checkpoint must hold to be a run's (:class:`Template`).

Loading a checkpoint checks its recorded method and fingerprints of options and model against the loading run
(:func:`check_provenance`), and its tensors against a fresh state of the run's method (:func:`template`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor, nn

import flatbma
from flatbma.errors import FlatbmaError
from flatbma.experiment.config.parse import shown
from flatbma.options import plain, plain_values
from flatbma.params import model_buffers, trainable_params
from flatbma.state_io import clip, dtype_name
from flatbma.types import Posterior, State

if TYPE_CHECKING:
    from flatbma.experiment.run.build import Experiment

WRITTEN_BY = "written_by"
"""Metadata key of a run checkpoint's :class:`Provenance` (JSON)."""


def fingerprint(value: Any) -> str:
    """A short hash of a JSON-like ``value`` (keys sorted): equal values, equal fingerprints."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def model_fingerprint(model: nn.Module, config: Mapping[str, Any]) -> str:
    """:func:`fingerprint` of the ``model`` section and each parameter's/buffer's name, shape, dtype, trained flag."""
    structure = sorted(
        [f"param:{k}", list(v.shape), dtype_name(v), bool(v.requires_grad)] for k, v in model.named_parameters()
    ) + sorted([f"buffer:{k}", list(v.shape), dtype_name(v)] for k, v in model.named_buffers())
    return fingerprint({"structure": structure, "config": dict(config)})


@dataclass(frozen=True)
class Provenance:
    """Who wrote a run's checkpoint, saved in its metadata and checked when it is loaded.

    Attributes:
        method: the method's name (``method.name``).
        options: the resolved ``method`` section (name and every option), JSON values.
        model: the resolved ``model`` section.
        model_fingerprint: :func:`model_fingerprint` of the model and ``model``.
        flatbma: the flatbma version that wrote it (``None``: not recorded); never checked (the format tag
            decides whether a file can be read).
    """

    method: str
    options: Mapping[str, Any]
    model: Mapping[str, Any]
    model_fingerprint: str
    flatbma: str | None = flatbma.__version__

    @property
    def options_fingerprint(self) -> str:
        """:func:`fingerprint` of :attr:`options`."""
        return fingerprint(dict(self.options))

    def to_json(self) -> str:
        """The metadata text (:meth:`from_json` reads it)."""
        record = dataclasses.asdict(self) | {"options_fingerprint": self.options_fingerprint}
        return json.dumps(record, sort_keys=True, default=str)

    @classmethod
    def from_json(cls, text: str) -> Provenance:
        """Read :meth:`to_json`'s text; ``ValueError`` when it is damaged or its fingerprints do not match."""
        record = json.loads(text)
        fields = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(record, dict) or set(record) != fields | {"options_fingerprint"}:
            raise ValueError("fields")
        kinds = {"method": str, "options": dict, "model": dict, "model_fingerprint": str}
        if not all(isinstance(record[k], t) for k, t in kinds.items()):
            raise ValueError("types")
        if not isinstance(record["flatbma"], str | None):
            raise ValueError("version")
        made = cls(**{k: record[k] for k in fields})
        if made.options_fingerprint != record["options_fingerprint"]:
            raise ValueError("options fingerprint")
        return made


def _differences(have: Mapping[str, Any], want: Mapping[str, Any]) -> str:
    """``"key=old → new, ..."`` for the keys whose values differ (missing: ``—``)."""
    keys = sorted({*have, *want}, key=str)
    parts = [
        f"{k}={'—' if k not in have else shown(have[k], 30)} vs {'—' if k not in want else shown(want[k], 30)}"
        for k in keys
        if have.get(k, _MISSING) != want.get(k, _MISSING)
    ]
    return clip(", ".join(parts))


_MISSING = object()


def check_provenance(meta: Mapping[str, str], want: Provenance, path: str | Path) -> Provenance:
    """Raise :class:`FlatbmaError` unless the checkpoint's metadata says ``want`` wrote it; returns the record."""
    text = meta.get(WRITTEN_BY)
    if text is None:
        raise FlatbmaError(f"checkpoint {path} does not record who wrote it (an older flatbma's?): train the run again")
    try:
        have = Provenance.from_json(text)
    except (ValueError, TypeError):
        raise FlatbmaError(
            f"checkpoint {path}: the record of who wrote it is damaged; restore the run's own checkpoint or train again"
        ) from None
    todo = "restore the run's own checkpoint, or train this config into another output_dir"
    if have.method != want.method:
        raise FlatbmaError(
            f"checkpoint {path} was written by method {shown(have.method)} but this run is {shown(want.method)}: {todo}"
        )
    if have.options_fingerprint != want.options_fingerprint:
        raise FlatbmaError(
            f"checkpoint {path} was written with other {want.method} options than this run's "
            f"({_differences(have.options, want.options)}; checkpoint vs run): {todo}"
        )
    if have.model_fingerprint != want.model_fingerprint:
        detail = (
            f"model {_differences(have.model, want.model)}; checkpoint vs run"
            if dict(have.model) != dict(want.model)
            else f"the same model section, but parameters of other names, shapes or dtypes: fingerprint "
            f"{have.model_fingerprint} vs {want.model_fingerprint}, e.g. another number of classes"
        )
        raise FlatbmaError(f"checkpoint {path} was written for another model than this run's ({detail}): {todo}")
    return have


@dataclass(frozen=True)
class Template:
    """What a checkpoint must hold to be a given run's (:func:`template` builds it from the run's experiment).

    Attributes:
        provenance: who must have written it.
        state: the fresh state of the run's method and model: every tensor's name, dtype and shape.
        epochs: the epochs the run trains, ``train.epochs`` plus its method's extra ones.
        batches: batches per epoch (the position's batch lies in ``[0, batches]``); ``None`` if unknown.
        loader_rng: a state of the data-order generator (its size and dtype), ``None`` if the loader has none.
        device: where the loaded state goes.
    """

    provenance: Provenance
    state: State
    epochs: int
    batches: int | None
    loader_rng: Tensor | None
    device: torch.device


def provenance(exp: Experiment) -> Provenance:
    """The :class:`Provenance` of checkpoints written by ``exp``'s run."""
    cfg = exp.config
    model = plain(cfg.model)
    return Provenance(
        method=cfg.method.name,
        options=json.loads(json.dumps(plain_values(cfg.method.to_dict()), default=str)),
        model=json.loads(json.dumps(model, default=str)),
        model_fingerprint=model_fingerprint(exp.model, model),
    )


def template(exp: Experiment) -> Template:
    """The :class:`Template` of ``exp``'s run (its reference state drawn under a forked RNG)."""
    state = reference_state(exp.method, exp.model, exp.device)
    generator = getattr(exp.train_loader, "generator", None)
    try:
        batches: int | None = len(exp.train_loader)
    except TypeError:
        batches = None
    return Template(
        provenance=provenance(exp),
        state=state,
        epochs=exp.config.epochs,
        batches=batches,
        loader_rng=generator.get_state() if isinstance(generator, torch.Generator) else None,
        device=exp.device,
    )


def reference_state(method: Posterior, model: nn.Module, device: torch.device) -> State:
    """``method``'s fresh state of ``model`` drawn under a forked RNG (the global streams are left alone)."""
    devices = list(range(torch.cuda.device_count())) if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        return method.init(trainable_params(model), model_buffers(model))


ISA_FLAGS = (
    "sse4_2",
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "amx_tile",
    "amx_bf16",
    "asimd",
    "sve",
)
"""The instruction-set flags of ``/proc/cpuinfo`` that decide which kernels torch, MKL and oneDNN run."""

KERNEL_VARIABLES = (
    "ATEN_CPU_CAPABILITY",
    "ONEDNN_MAX_CPU_ISA",
    "MKL_ENABLE_INSTRUCTIONS",
    "MKL_CBWR",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
)
"""Environment variables that change the CPU kernels or their threads (recorded when set)."""


def environment(device: torch.device | str | None = None) -> dict[str, Any]:
    """Where a run's numbers were computed: the library versions and the machine's kernels (``metrics.json``).

    Floating-point results depend on the kernels (chosen by the CPU's instruction set and each library's
    dispatch) and the number of threads. So the record holds the CPU model, its :data:`ISA_FLAGS`, torch's
    ``cpu_capability``, the threads, the BLAS and oneDNN builds, the :data:`KERNEL_VARIABLES` that are set, and on
    a GPU its name and the CUDA and cuDNN versions: runs whose records differ here may differ in their last digits.
    """
    record: dict[str, Any] = {
        "flatbma": flatbma.__version__,
        "torch": torch.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
        "cpu": _cpu_model(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_flags": [f for f in ISA_FLAGS if f in _cpu_flags()],
        "threads": torch.get_num_threads(),
        "interop_threads": torch.get_num_interop_threads(),
        "cpu_count": os.cpu_count(),
        **_backends(torch.__config__.show()),
        "kernel_variables": {k: os.environ[k] for k in KERNEL_VARIABLES if k in os.environ},
    }
    if device is not None and torch.device(device).type == "cuda":
        record["gpu"] = torch.cuda.get_device_name(torch.device(device))
        record["cuda"] = torch.version.cuda
        record["cudnn"] = torch.backends.cudnn.version()
    return record


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:  # not Linux
        return ""


def _cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``; elsewhere what :func:`platform.processor` says)."""
    found = re.search(r"^model name\s*:\s*(.+)$", _cpuinfo(), flags=re.M)
    return found.group(1).strip() if found else platform.processor() or platform.machine()


def _cpu_flags() -> set[str]:
    """The first CPU's flags (x86 ``flags``, ARM ``Features``) in ``/proc/cpuinfo``; empty elsewhere."""
    found = re.search(r"^(?:flags|Features)\s*:\s*(.+)$", _cpuinfo(), flags=re.M)
    return set(found.group(1).split()) if found else set()


def _backends(config: str) -> dict[str, str | None]:
    """The BLAS (``mkl``, ``open``, ...), its version and oneDNN's, read from ``torch.__config__.show()``'s text."""
    blas = re.search(r"BLAS_INFO=(\w+)", config)
    mkl = re.search(r"Math Kernel Library Version (\S+)", config)
    onednn = re.search(r"(?:MKL-DNN|oneDNN) (v[\w.]+)", config)
    return {
        "blas": blas.group(1) if blas else None,
        "mkl": mkl.group(1) if mkl else None,
        "onednn": onednn.group(1) if onednn else None,
    }
