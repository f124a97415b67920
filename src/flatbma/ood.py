"""Out-of-distribution (OOD) detection: does the BMA's uncertainty tell the test set from another one?

``eval.ood`` names the OOD set (:func:`ood_dataset`): a **corruption**, applied to the run's test set at severity 5
(Hendrycks & Dietterich 2019), or a **data set**, its test split resized (bilinear, antialiased) to the run's images,
channels matched (grey repeated to RGB, RGB to grey by ITU-R 601 luma), with the run's eval transform.

Two scores, each by :func:`flatbma.metrics.ood_auroc`: the predictive entropy ``H[p̄(y|x)]`` and the mutual
information ``I(y; w | x)`` (Houlsby et al. 2011; ``None`` for the probit predictive); docs/methods.md §7.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader

from flatbma.bn import eval_mode
from flatbma.data import ArrayDataset, dataset_names, load_dataset
from flatbma.data.corruptions import applicable, corrupt_dataset, corruption_names
from flatbma.errors import FlatbmaError, suggest
from flatbma.metrics import ood_auroc, uncertainty_decomposition
from flatbma.predict import Predictions, sample_log_probs
from flatbma.types import Predictive

OOD_SEVERITY = 5
"""The severity of a corrupted OOD set."""

_LUMA = (0.299, 0.587, 0.114)


def check_ood_name(name: str) -> str:
    """``name`` if it names a corruption or a data set, else one line saying what it may be.

    Raises:
        FlatbmaError: an unknown name.
    """
    known = [*corruption_names(), *dataset_names()]
    if name not in known:
        raise FlatbmaError(
            f"eval.ood {name!r} is neither a corruption nor a data set.{suggest(name, known)} Give a corruption "
            f"({', '.join(corruption_names()[:3])}, ...: the test set at severity {OOD_SEVERITY}) or a data set "
            f"({', '.join(dataset_names())})"
        )
    return name


def check_ood_applies(name: str, channels: int) -> None:
    """Refuse a corruption that does not apply to images of ``channels`` channels (``saturate`` on grey ones).

    Raises:
        FlatbmaError: one line saying so.
    """
    if name in corruption_names() and not applicable(name, channels):
        raise FlatbmaError(
            f"eval.ood {name!r} needs colour images, but the test images have {channels} channel: choose another "
            "corruption"
        )


def check_ood_data(name: str | None) -> None:
    """Refuse an ``eval.ood`` data set that cannot be read from its default place (a corruption always can).

    Raises:
        FlatbmaError: one line naming the set and why it cannot be read.
    """
    if name is None or name in corruption_names():
        return
    check_ood_name(name)
    try:
        load_dataset(name)
    except FlatbmaError as e:
        why = str(e) if len(str(e)) <= 90 else str(e)[:87] + "..."
        raise FlatbmaError(
            f"eval.ood {name!r}: the data set cannot be read ({why}): install it, or choose a corruption"
        ) from None


def ood_dataset(name: str, test: ArrayDataset, *, seed: int, root: str | None = None) -> ArrayDataset:
    """The OOD set ``name`` (module docstring) shaped like the run's test set ``test``, with its transform.

    ``seed`` seeds a corruption's draws; ``root``: where a data set's files are (``None``: its default place).

    Raises:
        FlatbmaError: an unknown name, a corruption that does not apply to the images, or an unreadable data set.
    """
    check_ood_name(name)
    channels, height, width = test.image_shape
    if name in corruption_names():
        check_ood_applies(name, channels)
        return corrupt_dataset(test, name, OOD_SEVERITY, seed=seed)
    other = load_dataset(name, root).test
    images = other.images.float() / 255.0 if other.images.dtype == torch.uint8 else other.images.float()
    images = _matched_channels(images, channels)
    if images.shape[-2:] != (height, width):
        images = F.interpolate(images, size=(height, width), mode="bilinear", antialias=True, align_corners=False)
    images = images.clamp(0.0, 1.0)
    if test.images.dtype == torch.uint8:
        images = (images * 255.0).round().to(torch.uint8)
    return ArrayDataset(images, torch.zeros(len(images), dtype=torch.int64), ["ood"], test.transform)


def _matched_channels(images: Tensor, channels: int) -> Tensor:
    have = images.shape[1]
    if have == channels:
        return images
    if have == 1 and channels == 3:
        return images.expand(-1, 3, -1, -1).clone()
    if have == 3 and channels == 1:
        return torch.einsum("nchw,c->nhw", images, torch.tensor(_LUMA, dtype=images.dtype)).unsqueeze(1)
    raise FlatbmaError(f"eval.ood: cannot match images of {have} channels to the run's {channels}")


@torch.no_grad()
def uncertainty_scores(
    model: nn.Module,
    predictions: Predictions,
    loader: DataLoader,
    *,
    device: torch.device,
    mode: Callable[[nn.Module], AbstractContextManager[Any]] | None = None,
    precision: Callable[[], AbstractContextManager[Any]] | None = None,
) -> dict[str, Tensor]:
    """Per-example ``total``, ``aleatoric`` and ``epistemic`` uncertainty of the BMA over ``loader`` (CPU, float64).

    The model runs in ``mode`` (``None``: eval mode) under ``precision()`` (``None``: none).
    """
    parts: list[dict[str, Tensor]] = []
    with (mode or eval_mode)(model), precision() if precision is not None else nullcontext():
        for x, _ in loader:
            per_sample = sample_log_probs(model, predictions, x.to(device))
            parts.append({k: v.cpu() for k, v in uncertainty_decomposition(per_sample).items()})
    return {k: torch.cat([p[k] for p in parts]) for k in ("total", "aleatoric", "epistemic")}


def ood_metrics(
    scores_in: dict[str, Tensor], scores_out: dict[str, Tensor], *, name: str, predictive: Predictive
) -> dict[str, Any]:
    """The OOD record of ``results.json``/``metrics.json`` from the two sets' :func:`uncertainty_scores`.

    Returns:
        ``{"set", "n_in", "n_out", "auroc_entropy", "auroc_mutual_information", "entropy_in", "entropy_out",
        "mutual_information_in", "mutual_information_out"}`` (the last four: means over the set, nats);
        the mutual-information entries are ``None`` for the probit predictive.
    """
    split = predictive is not Predictive.PROBIT
    out: dict[str, Any] = {
        "set": name,
        "n_in": int(scores_in["total"].numel()),
        "n_out": int(scores_out["total"].numel()),
        "auroc_entropy": ood_auroc(scores_in["total"], scores_out["total"]),
        "auroc_mutual_information": ood_auroc(scores_in["epistemic"], scores_out["epistemic"]) if split else None,
        "entropy_in": float(scores_in["total"].mean()),
        "entropy_out": float(scores_out["total"].mean()),
        "mutual_information_in": float(scores_in["epistemic"].mean()) if split else None,
        "mutual_information_out": float(scores_out["epistemic"].mean()) if split else None,
    }
    return out
