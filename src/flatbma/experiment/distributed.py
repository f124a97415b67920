"""Data-parallel training and evaluation with ``torch.distributed`` (``torchrun``), for every method.

Launch ``flatbma train`` (or ``flatbma evaluate``) under ``torchrun``; every process runs the same
run with the same config, and this module makes the processes one data-parallel job::

    torchrun --nproc_per_node=4 -m flatbma train --config configs/digits-sam.yaml

Process group: with ``WORLD_SIZE > 1`` (set by ``torchrun``), :func:`init_from_env` joins the group
of its ``env://`` rendezvous — backend NCCL when the run's device is CUDA (each process then uses
``cuda:LOCAL_RANK``), gloo otherwise — and :func:`destroy` leaves it at the end
(:func:`process_group` does both). Library code (:func:`flatbma.experiment.run.train_run`) is
data-parallel whenever a default process group with more than one process is initialized.

Data: ``data.batch_size`` is the GLOBAL batch; it must be divisible by the number of processes
``N``. :class:`ShardedBatchSampler` draws the global batches exactly as one process does (the same
seeded ``RandomSampler`` on the same generator, consumed identically) and gives rank ``r`` the
``r``-th contiguous slice of each, so one process and ``N`` processes see the same global batches.
Shards always have equal sizes: the epoch's trailing partial batch of ``q`` examples is cut to
``N·⌊q/N⌋`` examples (at most ``N − 1`` examples, different each epoch, are left out) and is dropped
when that leaves fewer than two examples per process (one process drops only a trailing batch of
one, as before). Resuming (:class:`~flatbma.experiment.runner.Position`) works as in one process:
the loader's generator is shared by the sampler and restored by the runner.

Gradients: :func:`data_parallel` sets ``Objective.reduce_grads`` to :func:`all_reduce_mean`,
``ḡ = (1/N) Σ_r ∇L_{B_r}(w)`` — the mean of the per-rank mean-loss gradients, i.e. the gradient of
the global batch since the shards have equal sizes — with ONE flattened ``all_reduce`` per gradient
evaluation (all tensors of a dtype bucketed into one buffer). The hook runs on every gradient before
any ascent step, so SAM-family perturbations ``ε = ρ ḡ/‖ḡ‖`` use the all-reduced gradient (the
"m = global batch" SAM, not per-rank m-sharpness) and both passes of a sharpness-aware step are
all-reduced; VI/FP-BMA reduce the weight-space gradient of every Monte-Carlo sample before the
chain rule to ``θ``. BatchNorm normalizes with per-rank batch statistics (no SyncBatchNorm); the
running statistics are averaged over the ranks (:func:`average_buffers`) in every checkpoint and
before evaluation — the EMA is linear, so averaging at checkpoints does not change the final average.

Randomness: every rank seeds identically (``seed``), so parameter-space noise — VI's ``z``, SGLD's
``ξ``, bSAM's noise, posterior sampling — is identical on every rank and the replicas stay equal
(checked by :func:`check_replicas` at every checkpoint and at the end). Per-example draws
(augmentation crops/flips, training dropout masks, MC-dropout masks at prediction) run on each
rank's own examples but from the same stream, so the ``k``-th example of every shard gets the same
draw; they equal the single-process draws only when they do not depend on the batch shape.

State and files: SWAG moments and SG-MCMC samples are functions of the (identical) parameters, so
they are identical on all ranks. Only rank 0 writes ``config.yaml``, checkpoints and
``metrics.json``; every rank reads the run directory on ``--resume``/``evaluate``, so multi-node
runs need ``output_dir`` on a file system all nodes share. Training history (per-epoch loss and
accuracy) is averaged over the ranks, i.e. it is that of the global batches.

Evaluation: the test set is split into contiguous shards (:func:`shard_loader`), each rank
accumulates :class:`~flatbma.metrics.StreamingMetrics` on its shard and :func:`all_reduce_metrics`
sums their states, so the metrics equal the single-process ones up to float rounding. BatchNorm
recomputation for sampled weights runs on the full training data on every rank (identical results)
and flatness diagnostics are computed redundantly on every rank (rank 0 writes them).

Not supported yet: spreading ensemble members or seeds over the ranks (an ensemble trains all its
members on every rank, data-parallel) and ``flatbma compare`` under ``torchrun``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils.data import BatchSampler, DataLoader, Dataset, RandomSampler, Sampler

from flatbma.errors import FlatbmaError
from flatbma.metrics import StreamingMetrics
from flatbma.params import Objective
from flatbma.types import Params, State

if TYPE_CHECKING:
    from flatbma.experiment.runner import History, Position

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


def is_distributed() -> bool:
    """Whether a default process group with more than one process is initialized."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def world_size() -> int:
    """Number of processes of the default group (1 when none is initialized)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    """Global rank of this process (0 when no group is initialized)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def is_main() -> bool:
    """Whether this process is rank 0 (the one that writes files and prints)."""
    return rank() == 0


def local_rank() -> int:
    """``LOCAL_RANK`` from ``torchrun`` (the process's index on its node)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def barrier() -> None:
    """Wait for every process (no-op in one process)."""
    if is_distributed():
        dist.barrier()


def init_from_env(device: torch.device) -> bool:
    """Join the process group described by ``torchrun``'s environment when ``WORLD_SIZE > 1``.

    Backend NCCL for a CUDA ``device`` (after ``torch.cuda.set_device(LOCAL_RANK)``), gloo otherwise;
    rendezvous ``env://`` (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``).

    Args:
        device: the run's resolved ``train.device``.

    Returns:
        Whether a group was created here (``False`` in one process or when one already exists).

    Raises:
        FlatbmaError: if the device names one GPU (each process must take ``cuda:LOCAL_RANK``) or
            the node has fewer GPUs than processes.
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
    dist.init_process_group(backend=backend, init_method="env://")
    return True


def destroy() -> None:
    """Leave and destroy the default process group (no-op when none is initialized)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@contextlib.contextmanager
def process_group(device: torch.device) -> Iterator[None]:
    """:func:`init_from_env` for the block and :func:`destroy` after it (if the group was created here)."""
    created = init_from_env(device)
    try:
        yield
    finally:
        if created:
            destroy()


def local_device(device: torch.device) -> torch.device:
    """The device of this process: ``cuda`` without an index becomes the current (``LOCAL_RANK``) GPU."""
    if is_distributed() and device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _collective_device() -> torch.device:
    """Where tensors must be for the group's backend (the current GPU for NCCL)."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# ---------------------------------------------------------------------------------------------------
# data


def global_batch_sizes(num_examples: int, batch_size: int, world: int = 1) -> list[int]:
    """Sizes of the global batches of one epoch, every one a multiple of ``world`` (see the module doc).

    Raises:
        FlatbmaError: if ``batch_size`` is not divisible by ``world`` or the data cannot give every
            process an example.
    """
    if batch_size % world:
        raise FlatbmaError(
            f"data.batch_size is the global batch and must be divisible by the {world} processes "
            f"(got {batch_size}): use e.g. {max(world, batch_size // world * world)}"
        )
    full, rest = divmod(num_examples, batch_size)
    if full == 0:
        if num_examples < world:
            raise FlatbmaError(f"the training data has {num_examples} examples, fewer than the {world} processes")
        return [num_examples // world * world]
    per_rank = rest // world
    return [batch_size] * full + ([per_rank * world] if per_rank >= 2 else [])


class ShardedBatchSampler(Sampler[list[int]]):
    """Rank ``rank``'s contiguous slice of every global batch of the single-process shuffled order.

    The global batches are drawn by ``BatchSampler(RandomSampler(range(n), generator=generator),
    batch_size)`` — what ``DataLoader(shuffle=True, generator=generator)`` does in one process, with
    the same draws from ``generator`` — and cut to :func:`global_batch_sizes`. Rank ``r`` of ``N``
    gets examples ``[r·b/N, (r+1)·b/N)`` of a global batch of size ``b``. With ``world_size=1`` the
    batches are those of the single-process loader.

    Args:
        num_examples: size ``n`` of the data set.
        batch_size: global batch size (divisible by ``world_size``).
        generator: the shuffling generator (also pass it to the ``DataLoader``, which draws its base
            seed from it as in one process).
        rank: this process's rank.
        world_size: number of processes ``N``.
    """

    def __init__(
        self, num_examples: int, batch_size: int, *, generator: torch.Generator, rank: int = 0, world_size: int = 1
    ) -> None:
        self.sizes = global_batch_sizes(num_examples, batch_size, world_size)
        self.rank, self.world_size = rank, world_size
        self._batches = BatchSampler(RandomSampler(range(num_examples), generator=generator), batch_size, False)

    def __iter__(self) -> Iterator[list[int]]:
        # The inner iterator is always run to its end, so the generator advances as in one process.
        for i, batch in enumerate(self._batches):
            if i < len(self.sizes):
                shard = self.sizes[i] // self.world_size
                yield batch[self.rank * shard : (self.rank + 1) * shard]

    def __len__(self) -> int:
        return len(self.sizes)


def train_loader(dataset: Dataset, batch_size: int, *, seed: int, shard: bool = True) -> DataLoader:
    """The shuffled training loader of this rank (``shard=False``: the global batches, for every rank).

    ``loader.generator`` is the shuffling generator (seeded by ``seed``), as the runner expects.
    """
    generator = torch.Generator().manual_seed(seed)
    world, me = (world_size(), rank()) if shard else (1, 0)
    sampler = ShardedBatchSampler(len(dataset), batch_size, generator=generator, rank=me, world_size=world)
    return DataLoader(dataset, batch_sampler=sampler, generator=generator)


def shard_bounds(num_examples: int, world: int, me: int) -> tuple[int, int]:
    """``[start, stop)`` of rank ``me``'s contiguous evaluation shard (sizes differ by at most one)."""
    base, extra = divmod(num_examples, world)
    start = me * base + min(me, extra)
    return start, start + base + (me < extra)


def shard_loader(dataset: Dataset, batch_size: int) -> DataLoader:
    """An in-order loader over this rank's contiguous shard of ``dataset`` (for evaluation)."""
    start, stop = shard_bounds(len(dataset), world_size(), rank())
    return DataLoader(dataset, batch_size=batch_size, sampler=range(start, stop))


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


def data_parallel(objective: Objective) -> Objective:
    """``objective`` whose gradients are averaged over the processes (:func:`all_reduce_mean`).

    An existing ``reduce_grads`` hook runs first.
    """
    inner = objective.reduce_grads
    if inner is None:
        return dataclasses.replace(objective, reduce_grads=all_reduce_mean)
    return dataclasses.replace(objective, reduce_grads=lambda g: all_reduce_mean(inner(g)))


def all_reduce_metrics(metrics: StreamingMetrics) -> None:
    """Sum the accumulated state of ``metrics`` over the processes (one ``all_reduce``), in place."""
    if not is_distributed():
        return
    states = metrics.state_tensors()
    device = _collective_device()
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
    device = _collective_device()
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
    device = _collective_device()
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


# ---------------------------------------------------------------------------------------------------
# history, position, checkpoints


def global_history(history: History) -> History:
    """``history`` with each epoch's loss and accuracy averaged over the processes (one ``all_reduce``).

    With equal shards this is the mean over the global batches; epochs already global (identical on
    every rank, e.g. restored from a checkpoint) are left unchanged.
    """
    from flatbma.experiment.runner import History

    if not is_distributed() or not history.epochs:
        return history
    values = torch.tensor([[h.loss, h.accuracy] for h in history.epochs], dtype=torch.float64)
    reduced = all_reduce_mean({"h": values.to(_collective_device())})["h"].cpu()
    return History(
        [dataclasses.replace(h, loss=float(v[0]), accuracy=float(v[1])) for h, v in zip(history.epochs, reduced)]
    )


def global_position(position: Position) -> Position:
    """The position rank 0 saves (a collective: all ranks call it).

    The epoch's running sums are summed over the processes; of the CUDA generator states only that
    of this process's own GPU is kept (every rank's GPU draws the same stream).
    """
    partial = position.partial
    if is_distributed():
        sums = torch.tensor(partial, dtype=torch.float64, device=_collective_device())
        dist.all_reduce(sums)
        partial = tuple(float(v) for v in sums.cpu())
    cuda = position.cuda_rng
    if is_distributed() and cuda is not None:
        cuda = (cuda[torch.cuda.current_device()],)
    return dataclasses.replace(position, partial=partial, cuda_rng=cuda)


def local_position(position: Position) -> Position:
    """The inverse of :func:`global_position`, on every rank of a resumed run.

    Each rank takes a share ``1/N`` of the saved running sums (exact with equal shards), and the
    saved CUDA generator state goes to this process's GPU.
    """
    if not is_distributed():
        return position
    partial = tuple(v / world_size() for v in position.partial)
    cuda = position.cuda_rng
    if cuda is not None and torch.cuda.is_available():
        states = list(torch.cuda.get_rng_state_all())
        states[torch.cuda.current_device()] = cuda[0]
        cuda = tuple(states)
    return dataclasses.replace(position, partial=partial, cuda_rng=cuda)


def checkpoint_hook(
    save: Callable[[State, Position, History], None],
) -> Callable[[State, Position, History], None]:
    """The runner's checkpoint callback for data-parallel training (a collective: all ranks call it).

    Checks the replicas, averages BatchNorm statistics, globalizes position and history, and lets
    rank 0 alone call ``save``.
    """

    def hook(state: State, position: Position, history: History) -> None:
        check_replicas(state)
        state = average_buffers(state)
        position = global_position(position)
        history = global_history(history)
        if is_main():
            save(state, position, history)

    return hook


def finish(state: State, history: History) -> tuple[State, History]:
    """The trained state and history every rank evaluates: replicas checked, buffers and history averaged."""
    check_replicas(state)
    return average_buffers(state), global_history(history)
