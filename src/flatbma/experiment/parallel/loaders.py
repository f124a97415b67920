"""The data loaders of a run's processes: shards of the same global batches, and evaluation shards.

``data.batch_size`` is the global batch, divisible by the number of processes ``N``. :class:`ShardedBatchSampler`
draws the global batches exactly as one process does and gives rank ``r`` the ``r``-th contiguous slice of each.
Shards always have equal sizes: the epoch's trailing partial batch of ``q`` examples is cut to ``N·⌊q/N⌋`` and
dropped when that leaves fewer than two examples per process (one process drops only a trailing batch of one).
The test set is split into contiguous shards (:func:`shard_loader`), one per process.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, RandomSampler, Sampler

from flatbma.errors import FlatbmaError
from flatbma.experiment.parallel.processes import rank, world_size


def global_batch_sizes(num_examples: int, batch_size: int, world: int = 1) -> list[int]:
    """Sizes of the global batches of one epoch, every one a multiple of ``world`` (see the module doc).

    Raises:
        FlatbmaError: if ``batch_size`` is not divisible by ``world`` or the data cannot give every process an example.
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

    The global batches are drawn by ``BatchSampler(RandomSampler(range(n), generator=generator), batch_size)``,
    as ``DataLoader(shuffle=True, generator=generator)`` does in one process, and cut to
    :func:`global_batch_sizes`; rank ``r`` of ``N`` gets examples ``[r·b/N, (r+1)·b/N)`` of a global batch of
    size ``b``. Pass ``generator`` to the ``DataLoader`` too: it draws its base seed from it as in one process.
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
