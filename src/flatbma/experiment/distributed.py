"""Data-parallel training and evaluation with ``torch.distributed`` (``torchrun``), for every method.

Launch ``flatbma train`` (or ``flatbma evaluate``) under ``torchrun``; every process runs the same
run with the same config, and this module makes the processes one data-parallel job::

    torchrun --nproc_per_node=4 -m flatbma train --config configs/digits-sam.yaml

Process group: with ``WORLD_SIZE > 1`` (set by ``torchrun``), :func:`init_from_env` joins the group
of its ``env://`` rendezvous — backend NCCL when the run's device is CUDA (each process then uses
``cuda:LOCAL_RANK``), gloo otherwise — and :func:`destroy` leaves it at the end
(:func:`process_group` does both). Library code (:func:`flatbma.experiment.run.train_run`) is
data-parallel whenever a default process group with more than one process is initialized. Every
collective waits at most ``$FLATBMA_COLLECTIVE_TIMEOUT`` seconds (default 300); a process that stops
or hangs then ends the block of :func:`process_group` with a :class:`FlatbmaError` naming its rank
(:mod:`flatbma.experiment.liveness`; gloo tested, NCCL untested).

Strategy: a run chooses its parallel mode once, when its experiment is built (:func:`strategy`:
:class:`Strategy` for one process, :class:`DataParallel`, :class:`Members`), and asks it for every
part that depends on the processes — loaders, objective, the transform each process trains, the
checkpoint callback, the resumed position, the state at the end and the metric reduction — so the
run itself has no parallel branches.

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
recomputation runs on the full un-augmented training data, in the same fixed order, on every rank
(:func:`flatbma.experiment.build.statistics_loader`: identical results) and flatness diagnostics are
computed redundantly on every rank (rank 0 writes them).

Members (``train.parallel: members``, :class:`MemberParallel`): a posterior with independent
components (:attr:`~flatbma.types.Posterior.members`, e.g. the ``M`` members of an ensemble or
F-ensemble) can instead give each process a disjoint contiguous block of its members
(:func:`member_share`; block sizes differ by at most one, so ``N ≤ M``). Every rank builds the same
full state (same seed, same member initializations), keeps its block (``Posterior.split``) and
trains it on ALL the data — the single-process loader, same shuffle and augmentation — with no
gradient all-reduce; each step's outputs are combined over the ranks (one small ``all_gather``) into
the mean loss and mixture predictive of all members, so the training history is that of one process.
At every checkpoint and at the end the blocks are merged into the full state on every rank (one
broadcast per rank); rank 0 saves it, and evaluation shards the test set as above. Since a member's
initialization, data, and random draws do not depend on the other members (the ensemble seeds each
member's step separately), the trained members equal those of one process; checkpoints hold the full
state and the global position, so a run resumes with any number of processes.

Runs (``flatbma compare``): under ``torchrun`` the comparison's (method, seed) runs are dealt out
round-robin, each run an ordinary single-process run (:func:`single_process`: no collectives
inside); rank 0 then collects the result rows from the run directories and writes the reports.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import math
import os
from collections.abc import Callable, Iterator, Mapping
from enum import Enum

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils.data import BatchSampler, DataLoader, Dataset, RandomSampler, Sampler

from flatbma.errors import FlatbmaError
from flatbma.experiment import liveness
from flatbma.experiment.runner import History, Position
from flatbma.metrics import StreamingMetrics
from flatbma.params import Objective
from flatbma.types import Batch, Params, Posterior, State, StepOutput, Transform

Save = Callable[[State, Position, History], None]
"""A checkpoint callback of the runner: ``save(state, position, history)``."""

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
    """Within the block this process acts alone: one process, rank 0, no collectives, it writes its files.

    ``flatbma compare`` runs each rank's share of its runs in such a block, as ordinary runs.
    """
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
    flags = torch.zeros(world_size(), device=_collective_device())
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
    value = torch.tensor([int(flag)], device=_collective_device())
    dist.broadcast(value, src=0)
    return bool(value.item())


def barrier() -> None:
    """Wait for every process (no-op in one process)."""
    if is_distributed():
        dist.barrier()


def init_from_env(device: torch.device) -> bool:
    """Join the process group described by ``torchrun``'s environment when ``WORLD_SIZE > 1``.

    Backend NCCL for a CUDA ``device`` (after ``torch.cuda.set_device(LOCAL_RANK)``), gloo otherwise;
    rendezvous ``env://`` (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``). The rendezvous
    and every collective wait at most :func:`~flatbma.experiment.liveness.collective_timeout` seconds,
    and a :class:`~flatbma.experiment.liveness.Heartbeat` runs until :func:`destroy`.

    Args:
        device: the run's resolved ``train.device``.

    Returns:
        Whether a group was created here (``False`` in one process or when one already exists).

    Raises:
        FlatbmaError: if the device names one GPU (each process must take ``cuda:LOCAL_RANK``), the
            node has fewer GPUs than processes, the timeout is not a number of seconds, or not every
            process joined within it.
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
    """:func:`init_from_env` for the block and :func:`destroy` after it (if the group was created here).

    A collective that times out within the block (:mod:`flatbma.experiment.liveness`) ends it with a
    :class:`FlatbmaError` naming the process that did not answer.
    """
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


def seeded_loader(dataset: Dataset, batch_size: int, *, shuffle: bool, seed: int) -> DataLoader:
    """The loader of one process: ``loader.generator`` (seeded by ``seed``) shuffles when ``shuffle``.

    A shuffled epoch drops a trailing batch of one example, which would break BatchNorm in train mode.
    """
    generator = torch.Generator().manual_seed(seed)
    drop_last = shuffle and len(dataset) > batch_size and len(dataset) % batch_size == 1
    return DataLoader(dataset, batch_size=batch_size, shuffle=shuffle, generator=generator, drop_last=drop_last)


def train_loader(dataset: Dataset, batch_size: int, *, seed: int) -> DataLoader:
    """The shuffled training loader of this rank: its slice of every global batch.

    ``loader.generator`` is the shuffling generator (seeded by ``seed``), as the runner expects.
    """
    generator = torch.Generator().manual_seed(seed)
    sampler = ShardedBatchSampler(len(dataset), batch_size, generator=generator, rank=rank(), world_size=world_size())
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


def member_share(members: int, world: int, me: int) -> range:
    """The members process ``me`` of ``world`` trains: a contiguous block (sizes differ by at most one)."""
    return range(*shard_bounds(members, world, me))


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


def checkpoint_hook(save: Save) -> Save:
    """The runner's checkpoint callback for data-parallel training (a collective: all ranks call it).

    Checks the replicas, averages BatchNorm statistics, globalizes position and history, and lets
    rank 0 alone call ``save``. Returns on every rank only once the checkpoint is written, so that a
    rank which stops right after it and resumes at once reads this checkpoint, not the one before.
    """

    def hook(state: State, position: Position, history: History) -> None:
        check_replicas(state)
        state = average_buffers(state)
        position = global_position(position)
        history = global_history(history)
        if is_main():
            save(state, position, history)
        barrier()

    return hook


def finish(state: State, history: History) -> tuple[State, History]:
    """The trained state and history every rank evaluates: replicas checked, buffers and history averaged."""
    check_replicas(state)
    return average_buffers(state), global_history(history)


# ---------------------------------------------------------------------------------------------------
# independent members (train.parallel: members)

_SECTIONS = ("params", "buffers", "aux")


class MemberParallel:
    """A posterior's independent members spread over the processes (``train.parallel: members``).

    Built on every rank from the same FULL state (a fresh ``init`` or a loaded checkpoint). Process
    ``r`` of ``N`` trains members ``member_share(M, N, r)``: :meth:`local` is its part of the state,
    :attr:`method` the posterior to train it with (its ``update`` combines the step outputs of all
    ranks), :meth:`merge` rebuilds the full state on every rank. In one process it trains all members
    and changes nothing.

    Combined outputs: with rank ``r`` holding ``m_r`` members, mean loss ``ℓ_r`` and mixture
    log-predictive ``log p_r``, the ensemble's are ``ℓ = Σ_r m_r ℓ_r / M`` and
    ``log p = logsumexp_r(log p_r + log m_r) − log M`` (exact up to float rounding).

    Args:
        method: a posterior with ``members > 0`` and ``split`` (:class:`~flatbma.types.Posterior`).
        state: its full state, identical on every rank.
        name: the method's name, for messages.

    Raises:
        FlatbmaError: the method has no independent members, or there are more processes than members.
        ValueError: ``method.split`` does not partition the state (a broken posterior).
    """

    def __init__(self, method: Posterior, state: State, name: str) -> None:
        if method.members < 1 or method.split is None:
            raise FlatbmaError(f"method {name} has no independent members to spread; use train.parallel: data")
        world, me = world_size(), rank()
        if world > method.members:
            raise FlatbmaError(
                f"train.parallel: members gives each process at least one of the {method.members} members of "
                f"{name}, but {world} processes were launched: launch at most {method.members} "
                "(--nproc_per_node) or use train.parallel: data"
            )
        self.base, self.world, self.rank = method, world, me
        self.shares = [member_share(method.members, world, r) for r in range(world)]
        parts = [method.split(state, share) for share in self.shares]
        self._order = {sec: list(getattr(state, sec)) for sec in _SECTIONS}
        self._layouts = [
            {sec: {k: (v.shape, v.dtype, v.device) for k, v in getattr(part, sec).items()} for sec in _SECTIONS}
            for part in parts
        ]
        for sec in _SECTIONS:
            owned = [k for layout in self._layouts for k in layout[sec]]
            if len(owned) != len(self._order[sec]) or set(owned) != set(self._order[sec]):
                raise ValueError(f"{name}: Posterior.split does not partition the state's {sec} entries")
        self.method = dataclasses.replace(method, update=self._update)

    def local(self, state: State) -> State:
        """This process's members of the full ``state``."""
        return self.base.split(state, self.shares[self.rank])

    def _update(self, state: State, batch: Batch) -> tuple[State, StepOutput]:
        state, out = self.base.update(state, batch)
        return state, self._combine(out)

    def _combine(self, out: StepOutput) -> StepOutput:
        if self.world == 1:
            return out
        logits = out.logits.detach()
        flat = torch.cat([out.loss.detach().reshape(1).to(logits.dtype), logits.reshape(-1)])
        gathered = [torch.empty_like(flat) for _ in range(self.world)]
        dist.all_gather(gathered, flat.to(_collective_device()))
        both = torch.stack(gathered).to(logits.device)
        counts = torch.tensor([len(s) for s in self.shares], dtype=both.dtype, device=both.device)
        total = self.base.members
        loss = (both[:, 0] * counts).sum() / total
        log_probs = both[:, 1:].view(self.world, *logits.shape) + counts.log().view(-1, *[1] * logits.dim())
        return StepOutput(loss, torch.logsumexp(log_probs, dim=0) - math.log(total))

    def merge(self, state: State) -> State:
        """The full state on every rank from each rank's part (a collective: one broadcast per rank)."""
        if self.world == 1:
            return state
        merged: dict[tuple[str, str], Tensor] = {}
        for r, layout in enumerate(self._layouts):
            if r == self.rank:
                tensors = {(sec, k): getattr(state, sec)[k] for sec in _SECTIONS for k in layout[sec]}
            else:
                tensors = {
                    (sec, k): torch.empty(shape, dtype=dtype, device=device)
                    for sec in _SECTIONS
                    for k, (shape, dtype, device) in layout[sec].items()
                }
            merged.update(_broadcast(tensors, src=r))
        sections = {sec: {k: merged[sec, k] for k in self._order[sec]} for sec in _SECTIONS}
        return State(**sections, step=state.step)

    def checkpoint_hook(self, save: Save) -> Save:
        """The runner's checkpoint callback (a collective): merge the members, rank 0 calls ``save``.

        Position and history are the same on every rank (same data, same global random stream,
        combined step outputs), so they are saved as they are. Returns once the file is written
        (a barrier), as :func:`checkpoint_hook` does.
        """

        def hook(state: State, position: Position, history: History) -> None:
            full = self.merge(state)
            if is_main():
                save(full, position, history)
            barrier()

        return hook


def _broadcast(tensors: dict[tuple[str, str], Tensor], src: int) -> dict[tuple[str, str], Tensor]:
    """``tensors`` of rank ``src`` on every rank (the others pass empty tensors of the same layout).

    All tensors travel as the bytes of one buffer, whatever their dtypes (one ``broadcast``).
    """
    if not tensors:
        return tensors
    device = _collective_device()
    sizes = [t.numel() * t.element_size() for t in tensors.values()]
    if rank() == src:
        buffer = torch.cat([t.detach().contiguous().view(-1).view(torch.uint8).to(device) for t in tensors.values()])
    else:
        buffer = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
    dist.broadcast(buffer, src=src)
    if rank() == src:
        return tensors
    out, offset = {}, 0
    for (key, t), n in zip(tensors.items(), sizes):
        out[key] = buffer[offset : offset + n].clone().view(t.dtype).view(t.shape).to(t.device)
        offset += n
    return out


# ---------------------------------------------------------------------------------------------------
# the parallel mode of a run, chosen once


class Parallel(str, Enum):
    """What the processes of a ``torchrun`` launch share out (``train.parallel``; strings and members are accepted).

    ``data``: every process trains all of the method on its shard of each global batch; ``members``:
    each trains a disjoint share of the posterior's independent members on all the data
    (:class:`MemberParallel`).
    """

    DATA = "data"
    MEMBERS = "members"


class Strategy:
    """How the processes share a run; this base class is one process training everything alone.

    A run asks its strategy, and only it, for what depends on the processes: the loaders, the
    objective, the transform and state this process trains, the checkpoint callback, the position a
    resumed run continues from, the state every process evaluates, and how test metrics combine.
    :func:`strategy` chooses it once, when the run's experiment is built.

    Args:
        sharded: every process evaluates a contiguous shard of the test set (:func:`shard_loader`)
            and the metric states are summed over the processes (:func:`all_reduce_metrics`); the
            run records its ``world_size``.
    """

    def __init__(self, *, sharded: bool = False) -> None:
        self.sharded = sharded

    def train_loader(self, dataset: Dataset, batch_size: int, *, seed: int) -> DataLoader:
        """The shuffled training loader of this process (``loader.generator`` seeded by ``seed``)."""
        return seeded_loader(dataset, batch_size, shuffle=True, seed=seed)

    def test_loader(self, dataset: Dataset, batch_size: int) -> DataLoader:
        """The in-order loader of the test data this process evaluates."""
        if self.sharded:
            return shard_loader(dataset, batch_size)
        return seeded_loader(dataset, batch_size, shuffle=False, seed=0)

    def objective(self, objective: Objective) -> Objective:
        """The objective the method is built with."""
        return objective

    def start(self, method: Posterior, state: State, name: str) -> tuple[Transform, State]:
        """The transform this process trains and its part of the full ``state`` (``name``: for messages)."""
        return method, state

    def resume(self, position: Position) -> Position:
        """This process's position from the saved (global) one."""
        return position

    def checkpoint(self, save: Save) -> Save:
        """The runner's checkpoint callback that ends in ``save`` of the full state (on rank 0)."""
        return save

    def finish(self, state: State, history: History) -> tuple[State, History]:
        """The full trained state and the history every process evaluates and records."""
        return state, history

    @property
    def reduce_metrics(self) -> Callable[[StreamingMetrics], None] | None:
        """Combines the metric states of the processes (``None``: this process saw all the test data)."""
        return all_reduce_metrics if self.sharded else None

    def record(self) -> dict[str, int]:
        """What the run's ``metrics.json`` records about its processes."""
        return {"world_size": world_size()} if self.sharded else {}


class DataParallel(Strategy):
    """``train.parallel: data`` on ``N`` processes: shards of every global batch, all-reduced gradients.

    See the module docstring: the same global batches as one process, replicas checked and
    BatchNorm statistics averaged in every checkpoint and at the end, rank 0 saves.
    """

    def __init__(self) -> None:
        super().__init__(sharded=True)

    def train_loader(self, dataset: Dataset, batch_size: int, *, seed: int) -> DataLoader:
        """This rank's slice of each global batch (:class:`ShardedBatchSampler`)."""
        return train_loader(dataset, batch_size, seed=seed)

    def objective(self, objective: Objective) -> Objective:
        """:func:`data_parallel`."""
        return data_parallel(objective)

    def resume(self, position: Position) -> Position:
        """:func:`local_position`."""
        return local_position(position)

    def checkpoint(self, save: Save) -> Save:
        """:func:`checkpoint_hook`."""
        return checkpoint_hook(save)

    def finish(self, state: State, history: History) -> tuple[State, History]:
        """:func:`finish`."""
        return finish(state, history)


class Members(Strategy):
    """``train.parallel: members``: each process trains its share of the independent members (:class:`MemberParallel`).

    In one process it trains all members. A method without members, or more processes than members,
    is refused when training starts (:class:`MemberParallel`).
    """

    def __init__(self, *, sharded: bool) -> None:
        super().__init__(sharded=sharded)
        self._spread: MemberParallel | None = None

    def start(self, method: Posterior, state: State, name: str) -> tuple[Transform, State]:
        """Spread the members of the full ``state``; this process trains :meth:`MemberParallel.local`."""
        self._spread = MemberParallel(method, state, name)
        return self._spread.method, self._spread.local(state)

    def checkpoint(self, save: Save) -> Save:
        """:meth:`MemberParallel.checkpoint_hook` (after :meth:`start`)."""
        return self._started().checkpoint_hook(save)

    def finish(self, state: State, history: History) -> tuple[State, History]:
        """The members merged into the full state on every rank."""
        return self._started().merge(state), history

    def _started(self) -> MemberParallel:
        if self._spread is None:
            raise RuntimeError("Members.start must be called before training")
        return self._spread


def strategy(parallel: Parallel | str) -> Strategy:
    """The strategy of a run with ``train.parallel = parallel`` in the current process group.

    ``members`` spreads the members (over one process or many); ``data`` is data-parallel under a
    process group of several processes and one process otherwise.
    """
    if Parallel(parallel) is Parallel.MEMBERS:
        return Members(sharded=is_distributed())
    return DataParallel() if is_distributed() else Strategy()
