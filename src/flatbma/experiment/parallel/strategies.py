"""How the processes of a ``torchrun`` launch share a run, for every method: the run's parallel strategy.

A run picks its parallel mode once, when its experiment is built (:func:`strategy`: :class:`Strategy` for one
process, :class:`DataParallel`, :class:`Members`), and asks it for every process-dependent part, so the run itself
has no parallel branches. What each mode guarantees, and how it was tested: docs/distributed.md.

Data: :func:`data_parallel` reduces every gradient evaluation to ``ḡ = (1/N) Σ_r ∇L_{B_r}(w)``, the gradient of the
global batch (equal shards), with one flattened ``all_reduce``, before any ascent step: SAM's ``ε = ρ ḡ/‖ḡ‖`` uses
``ḡ``, and VI/FP-BMA reduce each Monte-Carlo sample's weight-space gradient before the chain rule to ``θ``. Every
rank seeds identically, so parameter-space noise is identical and the replicas stay equal (:func:`check_replicas`);
BatchNorm uses per-rank batch statistics, its running statistics averaged (:func:`average_buffers`) in every
checkpoint and before evaluation. Each rank evaluates a contiguous test shard (:func:`shard_loader`) and
:func:`all_reduce_metrics` sums the metric states; rank 0 alone writes files.

Members (:class:`MemberParallel`): each process trains a disjoint contiguous block of a posterior's independent
members (:func:`member_share`) on all the data, with no gradient all-reduce, so the trained members equal those of
one process. ``flatbma compare`` deals its (method, seed) runs out round-robin, each a single-process run
(:func:`~flatbma.experiment.parallel.processes.single_process`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from flatbma.errors import FlatbmaError
from flatbma.experiment.config.sections import Parallel
from flatbma.experiment.parallel.loaders import member_share, seeded_loader, shard_loader, train_loader
from flatbma.experiment.parallel.processes import (
    all_reduce_mean,
    all_reduce_metrics,
    average_buffers,
    barrier,
    check_replicas,
    collective_device,
    is_distributed,
    is_main,
    rank,
    world_size,
)
from flatbma.loop import History, Position
from flatbma.metrics import StreamingMetrics
from flatbma.params import Objective
from flatbma.types import Batch, Posterior, State, StepOutput, Transform

Save = Callable[[State, Position, History], None]
"""A checkpoint callback of the runner: ``save(state, position, history)``."""


def data_parallel(objective: Objective) -> Objective:
    """``objective`` whose gradients are averaged over the processes (:func:`all_reduce_mean`).

    An existing ``reduce_grads`` hook runs first.
    """
    inner = objective.reduce_grads
    if inner is None:
        return dataclasses.replace(objective, reduce_grads=all_reduce_mean)
    return dataclasses.replace(objective, reduce_grads=lambda g: all_reduce_mean(inner(g)))


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
    reduced = all_reduce_mean({"h": values.to(collective_device())})["h"].cpu()
    epochs = [dataclasses.replace(h, loss=float(v[0]), accuracy=float(v[1])) for h, v in zip(history.epochs, reduced)]
    if any(h.rmse is not None for h in history.epochs):  # a regression run's: the mean squared error averaged
        squared = torch.tensor([(h.rmse or 0.0) ** 2 for h in history.epochs], dtype=torch.float64)
        mse = all_reduce_mean({"h": squared.to(collective_device())})["h"].cpu()
        epochs = [dataclasses.replace(h, rmse=float(m) ** 0.5) for h, m in zip(epochs, mse)]
    return History(epochs)


def global_position(position: Position) -> Position:
    """The position rank 0 saves (a collective: all ranks call it).

    The epoch's running sums are summed over the processes; of the CUDA generator states only that
    of this process's own GPU is kept (every rank's GPU draws the same stream).
    """
    partial = position.partial
    if is_distributed():
        sums = torch.tensor(partial, dtype=torch.float64, device=collective_device())
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

    Checks the replicas, averages BatchNorm statistics, globalizes position and history, lets rank 0 alone call
    ``save``, and returns on every rank once the checkpoint is written (so an immediate resume reads it).
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

    Built on every rank from the same full state. Process ``r`` of ``N`` trains members
    ``member_share(M, N, r)``: :meth:`local` is its part of the state, :attr:`method` the posterior to train it
    with (its ``update`` combines the step outputs of all ranks), :meth:`merge` rebuilds the full state on every
    rank. With rank ``r`` holding ``m_r`` members, mean loss ``ℓ_r`` and mixture log-predictive ``log p_r``, the
    combined outputs are ``ℓ = Σ_r m_r ℓ_r / M`` and ``log p = logsumexp_r(log p_r + log m_r) − log M``.
    In one process it trains all members and changes nothing. ``method`` needs ``members > 0`` and ``split``
    (:class:`~flatbma.types.Posterior`), ``state`` is its full state (identical on every rank), ``name`` for messages.

    Raises:
        FlatbmaError: the method has no independent members, or there are more processes than members.
        ValueError: ``method.split`` does not partition the state (a broken posterior).
    """

    def __init__(self, method: Posterior, state: State, name: str) -> None:
        if method.can.members < 1 or method.can.split is None:
            raise FlatbmaError(f"method {name} has no independent members to spread; use train.parallel: data")
        world, me = world_size(), rank()
        if world > method.can.members:
            raise FlatbmaError(
                f"train.parallel: members gives each process at least one of the {method.can.members} members of "
                f"{name}, but {world} processes were launched: launch at most {method.can.members} "
                "(--nproc_per_node) or use train.parallel: data"
            )
        self.base, self.world, self.rank = method, world, me
        self.shares = [member_share(method.can.members, world, r) for r in range(world)]
        parts = [method.can.split(state, share) for share in self.shares]
        self._order = {sec: list(getattr(state, sec)) for sec in _SECTIONS}
        self._layouts = [
            {sec: {k: (v.shape, v.dtype, v.device) for k, v in getattr(part, sec).items()} for sec in _SECTIONS}
            for part in parts
        ]
        for sec in _SECTIONS:
            owned = [k for layout in self._layouts for k in layout[sec]]
            if len(owned) != len(self._order[sec]) or set(owned) != set(self._order[sec]):
                raise ValueError(f"{name}: Capabilities.split does not partition the state's {sec} entries")
        self.method = dataclasses.replace(method, update=self._update)

    def local(self, state: State) -> State:
        """This process's members of the full ``state``."""
        return self.base.can.split(state, self.shares[self.rank])

    def _update(self, state: State, batch: Batch) -> tuple[State, StepOutput]:
        state, out = self.base.update(state, batch)
        return state, self._combine(out)

    def _combine(self, out: StepOutput) -> StepOutput:
        if self.world == 1:
            return out
        logits = out.logits.detach()
        flat = torch.cat([out.loss.detach().reshape(1).to(logits.dtype), logits.reshape(-1)])
        gathered = [torch.empty_like(flat) for _ in range(self.world)]
        dist.all_gather(gathered, flat.to(collective_device()))
        both = torch.stack(gathered).to(logits.device)
        counts = torch.tensor([len(s) for s in self.shares], dtype=both.dtype, device=both.device)
        total = self.base.can.members
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

        Position and history are identical on every rank and saved as they are; returns once the file is
        written (a barrier).
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
    device = collective_device()
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


class Strategy:
    """How the processes share a run; this base class is one process training everything alone.

    A run asks its strategy alone for what depends on the processes: loaders, objective, the transform and
    state it trains, checkpoint callback, resumed position, final state, metric reduction.

    Args:
        sharded: each process evaluates a contiguous test shard (:func:`shard_loader`), metric states are
            summed over the processes (:func:`all_reduce_metrics`) and the run records its ``world_size``.
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

    Replicas are checked and BatchNorm statistics averaged at every checkpoint and at the end; rank 0 saves.
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
    """``train.parallel: members``: each process trains its share of the independent members.

    A method without members, or more processes than members, is refused at :meth:`start`.
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

    ``members`` spreads the members over one process or many; ``data`` is data-parallel when several run.
    """
    if Parallel(parallel) is Parallel.MEMBERS:
        return Members(sharded=is_distributed())
    return DataParallel() if is_distributed() else Strategy()
