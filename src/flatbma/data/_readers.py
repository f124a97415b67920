"""Low-level readers for the on-disk formats of the built-in datasets: idx (MNIST), pickle (CIFAR) and ``.npy``.

Every size is checked against the file, so a truncated download is reported as such, not as a reshape error. An
arbitrary pickle is arbitrary code, so :func:`load_data_pickle` admits only the globals that rebuild plain arrays.
"""

from __future__ import annotations

import gzip
import io
import math
import os
import pickle
import re
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

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


def load_data_pickle(path: Path, *, compressed: bool = False, source: str, max_bytes: int = 1 << 30) -> Any:
    """Load a pickle that may contain only dicts, lists, bytes, str, numbers and numpy arrays.

    ``source`` (where a good copy of the file comes from) is appended to error messages; ``max_bytes`` bounds the
    (decompressed) pickle, so a gzip bomb is refused after reading ``max_bytes + 1`` bytes.

    Raises:
        FlatbmaError: The file is missing, truncated, too large, not a pickle, or names a disallowed global.
    """
    try:
        with gzip.open(path, "rb") if compressed else path.open("rb") as f:
            raw = f.read(max_bytes + 1)
    except FileNotFoundError:
        raise FlatbmaError(f"{path} does not exist. {source}") from None
    except (OSError, EOFError, zlib.error) as exc:
        raise FlatbmaError(f"{path} could not be read or decompressed ({exc}). {source}") from None
    if len(raw) > max_bytes:
        raise FlatbmaError(f"{path} holds more than {max_bytes} bytes{' decompressed' if compressed else ''}. {source}")
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
    """Read an idx file (optionally ``.gz``) into a ``uint8`` array of ``ndim`` dimensions, shaped as its header says.

    The header is ``0, 0, type, ndim`` and ``ndim`` big-endian ``uint32`` sizes (magic ``0x00000803`` for images,
    ``0x00000801`` for labels). The declared data size ``∏ sizes`` (Python integers: no overflow) is compared with
    the file before the data is read — its length, or for ``.gz`` at most one byte more than declared
    decompressed — so a damaged header never allocates what it declares. ``ndim`` is 3 for images, 1 for labels;
    ``source`` (where a good copy of the file comes from) is appended to error messages.

    Raises:
        FlatbmaError: Wrong magic number, element type or rank, or a size mismatch (e.g. a truncated download).
    """
    compressed = path.suffix == ".gz"
    try:
        with gzip.open(path, "rb") if compressed else path.open("rb") as f:
            return _read_idx(f, path, ndim, source, compressed)
    except (OSError, EOFError, zlib.error) as exc:
        raise FlatbmaError(f"{path} could not be read or decompressed ({exc}). {source}") from None


_CHUNK = 1 << 24


def _read_at_most(f: BinaryIO, limit: int) -> bytearray:
    """Up to ``limit`` bytes of ``f``, read in chunks so that only what the file holds is allocated."""
    data = bytearray()
    while len(data) < limit:
        chunk = f.read(min(_CHUNK, limit - len(data)))
        if not chunk:
            break
        data += chunk
    return data


def _read_idx(f: BinaryIO, path: Path, ndim: int, source: str, compressed: bool) -> np.ndarray:
    expected_magic = 0x800 + ndim
    head = f.read(4)
    if len(head) < 4:
        raise FlatbmaError(f"{path} is {len(head)} bytes long, too short for an idx header. {source}")
    zero0, zero1, type_code, file_ndim = head
    magic = int.from_bytes(head, "big")
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
    sizes = f.read(4 * ndim)
    if len(sizes) < 4 * ndim:
        raise FlatbmaError(f"{path} is truncated inside its header ({4 + len(sizes)} bytes). {source}")
    shape = tuple(int.from_bytes(sizes[4 * i : 4 * i + 4], "big") for i in range(ndim))
    expected = math.prod(shape)  # Python integers: exact, never wraps around
    if compressed:
        data = _read_at_most(f, expected + 1)
        found = len(data)
    else:
        found = os.fstat(f.fileno()).st_size - 4 - 4 * ndim
        data = _read_at_most(f, expected + 1) if found == expected else bytearray()
        found = len(data) if found == expected else found  # the file may change while it is read
    if found != expected:
        if found < expected:
            what, holds = "truncated", f"holds {found} bytes"
        else:
            what = "longer than its header says"
            holds = "holds more than that" if compressed else f"holds {found} bytes"
        raise FlatbmaError(
            f"{path} is {what}: its header declares shape {shape} ({expected} bytes of data) but the file "
            f"{holds} after the header. Download it again. {source}"
        )
    try:
        return np.frombuffer(data, dtype=np.uint8).reshape(shape)
    except ValueError:  # no data, but sizes numpy cannot index (e.g. (0, 2**32 - 1, 2**32 - 1))
        raise FlatbmaError(f"{path} declares the impossible shape {shape} in its header. {source}") from None


# ---------------------------------------------------------------------------------------------------
# .npy (NumPy's array format)
# ---------------------------------------------------------------------------------------------------

_NUMERIC_KINDS = "biuf"


_NPY_HEADER_READERS = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
_NPY_HEADER_ERRORS = (ValueError, TypeError, KeyError, IndexError, OverflowError, RecursionError)


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _npy_header(f: BinaryIO, path: Path, source: str) -> tuple[tuple[int, ...], np.dtype]:
    """``(shape, dtype)`` from the header of the ``.npy`` file open as ``f``, which is left after the header."""
    try:
        version = np.lib.format.read_magic(f)
        reader = _NPY_HEADER_READERS.get(version)
        shape, _, dtype = reader(f) if reader is not None else ((), False, None)
    except _NPY_HEADER_ERRORS as exc:
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        text = _ADDRESS.sub("", text)  # numpy quotes the parsed node: "<ast.BinOp object at 0x7f...>"
        raise FlatbmaError(f"cannot read {path}: not a valid .npy file ({_short(text)}). {source}") from None
    if reader is None:
        raise FlatbmaError(
            f"cannot read {path}: a .npy file of format version {version[0]}.{version[1]}; flatbma reads "
            f"versions 1.0 and 2.0 (plain numeric arrays). {source}"
        )
    return shape, dtype


def _short(value: object, limit: int = 80) -> str:
    """``str(value)``, cut to ``limit`` characters (shapes and texts read from a damaged header)."""
    text = str(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def read_npy(path: Path, *, source: str) -> np.ndarray:
    """Memory-map (read-only) a ``.npy`` file of a plain numeric array, after checking its header against its size.

    The header (version 1.0 or 2.0) is read with ``numpy.lib.format``. The array is accepted only with a plain
    boolean, integer or floating-point dtype (no object arrays, records or sub-arrays), sizes ``>= 0`` and
    ``∏ shape × itemsize`` equal to the bytes after the header; only then is it mapped (``mmap_mode="r"``).
    ``source`` (where a good copy of the file comes from) is appended to error messages.

    Raises:
        FlatbmaError: Missing or unreadable, not ``.npy``, unsupported version or dtype, or a size mismatch.
    """
    try:
        with path.open("rb") as f:
            header = _npy_header(f, path, source)
            header_end, size = f.tell(), os.fstat(f.fileno()).st_size
    except FileNotFoundError:
        raise FlatbmaError(f"{path} does not exist. {source}") from None
    except OSError as exc:
        raise FlatbmaError(f"cannot read {path} ({exc.strerror or exc}). {source}") from None
    shape, dtype = header
    if dtype.kind not in _NUMERIC_KINDS or dtype.fields is not None or dtype.subdtype is not None:
        raise FlatbmaError(
            f"cannot read {path}: it holds an array of dtype {_short(dtype, 60)}; only plain boolean, integer and "
            f"floating-point arrays are read (object arrays would need pickle, which can run code). {source}"
        )
    if any(d < 0 for d in shape):
        raise FlatbmaError(f"{path} declares the negative shape {_short(shape)} in its header. {source}")
    expected = math.prod(shape) * dtype.itemsize  # Python integers: exact, never wraps around
    found = size - header_end
    if found != expected:
        what = "truncated" if found < expected else "longer than its header says"
        raise FlatbmaError(
            f"{path} is {what}: its header declares {dtype} {_short(shape)} ({expected} bytes of data) but the file "
            f"holds {found} bytes after the header. Download it again. {source}"
        )
    try:
        return np.load(path, allow_pickle=False, mmap_mode="r")
    except (ValueError, OSError, EOFError) as exc:
        raise FlatbmaError(f"cannot read {path} as a .npy array ({exc}). {source}") from None
