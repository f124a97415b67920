"""Bayesian transfer learning: choose which parameters of a pretrained network are Bayesian.

FP-BMA's transfer scheme (Lim et al., UAI 2025, §4) makes only the normalization layers and the classifier
Bayesian, selected by module *type*, never by name; the rest is frozen by ``requires_grad=False``, which
:func:`flatbma.params.trainable_params` honours (docs/methods.md §6).
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import Enum

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.instancenorm import _InstanceNorm

from flatbma.errors import FlatbmaError
from flatbma.models import classifier_of

NORM_TYPES: tuple[type[nn.Module], ...] = (_BatchNorm, nn.LayerNorm, nn.GroupNorm, _InstanceNorm)
"""Module types whose affine parameters count as normalization parameters."""



class Subset(str, Enum):
    """Which parameters are trained and Bayesian (``model.trainable``; strings and members are both accepted).

    ``all``; ``norm+classifier``: every normalization layer and the classifier (FP-BMA's transfer
    scheme); ``classifier``: the final ``nn.Linear`` only.
    """

    ALL = "all"
    NORM_CLASSIFIER = "norm+classifier"
    CLASSIFIER = "classifier"


def normalization_parameters(model: nn.Module) -> list[str]:
    """Names of the parameters of every normalization layer (selected by module type)."""
    return [
        f"{module_name}.{p}" if module_name else p
        for module_name, module in model.named_modules()
        if isinstance(module, NORM_TYPES)
        for p, _ in module.named_parameters(recurse=False)
    ]


def classifier_parameters(model: nn.Module) -> list[str]:
    """Names of the parameters of the final ``nn.Linear`` classifier."""
    name, linear = classifier_of(model)
    return [f"{name}.{p}" if name else p for p, _ in linear.named_parameters(recurse=False)]


def subset_names(model: nn.Module, subset: Subset | str) -> list[str]:
    """Parameter names of a named subset (in ``model.named_parameters()`` order)."""
    try:
        subset = Subset(subset)
    except (ValueError, TypeError):
        choices = "'all', 'norm+classifier' or 'classifier'"
        raise FlatbmaError(f"model.trainable must be {choices}, got {subset!r}") from None
    if subset is Subset.ALL:
        chosen = {n for n, _ in model.named_parameters()}
    elif subset is Subset.CLASSIFIER:
        chosen = set(classifier_parameters(model))
    else:
        chosen = set(normalization_parameters(model)) | set(classifier_parameters(model))
    return [n for n, _ in model.named_parameters() if n in chosen]


def restrict_trainable(model: nn.Module, names: Iterable[str]) -> int:
    """Make exactly ``names`` trainable (``requires_grad``), freeze the rest; return the number of trainable scalars."""
    names = set(names)
    params = dict(model.named_parameters())
    unknown = names - set(params)
    if unknown:
        raise FlatbmaError(f"unknown parameter names {sorted(unknown)[:5]}; see model.named_parameters()")
    if not names:
        raise FlatbmaError("the trainable subset is empty: the model has no parameters of the chosen kind")
    for name, p in params.items():
        p.requires_grad_(name in names)
    return sum(params[n].numel() for n in names)
