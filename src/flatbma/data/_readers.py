"""Low-level readers for the on-disk formats of the built-in datasets.

Two formats need care:

* **idx** (MNIST, Fashion-MNIST): a big-endian header (magic number, then one ``uint32`` per dimension)
  followed by the raw array. The header is parsed here with numpy and every size is checked, so a
  truncated download is reported as such instead of surfacing as a reshape error.
* **pickle** (CIFAR-10/100, Animal-MNIST): ``pickle.load`` runs whatever callables the file names, so
  an arbitrary pickle is arbitrary code. :func:`load_data_pickle` uses an unpickler whose
  ``find_class`` admits only the handful of numpy globals needed to rebuild a plain ``ndarray`` (and a
  latin-1-only ``_codecs.encode``, which Python 3 uses for ``bytes`` in protocol-2 pickles); any other
  global, such as ``os.system``, is refused before it can be called.
"""

from __future__ import annotations

import gzip
import io
import pickle
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from flatbma.errors import FlatbmaError

# ---------------------------------------------------------------------------------------------------
# Restricted unpickling
# ---------------------------------------------------------------------------------------------------


def _numpy_reconstruct() -> Callable[..., Any]:
    """Return numpy's ``_reconstruct`` (``numpy._core`` since numpy 2, ``numpy.core`` before)."""
    try:
        from numpy._core.multiarray import _reconstruct  # type: ignore[attr-defined]
    except ImportError:  # numpy < 2 without the ``numpy._core`` alias
        from numpy.core.multiarray import _reconstruct  # type: ignore[attr-defined,no-redef]
    return _reconstruct


def _latin1_encode(text: object, encoding: object = "utf-8", errors: object = "strict") -> bytes:
    """``_codecs.encode`` restricted to ``(str, "latin1")``: how protocol-2 pickles store ``bytes``."""
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1") or errors != "strict":
        raise pickle.UnpicklingError("refusing _codecs.encode with arguments other than (str, 'latin1')")
    return text.encode("latin1")


_ALLOWED_GLOBALS: dict[tuple[str, str], Callable[[], Any]] = {
    ("numpy.core.multiarray", "_reconstruct"): _numpy_reconstruct,
    ("numpy._core.multiarray", "_reconstruct"): _numpy_reconstruct,
    ("numpy", "ndarray"): lambda: np.ndarray,
    ("numpy", "dtype"): lambda: np.dtype,
    ("_codecs", "encode"): lambda: _latin1_encode,
}


class _DataUnpickler(pickle.Unpickler):
    """Unpickler that rebuilds only built-in containers/scalars and plain numpy arrays."""

    def find_class(self, module: str, name: str) -> Any:
        """Return the allowed global ``module.name`` or refuse it."""
        factory = _ALLOWED_GLOBALS.get((module, name))
        if factory is None:
            raise pickle.UnpicklingError(f"refusing to load the global '{module}.{name}'")
        return factory()


def load_data_pickle(path: Path, *, compressed: bool = False, source: str) -> Any:
    """Load a pickle that may contain only dicts, lists, bytes, str, numbers and numpy arrays.

    Args:
        path: The pickle file.
        compressed: Whether the file is gzip-compressed.
        source: Where a good copy of the file comes from; appended to error messages.

    Returns:
        The unpickled object.

    Raises:
        FlatbmaError: The file is missing, truncated, not a pickle, or names a callable outside the
            allow-list (which a genuine data file never does).
    """
    try:
        raw = gzip.decompress(path.read_bytes()) if compressed else path.read_bytes()
    except FileNotFoundError:
        raise FlatbmaError(f"{path} does not exist. {source}") from None
    except (OSError, EOFError, zlib.error) as exc:
        raise FlatbmaError(f"{path} could not be read or decompressed ({exc}). {source}") from None
    try:
        return _DataUnpickler(io.BytesIO(raw), encoding="bytes").load()
    except pickle.UnpicklingError as exc:
        raise FlatbmaError(
            f"{path} is not a plain data pickle ({exc}). Only dicts, lists, bytes, strings, numbers and "
            f"numpy arrays are accepted, so that loading a file cannot run code; the file is corrupt or "
            f"not the expected one. {source}"
        ) from None
    except (EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError) as exc:
        raise FlatbmaError(f"{path} is not a valid pickle ({type(exc).__name__}: {exc}). {source}") from None


# ---------------------------------------------------------------------------------------------------
# idx (MNIST format)
# ---------------------------------------------------------------------------------------------------

# Type code in the third byte of the magic number -> big-endian numpy dtype.
_IDX_DTYPES: dict[int, str] = {
    0x08: ">u1",
    0x09: ">i1",
    0x0B: ">i2",
    0x0C: ">i4",
    0x0D: ">f4",
    0x0E: ">f8",
}


def read_idx(path: Path, *, ndim: int, source: str) -> np.ndarray:
    """Read an idx file (optionally ``.gz``) holding an unsigned-byte array with ``ndim`` dimensions.

    The header is four bytes ``0, 0, type, ndim`` followed by ``ndim`` big-endian ``uint32`` sizes;
    images files have magic ``0x00000803`` (2051) and label files ``0x00000801`` (2049).

    Args:
        path: The file; a name ending in ``.gz`` is decompressed first.
        ndim: Expected number of dimensions (3 for images, 1 for labels).
        source: Where a good copy of the file comes from; appended to error messages.

    Returns:
        A ``uint8`` array of the shape given in the header.

    Raises:
        FlatbmaError: Wrong magic number, unexpected element type or rank, or a size mismatch
            (for example a truncated download).
    """
    try:
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    except (OSError, EOFError, zlib.error) as exc:
        raise FlatbmaError(f"{path} could not be read or decompressed ({exc}). {source}") from None
    expected_magic = 0x800 + ndim
    if len(raw) < 4:
        raise FlatbmaError(f"{path} is {len(raw)} bytes long, too short for an idx header. {source}")
    zero0, zero1, type_code, file_ndim = raw[0], raw[1], raw[2], raw[3]
    magic = int.from_bytes(raw[:4], "big")
    if zero0 != 0 or zero1 != 0 or type_code not in _IDX_DTYPES:
        raise FlatbmaError(
            f"{path} is not an idx file: magic number 0x{magic:08X}, expected 0x{expected_magic:08X} "
            f"({expected_magic}). {source}"
        )
    if type_code != 0x08 or file_ndim != ndim:
        raise FlatbmaError(
            f"{path} has magic number 0x{magic:08X} ({np.dtype(_IDX_DTYPES[type_code]).name}, {file_ndim} "
            f"dimensions); expected 0x{expected_magic:08X} (uint8, {ndim} dimensions). Check that images "
            f"and labels files are not swapped. {source}"
        )
    header_len = 4 + 4 * ndim
    if len(raw) < header_len:
        raise FlatbmaError(f"{path} is truncated inside its header ({len(raw)} bytes). {source}")
    shape = tuple(int(d) for d in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
    expected = int(np.prod(shape, dtype=np.int64))
    found = len(raw) - header_len
    if found != expected:
        what = "truncated" if found < expected else "longer than its header says"
        raise FlatbmaError(
            f"{path} is {what}: its header declares shape {shape} ({expected} bytes of data) but the file "
            f"holds {found} bytes after the header. Download it again. {source}"
        )
    return np.frombuffer(raw, dtype=np.uint8, offset=header_len).reshape(shape)
