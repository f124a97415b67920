"""The classification head of a network, and seeded construction.

Transfer learning (FP-BMA §4) re-initializes a pretrained network's classifier for the new classes;
:func:`classifier_of` finds it by module *type*, never by a name substring.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from flatbma.errors import FlatbmaError
from flatbma.models._checks import check_positive_int, check_seed


def classifier_of(model: nn.Module) -> tuple[str, nn.Linear]:
    """Return the qualified name and module of the final classification layer.

    The last :class:`torch.nn.Linear` in ``model.named_modules()`` order — ``"fc"`` for ResNets, ``"classifier.1"``
    for MobileNetV2, ``"classifier"`` for the small models. Returns ``(name, linear)``.

    Raises:
        FlatbmaError: if the model contains no ``nn.Linear``.
    """
    found: tuple[str, nn.Linear] | None = None
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            found = (name, module)
    if found is None:
        raise FlatbmaError(
            f"{type(model).__name__} contains no nn.Linear layer, so it has no classification head to "
            "re-initialize or make Bayesian; end the network with an nn.Linear classifier."
        )
    return found


def replace_classifier(model: nn.Module, num_classes: int, *, seed: int | None = None) -> nn.Linear:
    """Replace the final classifier by a freshly initialized ``nn.Linear`` with ``num_classes`` outputs.

    In place; returns the new layer, which keeps the old one's input size, bias setting, device and dtype, with
    PyTorch's default initialization drawn under ``seed`` (the global RNG untouched) or, for ``None``, from it.
    """
    check_positive_int("num_classes", num_classes)
    name, old = classifier_of(model)
    if name == "":  # the model itself is a Linear: there is no parent to attach a new one to
        raise FlatbmaError("the model is a bare nn.Linear; build a new nn.Linear instead of replacing it.")
    with seeded(seed):
        new = nn.Linear(old.in_features, num_classes, bias=old.bias is not None)
    new = new.to(device=old.weight.device, dtype=old.weight.dtype)
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name), child, new)
    return new


@contextmanager
def seeded(seed: int | None) -> Iterator[None]:
    """Run the body with the CPU RNG seeded by ``seed``, restoring the global RNG state afterwards.

    With ``seed=None`` the body draws from (and advances) the global RNG; only the CPU generator is forked.
    """
    check_seed(seed)
    if seed is None:
        yield
        return
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield
