"""The process group of a ``torchrun`` launch: joining it, ranks, collectives that agree or time out.

Under ``torchrun`` every process runs the same command (launches: docs/distributed.md). With ``WORLD_SIZE > 1``
:func:`process_group` joins the group and leaves it at the end; library code is data-parallel whenever a default
group of more than one process is initialized. A process that stops or hangs ends the block with a
:class:`FlatbmaError` naming its rank after ``$FLATBMA_COLLECTIVE_TIMEOUT`` seconds (default 300).

The tensor collectives (:func:`all_reduce_mean`, :func:`all_reduce_metrics`, :func:`average_buffers`,
:func:`check_replicas`) live here; how a run is shared is its strategy (:mod:`flatbma.experiment.parallel.strategies`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
from collections.abc import Iterator, Mapping

import torch
import torch.distributed as dist
from torch import Tensor

from flatbma.errors import FlatbmaError
from flatbma.experiment.parallel import liveness
from flatbma.metrics import StreamingMetrics
from flatbma.types import Params, State

REPLICA_RTOL = 1e-6
"""Relative tolerance of :func:`check_replicas` (replicas are bitwise equal when in sync)."""


# ---------------------------------------------------------------------------------------------------
# process group


def launched_world_size() -> int:
    """``WORLD_SIZE`` of the launcher's environment (1 outside ``torchrun``)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        raise FlatbmaError(f"WORLD_SIZE must be an integer, got {os.environ['WORLD_SIZE']!r}") from None


_single_process_depth = 0
"""How many :func:`single_process` blocks are open."""


def _in_group() -> bool:
    return _single_process_depth == 0 and dist.is_available() and dist.is_initialized()


def is_distributed() -> bool:
    """Whether a default process group with more than one process is initialized (outside :func:`single_process`)."""
    return _in_group() and dist.get_world_size() > 1


def world_size() -> int:
    """Number of processes of the default group (1 when none is initialized or in :func:`single_process`)."""
    return dist.get_world_size() if _in_group() else 1


def rank() -> int:
    """Global rank of this process (0 when no group is initialized or in :func:`single_process`)."""
    return dist.get_rank() if _in_group() else 0


@contextlib.contextmanager
def single_process() -> Iterator[None]:
    """Within the block this process acts alone: one process, rank 0, no collectives, it writes its files."""
    global _single_process_depth
    _single_process_depth += 1
    try:
        yield
    finally:
        _single_process_depth -= 1


@contextlib.contextmanager
def all_or_none() -> Iterator[None]:
    """Run the block on every process and agree on its outcome (a collective at its end).

    A process whose block raises re-raises its own exception; the others raise a
    :class:`FlatbmaError` naming it, instead of waiting forever in a later collective.
    """
    if not is_distributed():
        yield
        return
    try:
        yield
    except Exception as e:
        if not liveness.is_timeout(e):  # after a timed-out collective the group cannot agree on anything
            _failed_ranks(failed=True)
        raise
    failed = _failed_ranks(failed=False)
    if failed:
        raise FlatbmaError(
            f"process {', '.join(map(str, failed))} failed (its error is printed above); fix that and launch again"
        )


def _failed_ranks(*, failed: bool) -> list[int]:
    heartbeat = liveness.current()
    if heartbeat is not None:  # waits as long as the others live (compare: their share of the runs)
        return heartbeat.agree(failed)
    flags = torch.zeros(world_size(), device=collective_device())
    flags[rank()] = float(failed)
    dist.all_reduce(flags)
    return [r for r, f in enumerate(flags.tolist()) if f]


def is_main() -> bool:
    """Whether this process is rank 0 (the one that writes files and prints)."""
    return rank() == 0


def local_rank() -> int:
    """``LOCAL_RANK`` from ``torchrun`` (the process's index on its node)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def main_decides(flag: bool) -> bool:
    """Rank 0's ``flag`` on every rank (``flag`` itself in one process).

    For choices that read files only rank 0 may see, so that all ranks take the same branch.
    """
    if not is_distributed():
        return flag
    value = torch.tensor([int(flag)], device=collective_device())
    dist.broadcast(value, src=0)
    return bool(value.item())


def barrier() -> None:
    """Wait for every process (no-op in one process)."""
    if is_distributed():
        dist.barrier()


def init_from_env(device: torch.device) -> bool:
    """Join the process group described by ``torchrun``'s environment when ``WORLD_SIZE > 1``.

    Backend NCCL for a CUDA ``device`` (after ``torch.cuda.set_device(LOCAL_RANK)``), gloo otherwise; rendezvous
    ``env://``. The rendezvous and every collective wait at most
    :func:`~flatbma.experiment.parallel.liveness.collective_timeout` seconds; a heartbeat runs until :func:`destroy`.
    ``device`` is the run's resolved ``train.device``.

    Returns:
        Whether a group was created here (``False`` in one process or when one already exists).

    Raises:
        FlatbmaError: a device naming one GPU, fewer GPUs than processes, a bad timeout, a process not joining in time.
    """
    if launched_world_size() <= 1 or (dist.is_available() and dist.is_initialized()):
        return False
    if not dist.is_available():
        raise FlatbmaError("this torch build has no torch.distributed: run flatbma without torchrun")
    if device.type == "cuda":
        if device.index is not None:
            raise FlatbmaError(
                f"train.device is {str(device)!r}, but under torchrun every process uses cuda:LOCAL_RANK: "
                "set train.device to auto or cuda"
            )
        if local_rank() >= torch.cuda.device_count():
            raise FlatbmaError(
                f"LOCAL_RANK {local_rank()} needs GPU {local_rank()} but this node has "
                f"{torch.cuda.device_count()}: lower --nproc_per_node"
            )
        torch.cuda.set_device(local_rank())
        backend = "nccl"
    else:
        backend = "gloo"
    timeout = liveness.collective_timeout()
    wait = datetime.timedelta(seconds=timeout)
    try:
        store, me, world = next(dist.rendezvous("env://", timeout=wait))
    except (RuntimeError, TimeoutError) as e:  # e.g. a process that never started
        if not (isinstance(e, TimeoutError) or liveness.is_timeout(e)):
            raise
        raise FlatbmaError(
            f"not every one of the {launched_world_size()} processes joined within {timeout:g} s: one did not start "
            f"or cannot reach MASTER_ADDR:MASTER_PORT; check the launch, or raise {liveness.ENV}"
        ) from None
    store.set_timeout(wait)
    # as init_process_group(init_method="env://", timeout=...) does, keeping the store for the heartbeat
    dist.init_process_group(
        backend=backend, store=dist.PrefixStore("default_pg", store), rank=me, world_size=world, timeout=wait
    )
    group = getattr(dist.distributed_c10d, "_get_default_group", lambda: None)()
    sequence = getattr(group, "_get_sequence_number_for_group", None)  # private: it names a hung rank
    liveness.start(store, me, world, timeout, sequence)
    return True


def destroy() -> None:
    """Leave and destroy the default process group (no-op when none is initialized)."""
    liveness.stop()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@contextlib.contextmanager
def process_group(device: torch.device) -> Iterator[None]:
    """:func:`init_from_env` for the block and :func:`destroy` after it (if the group was created here)."""
    created = init_from_env(device)
    try:
        yield
    except RuntimeError as e:
        heartbeat = liveness.current()
        if heartbeat is None or not liveness.is_timeout(e):
            raise
        raise heartbeat.diagnose(e) from None
    finally:
        if created:
            destroy()


def local_device(device: torch.device) -> torch.device:
    """The device of this process: ``cuda`` without an index becomes the current (``LOCAL_RANK``) GPU."""
    if is_distributed() and device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def collective_device() -> torch.device:
    """Where tensors must be for the group's backend (the current GPU for NCCL)."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# ---------------------------------------------------------------------------------------------------
# gradients, metrics, state


def all_reduce_mean(tensors: Mapping[str, Tensor]) -> Params:
    """``(1/N) Σ_r t_r`` for every tensor, with one flattened ``all_reduce`` per dtype (usually one).

    The results are views into the reduced buffer, in the order of ``tensors``.
    """
    if not is_distributed() or not tensors:
        return dict(tensors)
    world = world_size()
    by_dtype: dict[torch.dtype, list[str]] = {}
    for key, t in tensors.items():
        by_dtype.setdefault(t.dtype, []).append(key)
    out: Params = {}
    for keys in by_dtype.values():
        flat = torch.cat([tensors[k].reshape(-1) for k in keys])
        dist.all_reduce(flat)
        flat.div_(world)
        offset = 0
        for k in keys:
            n = tensors[k].numel()
            out[k] = flat[offset : offset + n].view(tensors[k].shape)
            offset += n
    return {k: out[k] for k in tensors}


def all_reduce_metrics(metrics: StreamingMetrics) -> None:
    """Sum the accumulated state of ``metrics`` over the processes (one ``all_reduce``), in place."""
    if not is_distributed():
        return
    states = metrics.state_tensors()
    device = collective_device()
    flat = torch.cat([s.reshape(-1) for s in states]).to(device)
    dist.all_reduce(flat)
    parts, offset = [], 0
    for s in states:
        parts.append(flat[offset : offset + s.numel()].view(s.shape))
        offset += s.numel()
    metrics.load_state_tensors(parts)


def average_buffers(state: State) -> State:
    """``state`` with its floating-point buffers (BatchNorm running statistics) averaged over the processes."""
    floats = {k: v for k, v in state.buffers.items() if v.is_floating_point()}
    if not is_distributed() or not floats:
        return state
    device = collective_device()
    reduced = all_reduce_mean({k: v.to(device) for k, v in floats.items()})
    buffers = {k: reduced[k].to(v.device).clone() if k in reduced else v for k, v in state.buffers.items()}
    return dataclasses.replace(state, buffers=buffers)


def check_replicas(state: State) -> None:
    """Raise unless every process holds the same parameters and method state (``params`` and ``aux``).

    Compares per-tensor float64 sums and absolute sums over the ranks (one ``all_reduce``).

    Raises:
        FlatbmaError: naming the first tensor that differs.
    """
    if not is_distributed():
        return
    tensors = {**{f"params/{k}": v for k, v in state.params.items()}, **{f"aux/{k}": v for k, v in state.aux.items()}}
    if not tensors:
        return
    device = collective_device()
    sums = torch.stack(
        [torch.stack([t.detach().double().sum(), t.detach().double().abs().sum()]) for t in tensors.values()]
    ).to(device)
    both = torch.cat([sums.reshape(-1), -sums.reshape(-1)])
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    high, low = both[: sums.numel()].cpu(), -both[sums.numel() :].cpu()
    bad = ((high - low).abs() > REPLICA_RTOL * torch.maximum(high.abs(), low.abs()) + 1e-12).view(-1, 2).any(-1)
    if bool(bad.any()):
        key = list(tensors)[int(bad.nonzero()[0])]
        raise FlatbmaError(
            f"the processes hold different values of {key!r} at step {state.step}: a random draw or an "
            "operation depended on the process; data-parallel training needs identical replicas"
        )
