"""Tensor dicts stored as views of one flat buffer, so per-step updates run as a few large kernels.

A posterior over many small tensors pays ~10–20 µs of dispatch per tensor and operation, more than the
arithmetic on CPU. :func:`pack` lays such a dict out in one flat buffer described by a :class:`Layout` and
returns views of it under the same keys; code that knows the layout (:func:`flat_of`) works on the buffer,
everything else sees an ordinary ``dict[str, Tensor]`` (in-place updates of a view show in the buffer).

Two forms: a plain ``dict`` of views (:meth:`Layout.views`), kept in a posterior's state and recognized by
identity (the layout's keys in order, every value a view of the buffer; a replaced, reordered or partial dict,
copies and checkpoint round trips fall back to the per-tensor path, with the same numbers); and a read-only
:class:`Packed` mapping (:meth:`Layout.lazy`) for intermediate results, whose views are made on first lookup.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from flatbma.types import Params

_ATTRIBUTE = "_flatbma_layout"
"""Python attribute of a flat buffer holding its :class:`Layout`."""


@dataclass(frozen=True)
class Layout:
    """Where every tensor of a dict lies in one flat buffer of ``numel`` elements.

    ``keys`` in order, and each view's ``shapes``, ``strides`` (not necessarily contiguous) and element ``offsets``;
    ``shape``: the natural shape of the whole buffer (e.g. ``[K+2, d]`` for low-rank VI's ``θ``); ``kind``: who laid
    it out (``"contiguous"`` or a family's name).
    """

    keys: tuple[str, ...]
    shapes: tuple[torch.Size, ...]
    strides: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    kind: str = "contiguous"

    @property
    def numel(self) -> int:
        """Number of elements of the buffer."""
        return math.prod(self.shape)

    @staticmethod
    def contiguous(tensors: Mapping[str, Tensor]) -> Layout:
        """Every tensor contiguous, one after the other in key order."""
        keys, shapes, strides, offsets, offset = [], [], [], [], 0
        for k, v in tensors.items():
            keys.append(k)
            shapes.append(v.shape)
            strides.append(contiguous_strides(v.shape))
            offsets.append(offset)
            offset += v.numel()
        return Layout(tuple(keys), tuple(shapes), tuple(strides), tuple(offsets), (offset,))

    def views(self, flat: Tensor) -> Params:
        """The dict of views of ``flat`` (``numel`` elements), registering the layout on it.

        A ``flat`` that does not own its contiguous storage is copied first.
        """
        flat = _root(flat, self)
        setattr(flat, _ATTRIBUTE, self)
        return {
            k: flat.as_strided(shape, stride, offset)
            for k, shape, stride, offset in zip(self.keys, self.shapes, self.strides, self.offsets, strict=True)
        }

    def lazy(self, flat: Tensor) -> Packed:
        """``flat`` (``numel`` elements) as a :class:`Packed` mapping; views are made only when needed."""
        return Packed(_root(flat, self), self)


def _root(flat: Tensor, layout: Layout) -> Tensor:
    """``flat`` if it owns its contiguous storage (so views of it have ``_base is flat``), else a copy."""
    if flat.numel() != layout.numel:
        raise ValueError(f"a buffer of {flat.numel()} elements does not hold a layout of {layout.numel}")
    if flat._base is not None or flat.storage_offset() != 0 or not flat.is_contiguous():
        flat = flat.clone(memory_format=torch.contiguous_format)
    return flat


class Packed(Mapping[str, Tensor]):
    """A read-only mapping ``key -> tensor`` backed by one buffer laid out by ``layout``.

    Looking a key up creates all the views once (:meth:`Layout.views`); ``dict(packed)`` is a packed dict of
    views. ``derived`` caches what code computes from the values (e.g. :func:`flatbma.gaussian.geometry` of a
    ``θ``): valid since a mapping, one step's value, is never updated in place while in use.
    """

    __slots__ = ("_views", "derived", "flat", "layout")

    def __init__(self, flat: Tensor, layout: Layout, views: Params | None = None) -> None:
        self.flat = flat
        self.layout = layout
        self._views = views
        self.derived: dict[object, object] = {}

    def _materialized(self) -> Params:
        if self._views is None:
            self._views = self.layout.views(self.flat)
        return self._views

    def __getitem__(self, key: str) -> Tensor:
        return self._materialized()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.layout.keys)

    def __len__(self) -> int:
        return len(self.layout.keys)

    def __contains__(self, key: object) -> bool:
        return key in self.layout.keys

    def __repr__(self) -> str:
        return f"Packed({len(self)} tensors in {tuple(self.layout.shape)}, {self.flat.dtype})"


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """The strides of a contiguous (row-major) tensor of ``shape``."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def pack(tensors: Mapping[str, Tensor], layout: Layout | None = None) -> Params:
    """Copies of ``tensors`` as views of one new buffer laid out by ``layout`` (default: contiguous).

    The tensors must share one dtype and device and match the layout's keys and shapes.
    """
    layout = Layout.contiguous(tensors) if layout is None else layout
    ref = tensors[layout.keys[0]]
    if set(tensors) != set(layout.keys):
        raise ValueError(f"pack: the keys {sorted(tensors)[:4]}... are not the layout's {list(layout.keys)[:4]}...")
    flat = torch.empty(layout.numel, dtype=ref.dtype, device=ref.device)
    out = layout.views(flat)
    with torch.no_grad():
        for k, v in out.items():
            v.copy_(tensors[k])
    return out


def buffer(
    tensors: Mapping[str, Tensor] | Sequence[Tensor], keys: Sequence[str] | None = None, *, kind: str | None = None
) -> tuple[Layout, Tensor] | None:
    """``(layout, buffer)`` of a packed mapping (or of a list of its values with their ``keys``), else ``None``.

    The buffer comes in the layout's ``shape``. With ``kind``, only a layout of that kind counts.
    """
    if isinstance(tensors, Packed):
        layout, base = tensors.layout, tensors.flat
        if keys is not None and tuple(keys) != layout.keys:
            return None
    else:
        if isinstance(tensors, Mapping):
            if keys is not None and tuple(keys) != tuple(tensors):
                return None
            keys, values = tuple(tensors), list(tensors.values())
        else:
            values = list(tensors)
        if not values:
            return None
        base = values[0]._base
        layout = getattr(base, _ATTRIBUTE, None) if base is not None else None
        if layout is None or tuple(keys) != layout.keys or any(v._base is not base for v in values):
            return None
    if kind is not None and layout.kind != kind:
        return None
    return layout, base.view(layout.shape)


def layout_of(
    tensors: Mapping[str, Tensor] | Sequence[Tensor], keys: Sequence[str] | None = None, *, kind: str | None = None
) -> Layout | None:
    """The layout of a packed mapping (or of a list of its values with their ``keys``), else ``None``."""
    found = buffer(tensors, keys, kind=kind)
    return None if found is None else found[0]


def flat_of(
    tensors: Mapping[str, Tensor] | Sequence[Tensor], keys: Sequence[str] | None = None, *, kind: str | None = None
) -> Tensor | None:
    """The buffer (in its layout's ``shape``) that a packed mapping's values are views of, else ``None``."""
    found = buffer(tensors, keys, kind=kind)
    return None if found is None else found[1]


def as_packed(tensors: Mapping[str, Tensor]) -> Mapping[str, Tensor]:
    """A packed dict as a :class:`Packed` mapping over the same tensors (anything else unchanged)."""
    if isinstance(tensors, Packed):
        return tensors
    found = buffer(tensors)
    if found is None:
        return tensors
    layout = found[0]
    return Packed(next(iter(tensors.values()))._base, layout, dict(tensors))


def coalesce(keys: Sequence[str], *sources: Mapping[str, Tensor] | Sequence[Tensor]) -> tuple[list[Tensor], ...]:
    """One flat tensor per source when all are packed alike, else each source's tensors in ``keys`` order.

    A source is a mapping with the keys ``keys`` or the list of its values in that order. With one common
    layout it returns ``([flat₁], [flat₂], ...)``, so a ``torch._foreach_*`` update runs on one tensor per source.
    """
    found = [buffer(source, keys) for source in sources]
    if found[0] is not None and all(f is not None and f[0] == found[0][0] for f in found[1:]):
        return tuple([flat.view(-1)] for _, flat in found)
    return tuple([source[k] for k in keys] if isinstance(source, Mapping) else list(source) for source in sources)


def zeros_like(tensors: Mapping[str, Tensor]) -> Params:
    """Zeros shaped like ``tensors``, packed in the same layout when ``tensors`` is packed."""
    layout = layout_of(tensors)
    if layout is None:
        return {k: torch.zeros_like(v) for k, v in tensors.items()}
    return layout.views(torch.zeros(layout.shape, dtype=flat_of(tensors).dtype, device=flat_of(tensors).device))


def pack_with_mirrors(params: Mapping[str, Tensor], aux: Mapping[str, Tensor], layout: Layout) -> tuple[Params, Params]:
    """Pack ``params`` and every group of ``aux`` entries ``"<prefix>/<key>"`` that covers all its keys.

    ``<key>`` is the longest tail of the entry's name that is a key of ``params``; ``<prefix>`` may have several
    segments (``optimizer/exp_avg``). So an optimizer state that lost its packing (checkpoint, device move) gets
    it back; other ``aux`` entries are kept as they are.
    """
    packed = pack(params, layout)
    groups: dict[str, dict[str, Tensor]] = {}
    for key, value in aux.items():
        prefix, rest = _mirrored(key, packed)
        if rest in packed and value.shape == packed[rest].shape:
            groups.setdefault(prefix, {})[rest] = value
    new_aux = dict(aux)
    for prefix, group in groups.items():
        if len(group) == len(packed) and len({(v.dtype, v.device) for v in group.values()}) == 1:
            new_aux.update({f"{prefix}/{k}": v for k, v in pack(group, layout).items()})
    return packed, new_aux


def _mirrored(key: str, params: Mapping[str, Tensor]) -> tuple[str, str]:
    """``(prefix, rest)`` of ``key = "<prefix>/<rest>"``, ``rest`` its longest tail in ``params``; or ``("", "")``."""
    for i, c in enumerate(key):
        if c == "/" and key[i + 1 :] in params:
            return key[:i], key[i + 1 :]
    return "", ""
