"""How a BMA's weight samples are evaluated: one at a time (the loop), several per call (batched), or chosen.

Both paths agree up to float rounding; the automatic choice (:func:`log_probs`) never lets the numbers depend on
timing (measurements: docs/benchmarks.md, ``bench/bma.py``).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from weakref import WeakKeyDictionary

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, vmap

from flatbma import progress
from flatbma.checks import is_int
from flatbma.errors import FlatbmaError
from flatbma.precision import as_float32

__all__ = [
    "ACTIVATION_BUDGET_BYTES",
    "CPU_BATCHED_MAX_MEAN_ELEMENTS",
    "Choice",
    "check_options",
    "decision",
    "log_probs",
]


ACTIVATION_BUDGET_BYTES = 256 * 2**20
"""Bytes for one batched call (the chunk's largest layer output plus its stacked weights): sets the automatic chunk
size; a call's peak memory is a small multiple of it."""

CPU_BATCHED_MAX_MEAN_ELEMENTS = 16_384
"""The footprint rule (the automatic choice wherever the two paths' results differ): on the CPU, batch only forward
passes whose leaf modules output at most this many elements on average (per sample and input batch); larger layers
run slower under ``vmap`` there (it turns convolutions into grouped ones)."""

_UNSTACKED_CHUNK = 8
"""Chunk size when the activation footprint of the model cannot be estimated."""

_PROBE_ROUNDS = 3
"""Timed rounds (loop, then vmap) of the probe on the first batch; each path's fastest round counts."""

_SCRAMBLE_OCTAVES = 2
"""The agreement check scales every input and weight entry by ``2^k``, ``k`` uniform in ``±`` this."""

_clock = time.perf_counter
"""The probe's clock."""

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Footprint:
    """Output sizes of the leaf modules in one forward pass of one sample on one input batch."""

    leaf_calls: int
    total_elements: int
    peak_elements: int

    @property
    def mean_elements(self) -> float:
        return self.total_elements / max(self.leaf_calls, 1)


@dataclass(frozen=True)
class Choice:
    """The automatic choice for one key (:func:`_choice_key`).

    ``by`` is ``"probe"`` when both paths agreed bit for bit and the faster was taken (``seconds``: the fastest
    round of the loop and of vmap), ``"rule"`` when the footprint rule decided, ``"fallback"`` when ``vmap``
    failed during the probe (the loop, remembered in ``_VMAP_FAILED``).
    """

    batched: bool
    by: str
    seconds: tuple[float, float] | None = None


_FELL_BACK = Choice(batched=False, by="fallback")

_TrainingFlags = tuple[bool, ...]
_FootprintKey = tuple[_TrainingFlags, tuple[int, ...], torch.dtype]
_ChoiceKey = tuple[Any, ...]

# Per model (weakly referenced): the train/eval configurations where vmap failed and the loop succeeded, the
# memoized footprints and the automatic choices. _LOCK guards the writes (two threads probing one key is harmless).
_VMAP_FAILED: WeakKeyDictionary[nn.Module, set[_TrainingFlags]] = WeakKeyDictionary()
_FOOTPRINTS: WeakKeyDictionary[nn.Module, dict[_FootprintKey, _Footprint | None]] = WeakKeyDictionary()
_CHOICES: WeakKeyDictionary[nn.Module, dict[_ChoiceKey, Choice]] = WeakKeyDictionary()
_LOCK = threading.Lock()


def log_probs(
    model: nn.Module,
    samples: Sequence[Mapping[str, Tensor]],
    x: Tensor,
    *,
    batched: bool | None = None,
    chunk_size: int | None = None,
) -> Tensor:
    """``log_softmax(f(x; w_m))`` for every weight sample ``w_m``: a tensor ``[M, B, C]``.

    Batched evaluation stacks ``chunk_size`` samples' weight dicts key by key (buffers too, so per-sample BatchNorm
    statistics are kept) and maps ``functional_call(model, w, (x,))`` over them with
    ``torch.func.vmap(in_dims=(0, None), randomness="different")``; the loop calls it once per sample. Both agree
    up to float rounding, except that stochastic layers (MC dropout) draw other, equally valid random numbers
    under ``vmap``; each path is reproducible for a fixed global seed and chunk size.

    Automatic choice (``batched=None``): the loop when it is the only path (one sample, dicts that cannot be
    stacked, chunks of one, or ``vmap`` failed before for this model in its train/eval configuration); otherwise
    one cached choice per key (model and train/eval configuration, sample layout and count, input shape, dtype and
    device, chunk size, thread count), made so that the numbers never depend on timing:

    1. *Agreement check*: both paths on two samples and the batch, every float entry scaled by ``2^k``,
       ``|k| ≤ 2`` (exact, and it exposes any change of summation order). It passes only if the results are finite
       and bit-identical, the forward draws no random numbers and no module with buffers is training.
    2. If it passes, a *timed probe* on the first batch (:data:`_PROBE_ROUNDS` interleaved rounds): the faster
       path is kept, provided the whole batch agrees bit for bit too.
    3. Otherwise the *footprint rule*: a shape-only forward on the meta device measures the leaf outputs;
       accelerators batch whenever a chunk holds two samples, the CPU only when the mean leaf output is at most
       :data:`CPU_BATCHED_MAX_MEAN_ELEMENTS`.

    The check and probe restore torch's CPU (and the input's CUDA) generator and call ``forward`` a few extra
    times on a key's first batch (hooks see it). If the batched call raises ``RuntimeError`` or
    ``NotImplementedError`` (``.item()``, data-dependent control flow, no batching rule), the loop recomputes the
    whole result and the configuration is not batched again; with ``batched=True`` there is no fallback.

    ``model`` is the template module, already in its prediction mode; ``samples`` are weight dicts (parameters and
    buffers by module name); ``chunk_size`` is samples per batched call (``None``: as many as fit
    :data:`ACTIVATION_BUDGET_BYTES`).

    Raises:
        FlatbmaError: invalid options; with ``batched=True``, samples that cannot stack or a model vmap cannot run.
    """
    check_options(batched, chunk_size)
    if batched is False or (batched is None and len(samples) < 2):
        return _loop_log_probs(model, samples, x)
    if batched is None and _training_flags(model) in _VMAP_FAILED.get(model, ()):
        return _loop_log_probs(model, samples, x)
    footprint = _footprint(model, samples[0], x) if chunk_size is None or batched is None else None
    chunk = chunk_size or _auto_chunk_size(footprint, samples[0], x, len(samples))
    if batched is None:
        return _auto_log_probs(model, samples, x, chunk, _batching_pays(footprint, chunk, x.device))
    problem = _stacking_problem(samples)
    if problem is not None:
        raise FlatbmaError(f"batched=True needs samples that can be stacked: {problem}. Use batched=None.")
    try:
        return _batched_log_probs(model, samples, x, chunk)
    except (RuntimeError, NotImplementedError) as err:
        raise FlatbmaError(
            f"torch.func.vmap cannot evaluate {type(model).__name__} ({err}); use batched=None or False."
        ) from err




def decision(
    model: nn.Module, samples: Sequence[Mapping[str, Tensor]], x: Tensor, *, chunk_size: int | None = None
) -> Choice | None:
    """The choice :func:`log_probs` made (``batched=None``) for these samples and inputs, ``None`` before it made one.

    Other values with the same key (see :func:`log_probs`) share the choice.
    """
    footprint = _footprint(model, samples[0], x) if chunk_size is None else None
    chunk = chunk_size or _auto_chunk_size(footprint, samples[0], x, len(samples))
    with _LOCK:
        return _CHOICES.get(model, {}).get(_choice_key(model, samples, x, chunk))


def check_options(batched: object, chunk_size: object) -> None:
    """Refuse a ``batched`` not ``True``/``False``/``None`` or a ``chunk_size`` not a positive int or ``None``."""
    if batched is not None and not isinstance(batched, bool):
        raise FlatbmaError(f"batched must be True, False or None (automatic), got {batched!r}.")
    if chunk_size is not None and (not is_int(chunk_size) or chunk_size < 1):
        raise FlatbmaError(f"chunk_size must be a positive integer or None (automatic), got {chunk_size!r}.")



def _auto_log_probs(
    model: nn.Module, samples: Sequence[Mapping[str, Tensor]], x: Tensor, chunk: int, rule: bool
) -> Tensor:
    """``batched=None`` for several samples: the cached choice, probed when new.

    Stacking is checked only where the samples would be stacked, so a cached choice of the loop returns at once.
    """
    if chunk < 2:
        return _loop_log_probs(model, samples, x)
    key = _choice_key(model, samples, x, chunk)
    with _LOCK:
        choice = _CHOICES.get(model, {}).get(key)
    if choice is not None and not choice.batched:
        return _loop_log_probs(model, samples, x)
    if _stacking_problem(samples) is not None:
        return _loop_log_probs(model, samples, x)
    if choice is None:
        out, choice = _probe(model, samples, x, chunk, rule)
        with _LOCK:
            _CHOICES.setdefault(model, {})[key] = choice
        if out is not None:
            return out
    if not choice.batched:
        return _loop_log_probs(model, samples, x)
    try:
        return _batched_log_probs(model, samples, x, chunk)
    except (RuntimeError, NotImplementedError) as err:
        return _fall_back(model, samples, x, err)


def _fall_back(model: nn.Module, samples: Sequence[Mapping[str, Tensor]], x: Tensor, err: Exception) -> Tensor:
    """The loop's result after ``vmap`` raised ``err``; the configuration is remembered once the loop succeeds."""
    out = _loop_log_probs(model, samples, x)
    with _LOCK:
        _VMAP_FAILED.setdefault(model, set()).add(_training_flags(model))
    _log.info("vmap cannot evaluate %s (%s); evaluating its samples one at a time", type(model).__name__, err)
    return out


def _choice_key(model: nn.Module, samples: Sequence[Mapping[str, Tensor]], x: Tensor, chunk: int) -> _ChoiceKey:
    layout = tuple((name, tuple(t.shape), t.dtype, t.device) for name, t in samples[0].items())
    return (
        _training_flags(model),
        layout,
        len(samples),
        chunk,
        tuple(x.shape),
        x.dtype,
        x.device,
        torch.get_num_threads(),
    )


def _probe(
    model: nn.Module, samples: Sequence[Mapping[str, Tensor]], x: Tensor, chunk: int, rule: bool
) -> tuple[Tensor | None, Choice]:
    """The agreement check and timed probe of :func:`log_probs` on the batch ``x``.

    Returns ``(log-probs of x, choice)``, the log-probs ``None`` when the caller must still run the
    chosen path (the probe did not compute them by it, or the model drew random numbers).
    """
    by_rule = Choice(batched=rule, by="rule")
    if _updates_buffers(model):
        return None, by_rule
    rng = _rng_state(x.device)
    generator = torch.Generator().manual_seed(0)
    few = [{name: _scrambled(t, generator) for name, t in w.items()} for w in samples[:2]]
    scrambled_x = _scrambled(x, generator)
    try:
        batched_few = _batched_log_probs(model, few, scrambled_x, 2)
    except (RuntimeError, NotImplementedError) as err:
        _restore_rng(x.device, rng)
        return _fall_back(model, samples, x, err), _FELL_BACK
    loop_few = _loop_log_probs(model, few, scrambled_x)
    if _restore_rng(x.device, rng):  # the model draws random numbers: the paths differ
        return None, by_rule
    if not (torch.equal(loop_few, batched_few) and bool(torch.isfinite(loop_few).all())):
        return None, by_rule
    seconds: dict[bool, list[float]] = {False: [], True: []}
    outs: dict[bool, Tensor] = {}
    try:
        for _ in range(_PROBE_ROUNDS):
            for path in (False, True):
                _sync(x.device)
                start = _clock()
                out = _batched_log_probs(model, samples, x, chunk) if path else _loop_log_probs(model, samples, x)
                _sync(x.device)
                seconds[path].append(_clock() - start)
                outs.setdefault(path, out)
    except (RuntimeError, NotImplementedError) as err:
        _restore_rng(x.device, rng)
        return _fall_back(model, samples, x, err), _FELL_BACK
    if _restore_rng(x.device, rng):
        return None, by_rule
    if not torch.equal(outs[False], outs[True]):
        return outs[rule], by_rule
    loop_s, batched_s = min(seconds[False]), min(seconds[True])
    return outs[False], Choice(batched=batched_s < loop_s, by="probe", seconds=(loop_s, batched_s))


def _scrambled(t: Tensor, generator: torch.Generator) -> Tensor:
    """``t`` with every entry times ``2^k``, ``k`` uniform in ``±_SCRAMBLE_OCTAVES`` (floating point only)."""
    if not t.is_floating_point():
        return t
    k = torch.randint(-_SCRAMBLE_OCTAVES, _SCRAMBLE_OCTAVES + 1, t.shape, generator=generator)
    return t * torch.exp2(k.to(device=t.device, dtype=t.dtype))


def _updates_buffers(model: nn.Module) -> bool:
    """Whether a module with buffers of its own is in training mode (train-mode BatchNorm updates them)."""
    return any(m.training and next(m.buffers(recurse=False), None) is not None for m in model.modules())


def _rng_state(device: torch.device) -> tuple[Tensor, Tensor | None]:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def _restore_rng(device: torch.device, state: tuple[Tensor, Tensor | None]) -> bool:
    """Put torch's CPU (and ``device``'s CUDA) generator back to ``state``; whether it had moved."""
    cpu, cuda = state
    moved = False
    if not torch.equal(torch.get_rng_state(), cpu):
        torch.set_rng_state(cpu)
        moved = True
    if cuda is not None and not torch.equal(torch.cuda.get_rng_state(device), cuda):
        torch.cuda.set_rng_state(cuda, device)
        moved = True
    return moved


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _loop_log_probs(model: nn.Module, samples: Sequence[Mapping[str, Tensor]], x: Tensor) -> Tensor:
    out = []
    for w in samples:
        out.append(F.log_softmax(as_float32(functional_call(model, dict(w), (x,))), dim=-1))
        progress.current().tick()  # a long BMA batch keeps its phase printing (flatbma.progress)
    return torch.stack(out)


def _batched_log_probs(model: nn.Module, samples: Sequence[Mapping[str, Tensor]], x: Tensor, chunk: int) -> Tensor:
    def log_probs(weights: dict[str, Tensor], inputs: Tensor) -> Tensor:
        return F.log_softmax(as_float32(functional_call(model, weights, (inputs,))), dim=-1)

    mapped = vmap(log_probs, in_dims=(0, None), randomness="different")
    keys = list(samples[0])
    out = []
    for i in range(0, len(samples), chunk):
        out.append(mapped({k: torch.stack([w[k] for w in samples[i : i + chunk]]) for k in keys}, x))
        progress.current().tick()
    return torch.cat(out)

def _stacking_problem(samples: Sequence[Mapping[str, Tensor]]) -> str | None:
    """Why the weight dicts cannot be stacked key by key, or ``None`` when they can."""
    first = samples[0]
    for i, w in enumerate(samples[1:], start=1):
        if w.keys() != first.keys():
            return f"sample {i} has other keys than sample 0 ({sorted(set(w) ^ set(first))[:3]} differ)"
        for key, t in w.items():
            ref = first[key]
            if t.shape != ref.shape or t.dtype != ref.dtype or t.device != ref.device:
                return (
                    f"'{key}' is {tuple(t.shape)} {t.dtype} on {t.device} in sample {i} but "
                    f"{tuple(ref.shape)} {ref.dtype} on {ref.device} in sample 0"
                )
    return None


def _training_flags(model: nn.Module) -> _TrainingFlags:
    return tuple(m.training for m in model.modules())


def _footprint(model: nn.Module, sample: Mapping[str, Tensor], x: Tensor) -> _Footprint | None:
    """Leaf-module output sizes of one sample's forward pass, from a shape-only run on the meta device.

    Memoized per model, train/eval configuration and input shape; ``None`` when the model does not
    run on meta tensors.
    """
    key = (_training_flags(model), tuple(x.shape), x.dtype)
    memo = _FOOTPRINTS.setdefault(model, {})
    if key not in memo:
        memo[key] = _measure_footprint(model, sample, x)
    return memo[key]


def _measure_footprint(model: nn.Module, sample: Mapping[str, Tensor], x: Tensor) -> _Footprint | None:
    sizes: list[int] = []

    def record(_module: nn.Module, _inputs: Any, output: Any) -> None:
        sizes.append(_numel(output))

    leaves = [m for m in model.modules() if next(m.children(), None) is None]
    handles = [m.register_forward_hook(record) for m in leaves]
    named = itertools.chain(model.named_parameters(), model.named_buffers(), sample.items())
    weights = {name: torch.empty_like(t, device="meta") for name, t in named}
    try:
        with torch.no_grad():
            functional_call(model, weights, (torch.empty_like(x, device="meta"),))
    except Exception:  # a shape-only probe: whatever fails here only means "no estimate"
        return None
    finally:
        for handle in handles:
            handle.remove()
    if not sizes:
        return None
    return _Footprint(leaf_calls=len(sizes), total_elements=sum(sizes), peak_elements=max(sizes))


def _numel(output: Any) -> int:
    """Elements of all tensors in a module output (a tensor, or tuples, lists and dicts of them)."""
    if isinstance(output, Tensor):
        return output.numel()
    if isinstance(output, Mapping):
        output = list(output.values())
    if isinstance(output, list | tuple):
        return sum(_numel(o) for o in output)
    return 0


def _auto_chunk_size(footprint: _Footprint | None, sample: Mapping[str, Tensor], x: Tensor, num_samples: int) -> int:
    if footprint is None:
        return min(num_samples, _UNSTACKED_CHUNK)
    weight_bytes = sum(t.numel() * t.element_size() for t in sample.values())
    per_sample = footprint.peak_elements * x.element_size() + weight_bytes
    return max(1, min(num_samples, ACTIVATION_BUDGET_BYTES // max(per_sample, 1)))


def _batching_pays(footprint: _Footprint | None, chunk: int, device: torch.device) -> bool:
    if chunk < 2:
        return False
    if device.type != "cpu":
        return True
    return footprint is not None and footprint.mean_elements <= CPU_BATCHED_MAX_MEAN_ELEMENTS
