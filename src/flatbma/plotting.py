"""Figures as PNG bytes: the one matplotlib helper of flatbma, and the loss-landscape plots.

:func:`figure` builds a grid of axes without pyplot (no global state) and :func:`png` gives PNG bytes without a
software stamp, so the same drawing gives the same bytes. matplotlib is optional (``pip install flatbma[plots]``)
and imported only when a figure is drawn.
"""

from __future__ import annotations

import io
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from flatbma.checks import check_finite_vector
from flatbma.errors import FlatbmaError

__all__ = [
    "Curve",
    "figure",
    "landscape_1d_png",
    "landscape_2d_png",
    "plot_landscape_1d",
    "plot_landscape_2d",
    "png",
]

Curve = tuple[Any, Any, Any]
"""``(alphas, mean, std | None)``: one curve of :func:`landscape_1d_png` (tensors, arrays or lists)."""

_LANDSCAPE_DPI = 110


def check_available(what: str = "plots") -> None:
    """Raise a :class:`FlatbmaError` on how to install matplotlib when it is missing (checked before long work)."""
    try:
        import matplotlib.figure  # noqa: F401
    except ImportError:
        raise FlatbmaError(f"{what} need matplotlib: pip install matplotlib (or pip install flatbma[plots])") from None


def figure(nrows: int, ncols: int, width: float, height: float, *, what: str = "plots") -> tuple[Any, list[Any]]:
    """A matplotlib ``Figure`` of ``nrows × ncols`` panels of ``width × height`` inches, and its axes.

    The figure has a constrained layout; the axes are returned row by row in a flat list. ``what``: what needs
    matplotlib, for the message when it is missing (e.g. ``"report figures"``).

    Raises:
        FlatbmaError: if matplotlib is not installed, saying how to install it.
    """
    check_available(what)
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width * ncols, height * nrows), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False)
    return fig, [ax for row in axes for ax in row]


def png(fig: Any, *, dpi: float) -> bytes:
    """The PNG bytes of a matplotlib figure at ``dpi``, without the ``Software`` metadata stamp."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, metadata={"Software": None})
    return buf.getvalue()


# ---------------------------------------------------------------- loss landscapes


def _as_list(values: Any) -> list[float]:
    if isinstance(values, Tensor):
        return values.detach().cpu().to(torch.float64).reshape(-1).tolist()
    return [math.nan if v is None else float(v) for v in values]


def _draw_curves(ax: Any, curves: Mapping[str, Curve]) -> None:
    """Draw ``{label: (alphas, mean, std | None)}`` on matplotlib axes: lines with ±std bands."""
    for label, curve in curves.items():
        if len(curve) != 3:
            raise FlatbmaError(f"curve {label!r} must be (alphas, mean, std or None), got {len(curve)} items")
        alphas, mean, std = curve
        a, m = _as_list(alphas), _as_list(mean)
        if len(a) != len(m):
            raise FlatbmaError(f"curve {label!r}: {len(a)} alphas but {len(m)} losses")
        (line,) = ax.plot(a, m, label=str(label), marker=".")
        if std is not None:
            s = _as_list(std)
            if len(s) != len(m):
                raise FlatbmaError(f"curve {label!r}: {len(m)} losses but {len(s)} standard deviations")
            lo = [mi - si for mi, si in zip(m, s)]
            hi = [mi + si for mi, si in zip(m, s)]
            ax.fill_between(a, lo, hi, color=line.get_color(), alpha=0.2, linewidth=0)


def landscape_1d_png(
    curves: Mapping[str, Curve],
    *,
    xlabel: str = "α",
    ylabel: str = "training loss",
    title: str | None = None,
    dpi: float = _LANDSCAPE_DPI,
) -> bytes:
    """PNG bytes of 1-D loss curves ``{label: (alphas, mean, std | None)}`` (std drawn as a band)."""
    if not curves:
        raise FlatbmaError("no curve to plot: pass at least one {label: (alphas, mean, std)}")
    fig, (ax,) = figure(1, 1, 6.0, 4.0)
    _draw_curves(ax, curves)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend()
    if title:
        ax.set_title(title)
    return png(fig, dpi=dpi)


def plot_landscape_1d(
    curves: Mapping[str, Curve],
    path: str | Path,
    *,
    xlabel: str = "α",
    ylabel: str = "training loss",
    title: str | None = None,
    dpi: float = _LANDSCAPE_DPI,
) -> Path:
    """Write :func:`landscape_1d_png` to ``path`` (parent folders are created); returns the path."""
    return _write(path, landscape_1d_png(curves, xlabel=xlabel, ylabel=ylabel, title=title, dpi=dpi))


def landscape_2d_png(
    alphas: Sequence[float] | Tensor,
    betas: Sequence[float] | Tensor,
    surface: Any,
    *,
    levels: int = 20,
    title: str | None = None,
    dpi: float = _LANDSCAPE_DPI,
) -> bytes:
    """PNG bytes of a contour plot of ``surface[i, j] = f(alphas[i], betas[j])`` (e.g. a ``loss_surface``)."""
    a, b = check_finite_vector(alphas, "alphas"), check_finite_vector(betas, "betas")
    z = torch.as_tensor(surface, dtype=torch.float64).detach().cpu()
    if tuple(z.shape) != (len(a), len(b)):
        raise FlatbmaError(
            f"surface must have shape (len(alphas), len(betas)) = {(len(a), len(b))}, got {tuple(z.shape)}"
        )
    if len(a) < 2 or len(b) < 2:
        raise FlatbmaError("a contour plot needs at least 2 alphas and 2 betas")
    fig, (ax,) = figure(1, 1, 5.5, 4.5)
    xs, ys, zs = a.tolist(), b.tolist(), z.T.tolist()  # contour wants Z[y, x]
    filled = ax.contourf(xs, ys, zs, levels=levels, cmap="viridis")
    lines = ax.contour(xs, ys, zs, levels=levels, colors="k", linewidths=0.4)
    ax.clabel(lines, inline=True, fontsize=6, fmt="%.3g")
    fig.colorbar(filled, ax=ax, label="training loss")
    ax.plot([0.0], [0.0], marker="*", color="w", markeredgecolor="k", markersize=10)
    ax.set_xlabel("α (d₁)")
    ax.set_ylabel("β (d₂)")
    if title:
        ax.set_title(title)
    return png(fig, dpi=dpi)


def plot_landscape_2d(
    alphas: Sequence[float] | Tensor,
    betas: Sequence[float] | Tensor,
    surface: Any,
    path: str | Path,
    *,
    levels: int = 20,
    title: str | None = None,
    dpi: float = _LANDSCAPE_DPI,
) -> Path:
    """Write :func:`landscape_2d_png` to ``path`` (parent folders are created); returns the path."""
    return _write(path, landscape_2d_png(alphas, betas, surface, levels=levels, title=title, dpi=dpi))


def _write(path: str | Path, data: bytes) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path
