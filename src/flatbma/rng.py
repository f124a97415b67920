"""Reproducible randomness shared by the methods: SplitMix64 seeds, seeded generators, forked RNG.

A method that must draw the same numbers after a checkpoint round trip, whatever else runs in the process,
derives its seeds from a stored seed and a stream number with SplitMix64 (Steele, Lea and Flood, OOPSLA 2014)
instead of advancing one global stream.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from torch import Tensor

SEED_KEY = "rng/seed"
"""``State.aux`` key of a method's 0-d int64 seed from which its per-step noise is derived."""

SEED_BOUND = 2**63 - 1
"""Exclusive upper bound of the seeds drawn with ``torch.randint`` for ``manual_seed`` (63 bits)."""

_GOLDEN = 0x9E3779B97F4A7C15
_MASK64 = (1 << 64) - 1
_MASK63 = (1 << 63) - 1


def splitmix64(seed: int, stream: int) -> int:
    """The SplitMix64 value of ``(seed, stream)``, a 64-bit unsigned integer.

    ``z = seed + (stream + 1)·φ mod 2⁶⁴``, then ``z ← (z ⊕ z≫30)·0xBF58476D1CE4E5B9``,
    ``z ← (z ⊕ z≫27)·0x94D049BB133111EB``, ``z ⊕ z≫31`` (all mod 2⁶⁴, ``φ`` the 64-bit golden ratio).
    ``torch.Generator.manual_seed`` takes 63 bits: callers keep the low or the high ones.
    """
    z = (seed + (stream + 1) * _GOLDEN) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def new_seed() -> Tensor:
    """A 0-d int64 seed drawn from torch's global generator (so ``seed_everything`` fixes it)."""
    return torch.randint(0, 2**62, (), dtype=torch.int64)


def draw_seed(generator: torch.Generator | None = None) -> int:
    """A seed in ``[0, SEED_BOUND)`` drawn from ``generator`` (torch's global generator when ``None``)."""
    device = generator.device if generator is not None else "cpu"
    return int(torch.randint(SEED_BOUND, (), dtype=torch.int64, generator=generator, device=device))


def derive_seed(seed: int, stream: int) -> int:
    """The seed of stream ``stream`` of ``seed``: the low 63 bits of :func:`splitmix64` (a valid ``manual_seed``)."""
    return splitmix64(seed, stream) & _MASK63


def seeded_generator(seed: Tensor | int, stream: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator on ``device`` seeded with the low 63 bits of :func:`splitmix64` of ``(seed, stream)``.

    ``stream`` is the step number for training noise (``-1`` for initialization).
    """
    g = torch.Generator(device=device)
    g.manual_seed(derive_seed(int(seed), stream))
    return g


@contextmanager
def forked_rng(seed: int) -> Iterator[None]:
    """Run the body with torch's CPU (and initialized CUDA) generators seeded by ``seed``, restored afterwards."""
    cuda = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=cuda):
        torch.default_generator.manual_seed(seed)
        if cuda:
            torch.cuda.manual_seed_all(seed)
        yield


def first_batch(loader: Iterable[Any]) -> Any:
    """The first batch of ``loader`` (``None`` if it yields none), read without moving any random stream.

    Torch's global CPU generator, ``loader.generator``, ``loader.sampler.generator`` and Python's and NumPy's
    global states are restored, so the loader then yields exactly what it would have.
    """
    generators = [getattr(loader, "generator", None), getattr(getattr(loader, "sampler", None), "generator", None)]
    owned = [(g, g.get_state()) for g in generators if isinstance(g, torch.Generator)]
    python, numpy = random.getstate(), np.random.get_state()  # noqa: NPY002 (the legacy global state a dataset may use)
    try:
        with torch.random.fork_rng(devices=[]):
            return next(iter(loader), None)
    finally:
        for generator, state in owned:
            generator.set_state(state)
        random.setstate(python)
        np.random.set_state(numpy)  # noqa: NPY002
