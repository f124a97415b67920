"""What flatbma needs of a classifier, checked with one forward pass on a batch before anything trains.

:func:`check_classifier` makes a model that cannot train fail with one line naming it and the fix, not a traceback
from inside the first step; :func:`logits_of` decides what a forward pass must return.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from flatbma.errors import FlatbmaError, FlatbmaTypeError

__all__ = ["SUPPORTED_DTYPES", "check_classifier", "first_output", "keep_logits", "logits_of", "returns_sequence"]

SUPPORTED_DTYPES = (torch.float32, torch.float64)
"""The floating dtypes flatbma trains in: its covariances, solves and metrics are not written for 16 bits."""


def logits_of(output: object, name: str) -> Tensor:
    """The logits of a forward pass of ``name``: its output, which must be one tensor.

    Raises:
        FlatbmaTypeError: any other output (a tuple of logits and features, a dict), saying what to return.
    """
    if isinstance(output, Tensor):
        return output
    return_kind = type(output).__name__
    raise FlatbmaTypeError(
        f"{name} returns a {return_kind}, not a tensor of logits: flatbma needs a forward pass that returns one "
        "tensor [batch, classes] (wrap the model in a module that returns the logits alone)"
    )


def returns_sequence(model: nn.Module, x: Tensor, *, name: str) -> bool:
    """Whether ``model(x)`` returns a tuple or list whose first element is a tensor (logits, then extras).

    The forward pass is :func:`check_classifier`'s (eval mode, no gradients, random generators forked).
    """
    output = _forward(model, x, name, "")
    return isinstance(output, tuple | list) and len(output) > 0 and isinstance(output[0], Tensor)


def first_output(module: nn.Module, inputs: object, output: object) -> object:
    """A forward hook: the first element of a tuple or list output (the logits), any other output as it is."""
    if isinstance(output, tuple | list) and len(output) > 0 and isinstance(output[0], Tensor):
        return output[0]
    return output


def keep_logits(model: nn.Module) -> nn.Module:
    """Make ``model`` return the first element of a tuple output — its logits — with a forward hook; return it.

    The hook (:func:`first_output`) is registered once and works under ``functional_call`` too; remove it with
    ``model._forward_hooks`` if the module must return its tuple again.
    """
    if first_output not in model._forward_hooks.values():
        model.register_forward_hook(first_output)
    return model


def check_classifier(model: nn.Module, x: Tensor, *, name: str, num_classes: int | None = None, hint: str = "") -> int:
    """Check ``model`` as a classifier with one forward pass on the inputs ``x``; return its number of classes.

    In this order, each failure a :class:`~flatbma.errors.FlatbmaError` naming ``name``:

    1. no parameter or buffer is on the ``meta`` device (a module without data);
    2. its floating parameters are float32 or float64 (:data:`SUPPORTED_DTYPES`), all of one dtype, that
       of ``x`` (a :class:`~flatbma.errors.FlatbmaTypeError` when ``x`` is not floating);
    3. every parameter is finite (``NaN`` weights, e.g. from a damaged checkpoint);
    4. at least one parameter is trainable (``requires_grad``);
    5. ``model(x)`` runs — in eval mode, without gradients, random generators forked, so the module's mode and
       buffers and the caller's random stream are unchanged (``hint`` is added to the message when it fails);
    6. it returns logits (:func:`logits_of`) of shape ``[len(x), C]`` with ``C >= 2`` (``C = num_classes``
       when given), of ``x``'s dtype.

    ``x`` is a small batch on the model's device (two examples are enough); ``name`` is how messages call the model
    (``"model 'mlp'"``); ``num_classes`` is the data's class count, or ``None`` (taken from the output).
    """
    tensors = [*model.parameters(), *model.buffers()]
    if any(t.is_meta for t in tensors):
        raise FlatbmaError(
            f"{name} has weights on the meta device (shapes without data): materialize it first, e.g. "
            "model.to_empty(device='cpu') and load its weights"
        )
    if not x.is_floating_point():
        raise FlatbmaTypeError(f"the inputs of {name} must be floating point, got {x.dtype}: convert them (x.float())")
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    unsupported = sorted(str(d).removeprefix("torch.") for d in dtypes if d not in SUPPORTED_DTYPES)
    if unsupported:
        raise FlatbmaError(
            f"{name} has {', '.join(unsupported)} weights: flatbma trains float32 (or float64) models; convert it "
            "with model.float()"
        )
    if dtypes and dtypes != {x.dtype}:
        found = " and ".join(sorted(str(d).removeprefix("torch.") for d in dtypes))
        raise FlatbmaError(
            f"{name} has {found} weights but its inputs are {str(x.dtype).removeprefix('torch.')}: give both one "
            "dtype (model.float() for float32 inputs)"
        )
    bad = next((n for n, p in model.named_parameters() if not bool(torch.isfinite(p).all())), None)
    if bad is not None:
        raise FlatbmaError(
            f"{name} has NaN or infinite weights ({bad}) before training: its initialization or pretrained "
            "weights are damaged; load good weights"
        )
    if not any(p.requires_grad for p in model.parameters()):
        raise FlatbmaError(
            f"{name} has no trainable parameter (every requires_grad is False): make the weights to train "
            "trainable (p.requires_grad_(True))"
        )
    output = _forward(model, x, name, hint)
    logits = logits_of(output, name)
    if logits.dim() != 2 or logits.shape[0] != x.shape[0] or logits.shape[1] < 2:
        want = f"[{x.shape[0]}, {num_classes if num_classes is not None else 'classes >= 2'}]"
        raise FlatbmaError(
            f"{name} returns logits of shape {list(logits.shape)} for a batch of {x.shape[0]}; flatbma needs "
            f"{want}: one row of class scores per example"
        )
    classes = int(logits.shape[1])
    if num_classes is not None and classes != num_classes:
        raise FlatbmaError(
            f"{name} returns {classes} logits per example but the data has {num_classes} classes: build it with "
            f"{num_classes} outputs"
        )
    if logits.dtype != x.dtype:
        raise FlatbmaError(
            f"{name} returns {str(logits.dtype).removeprefix('torch.')} logits for "
            f"{str(x.dtype).removeprefix('torch.')} inputs: return logits of the inputs' dtype"
        )
    return classes


def _forward(model: nn.Module, x: Tensor, name: str, hint: str) -> object:
    """``model(x)`` in eval mode, without gradients, under forked random generators; its mode is restored."""
    devices = [x.device.index or 0] if x.device.type == "cuda" else []
    modes = [(m, m.training) for m in model.modules()]  # a frozen part may be kept in eval mode on purpose
    try:
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            model.eval()
            return model(x)
    except (KeyboardInterrupt, SystemExit):
        raise
    except Exception as e:  # the model's own code may fail in any way
        detail = str(e).strip().splitlines()[0] if str(e).strip() else ""
        detail = detail if len(detail) <= 120 else detail[:117] + "..."
        raise FlatbmaError(
            f"{name} fails on a batch of inputs of shape {list(x.shape)} ({type(e).__name__}: {detail})"
            + (f"; {hint}" if hint else "")
        ) from None
    finally:
        for module, training in modes:
            module.training = training
