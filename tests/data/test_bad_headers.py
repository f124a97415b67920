"""Damaged headers at the data edge (issue #13): image, idx, CIFAR-batch and .npy files end in one FlatbmaError.

Each reader checks what a header declares against the file before it allocates anything: the sizes are
multiplied with Python integers (three ``uint32`` idx sizes overflow 64 bits), image pixel counts are
held to PIL's decompression-bomb limit, and object arrays are refused. The property tests overwrite
header bytes at random: the loader returns a valid dataset or raises :class:`FlatbmaError`, nothing else.
"""

from __future__ import annotations

import gzip
import io
import pickle
import struct
import zlib
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from flatbma.data import load_cifar10, load_idx, load_image_folder
from flatbma.data.cifar_c import load_cifar_c
from flatbma.errors import FlatbmaError

# ---------------------------------------------------------------------------------------------------
# writers


def png_bytes(size: tuple[int, int] = (4, 4), mode: str = "L") -> bytes:
    """A valid PNG of random pixels."""
    pixels = np.random.default_rng(0).integers(0, 255, (size[1], size[0], *((3,) if mode == "RGB" else ())))
    out = io.BytesIO()
    Image.fromarray(pixels.astype(np.uint8), mode).save(out, format="PNG")
    return out.getvalue()


def with_png_size(data: bytes, width: int, height: int) -> bytes:
    """``data`` (a PNG) with the width and height of its IHDR chunk replaced, CRC recomputed: a valid header."""
    assert data[12:16] == b"IHDR"
    ihdr = b"IHDR" + struct.pack(">II", width, height) + data[24:29]
    return data[:12] + ihdr + struct.pack(">I", zlib.crc32(ihdr)) + data[33:]


def image_folder(root: Path, train: bytes, test: bytes | None = None, suffix: str = ".png") -> Path:
    """``root/{train,test}/a/0<suffix>`` holding ``train`` and ``test`` (default: a good PNG)."""
    for split, data in (("train", train), ("test", png_bytes() if test is None else test)):
        folder = root / split / "a"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"0{suffix}").write_bytes(data)
    return root


def idx_bytes(shape: tuple[int, ...], data: bytes, type_code: int = 0x08) -> bytes:
    return bytes([0, 0, type_code, len(shape)]) + b"".join(struct.pack(">I", d) for d in shape) + data


def idx_dir(root: Path, n_train: int = 8, n_test: int = 4, size: int = 3) -> Path:
    """An MNIST-format directory of random ``size x size`` images, labels ``i % 2``."""
    rng = np.random.default_rng(0)
    root.mkdir(parents=True, exist_ok=True)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        images = rng.integers(0, 255, (n, size, size)).astype(np.uint8)
        (root / f"{prefix}-images-idx3-ubyte").write_bytes(idx_bytes(images.shape, images.tobytes()))
        labels = (np.arange(n) % 2).astype(np.uint8)
        (root / f"{prefix}-labels-idx1-ubyte").write_bytes(idx_bytes(labels.shape, labels.tobytes()))
    return root


# ---------------------------------------------------------------------------------------------------
# images


@pytest.mark.parametrize(
    ("width", "height"),
    [(10_000, 10_000), (30_000, 30_000)],  # PIL warns above MAX_IMAGE_PIXELS (~89.5 M) and raises above twice that
    ids=["over-the-limit", "over-twice-the-limit"],
)
def test_a_decompression_bomb_is_refused_from_its_header(tmp_path: Path, width: int, height: int) -> None:
    """A 10⁸-pixel PNG header (what PIL only warned about) is refused like a 9·10⁸ one, before decoding."""
    bomb = with_png_size(png_bytes(), width, height)
    root = image_folder(tmp_path / "f", bomb)
    with pytest.raises(FlatbmaError) as info:
        load_image_folder(root)
    message = str(info.value)
    assert "decompression bomb" in message and "train/a/0.png" in message, message
    assert f"{width * height:,} pixels" in message and f"{Image.MAX_IMAGE_PIXELS:,}" in message, message
    assert "remove the file" in message


def test_the_bomb_limit_is_pil_s_own_setting(tmp_path: Path) -> None:
    """The limit is ``PIL.Image.MAX_IMAGE_PIXELS``: lowered, a 20x20 image is refused, with that limit named."""
    root = image_folder(tmp_path / "f", png_bytes((20, 20)), png_bytes((20, 20)))
    assert load_image_folder(root).train.image_shape == (1, 20, 20)
    with mock.patch.object(Image, "MAX_IMAGE_PIXELS", 300), pytest.raises(FlatbmaError, match=r"400 pixels.* 300 "):
        load_image_folder(root)


@pytest.mark.parametrize(
    ("damage", "suffix"),
    [
        (lambda good: good[:60], ".png"),  # truncated inside the pixel data
        (lambda good: good[:20], ".png"),  # truncated inside the header
        (lambda good: b"\x89PNG\r\n\x1a\n" + bytes(40), ".png"),  # a PNG signature, then zeros
        (lambda good: good[:33] + b"\x00\x00\x00\x05IDAT" + b"xxxxx" + b"\x00\x00\x00\x00" + good[33:], ".png"),
        (lambda good: b"BM" + bytes(60), ".bmp"),
        (lambda good: b"\xff\xd8\xff\xe0" + bytes(30), ".jpg"),
        (lambda good: b"", ".png"),
    ],
    ids=["truncated-data", "truncated-header", "zero-chunks", "bad-crc-chunk", "bmp-zeros", "jpeg-zeros", "empty"],
)
def test_damaged_images_name_the_file(tmp_path: Path, damage, suffix: str) -> None:
    good = png_bytes((8, 8))
    root = image_folder(tmp_path / "f", damage(good), suffix=suffix)
    with pytest.raises(FlatbmaError) as info:
        load_image_folder(root, size=4)
    message = str(info.value)
    assert f"train/a/0{suffix}" in message and "replace or remove it" in message and "\n" not in message, message


IMAGE_FORMATS = {
    ".png": png_bytes((6, 5), "RGB"),
    ".bmp": (lambda b: (Image.fromarray(np.full((5, 6, 3), 7, np.uint8)).save(b, format="BMP"), b.getvalue())[1])(
        io.BytesIO()
    ),
    ".jpg": (lambda b: (Image.fromarray(np.full((5, 6), 7, np.uint8)).save(b, format="JPEG"), b.getvalue())[1])(
        io.BytesIO()
    ),
}


@settings(deadline=None, max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(
    suffix=st.sampled_from(sorted(IMAGE_FORMATS)),
    flips=st.lists(st.tuples(st.integers(0, 63), st.integers(0, 255)), min_size=1, max_size=6),
    cut=st.sampled_from([None, 8, 30, 60, 100]),
)
def test_random_image_header_damage_loads_or_is_one_flatbma_error(
    tmp_path_factory: pytest.TempPathFactory, suffix: str, flips: list[tuple[int, int]], cut: int | None
) -> None:
    """Header bytes of a PNG, BMP or JPEG overwritten (sizes, modes, chunk lengths) and maybe truncated.

    The bomb limit is lowered to 2**20 pixels so that a header declaring a large image is refused (or
    decoded) cheaply; the refusal works the same at PIL's default.
    """
    data = bytearray(IMAGE_FORMATS[suffix])
    for at, value in flips:
        data[at % len(data)] = value
    root = image_folder(tmp_path_factory.mktemp("img"), bytes(data[:cut]), suffix=suffix)
    with mock.patch.object(Image, "MAX_IMAGE_PIXELS", 1 << 20):
        try:
            splits = load_image_folder(root, size=4)
        except FlatbmaError as e:
            assert "\n" not in str(e), str(e)
            return
    assert splits.train.image_shape[1:] == (4, 4) and len(splits.train) == 1


# ---------------------------------------------------------------------------------------------------
# idx


@pytest.mark.parametrize(
    "shape",
    [
        (2**31, 2**31, 4),  # the product is 2**64: as int64 it wraps to 0, the length of an empty file
        (2**32 - 1, 2**32 - 1, 2**32 - 1),
        (65_536, 65_536, 0x1_0001),
    ],
)
def test_idx_sizes_that_overflow_64_bits_are_refused(tmp_path: Path, shape: tuple[int, ...]) -> None:
    root = idx_dir(tmp_path / "i")
    (root / "train-images-idx3-ubyte").write_bytes(idx_bytes(shape, b""))
    with pytest.raises(FlatbmaError) as info:
        load_idx(root)
    message = str(info.value)
    product = shape[0] * shape[1] * shape[2]
    assert "train-images-idx3-ubyte is truncated" in message and f"({product} bytes of data)" in message, message
    assert "holds 0 bytes" in message and "Download it again" in message


def test_an_idx_header_of_no_images_of_impossible_size_is_refused(tmp_path: Path) -> None:
    """Zero images of 2³²−1 × 2³²−1 pixels: no data, which the file holds, but no array numpy can shape."""
    root = idx_dir(tmp_path / "i")
    (root / "train-images-idx3-ubyte").write_bytes(idx_bytes((0, 2**32 - 1, 2**32 - 1), b""))
    with pytest.raises(FlatbmaError, match=r"declares the impossible shape \(0, 4294967295, 4294967295\)"):
        load_idx(root)


def test_an_idx_header_declaring_more_than_the_file_holds_allocates_nothing(tmp_path: Path) -> None:
    """A header declaring 2**40 bytes is refused from the file's length: the data is never read."""
    root = idx_dir(tmp_path / "i")
    (root / "train-images-idx3-ubyte").write_bytes(idx_bytes((2**20, 2**10, 2**10), bytes(100)))
    with mock.patch("flatbma.data._readers._read_at_most", side_effect=AssertionError("read")):
        with pytest.raises(FlatbmaError, match="holds 100 bytes"):
            load_idx(root)


@pytest.mark.parametrize(("extra", "needle"), [(1, "longer than its header says"), (-1, "truncated")])
def test_gzipped_idx_of_the_wrong_length(tmp_path: Path, extra: int, needle: str) -> None:
    root = idx_dir(tmp_path / "i")
    images = root / "train-images-idx3-ubyte"
    data = images.read_bytes()
    images.unlink()
    (root / "train-images-idx3-ubyte.gz").write_bytes(gzip.compress(data + b"x" if extra > 0 else data[:extra]))
    with pytest.raises(FlatbmaError, match=f"idx3-ubyte.gz is {needle}"):
        load_idx(root)
    (root / "train-images-idx3-ubyte.gz").write_bytes(gzip.compress(data))  # the good file, gzipped, loads
    assert len(load_idx(root).train) == 8


IDX_FILES = ["train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"]
SIZES = st.one_of(
    st.integers(0, 12),
    st.integers(0, 2**32 - 1),
    st.integers(0, 32).map(lambda k: min(2**k, 2**32 - 1)),  # products of powers of two wrap int64 around to 0
    st.integers(0, 32).map(lambda k: min(2**k, 2**32 - 1)),
)


@st.composite
def idx_headers(draw: st.DrawFn, ndim: int) -> bytes:
    """Random bytes, or a well-formed idx header (mostly of rank ``ndim``) with random, often huge, sizes."""
    if draw(st.integers(0, 3)) == 0:
        return draw(st.binary(max_size=20))
    type_code = draw(st.sampled_from([0x08, 0x08, 0x08, 0x09, 0x0D, 0x07]))
    rank = draw(st.sampled_from([ndim, ndim, ndim, 0, 2, 4]))
    sizes = draw(st.lists(SIZES, min_size=rank, max_size=rank))
    return bytes([0, 0, type_code, rank]) + b"".join(struct.pack(">I", d) for d in sizes)


@pytest.fixture(scope="module")
def good_idx(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    root = idx_dir(tmp_path_factory.mktemp("good") / "i")
    return {name: (root / name).read_bytes() for name in IDX_FILES}


@settings(deadline=None, max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(
    name=st.sampled_from(IDX_FILES),
    draw=st.data(),
    keep_data=st.booleans(),
    data=st.binary(max_size=80),
    gz=st.booleans(),
)
def test_random_idx_headers_load_or_are_one_flatbma_error(
    good_idx: dict[str, bytes],
    tmp_path_factory: pytest.TempPathFactory,
    name: str,
    draw: st.DataObject,
    keep_data: bool,
    data: bytes,
    gz: bool,
) -> None:
    """One of the four files gets a random header over its own data or random data, maybe gzipped."""
    root = tmp_path_factory.mktemp("idx")
    for file, content in good_idx.items():
        (root / file).write_bytes(content)
    ndim = 3 if "images" in name else 1
    header = draw.draw(idx_headers(ndim))
    body = good_idx[name][4 + 4 * ndim :] if keep_data else data
    content = header + body
    if gz:
        (root / name).unlink()
        (root / f"{name}.gz").write_bytes(gzip.compress(content))
    try:
        splits = load_idx(root)
    except FlatbmaError as e:
        assert "\n" not in str(e)
        return
    # it loaded: then the damaged header described its data exactly
    assert len(splits.train) + len(splits.test) > 0


# ---------------------------------------------------------------------------------------------------
# CIFAR batches


def cifar10_dir(root: Path, labels: object = None, data: object = None) -> Path:
    """A miniature ``cifar-10-batches-py``: 2 images per batch, the first batch's entries replaceable."""
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    for name in names:
        batch = {b"data": rng.integers(0, 255, (2, 3072)).astype(np.uint8), b"labels": [0, 1]}
        if name == "data_batch_1":
            batch.update({k: v for k, v in ((b"data", data), (b"labels", labels)) if v is not None})
        (root / name).write_bytes(pickle.dumps(batch, protocol=2))
    (root / "batches.meta").write_bytes(pickle.dumps({b"label_names": [b"a", b"b"]}, protocol=2))
    return root


def test_cifar_batches_load(tmp_path: Path) -> None:
    splits = load_cifar10(cifar10_dir(tmp_path / "c"))
    assert len(splits.train) == 10 and splits.train.image_shape == (3, 32, 32)


@pytest.mark.parametrize(
    ("labels", "data", "needle"),
    [
        ([[0], 1], None, "labels must be a 1-D sequence of integers"),  # ragged: numpy refuses to build it
        ([0, 1.5], None, "labels must be a 1-D sequence of integers"),
        ([0, 2**70], None, "labels must be a 1-D sequence of integers"),
        (None, np.zeros((2, 3072), np.float64), "'data' must be a uint8 array"),
        (None, np.zeros((2, 3071), np.uint8), "'data' must be a uint8 array"),
    ],
)
def test_wrong_cifar_batch_entries_name_the_file(tmp_path: Path, labels, data, needle: str) -> None:
    root = cifar10_dir(tmp_path / "c", labels=labels, data=data)
    with pytest.raises(FlatbmaError, match=needle) as info:
        load_cifar10(root)
    assert "data_batch_1" in str(info.value) and "cifar-10-python.tar.gz" in str(info.value)


def test_a_cifar_array_whose_header_disagrees_with_its_bytes(tmp_path: Path) -> None:
    """The pickled array's shape (its header) declares 2**40 rows but holds two: refused, nothing allocated."""
    root = cifar10_dir(tmp_path / "c")
    raw = (root / "data_batch_1").read_bytes()
    shape = b"K\x02M\x00\x0c\x86"  # protocol 2: BININT1 2, BININT2 3072, TUPLE2
    huge = b"\x8a\x06" + (2**40).to_bytes(6, "little") + b"M\x00\x0c\x86"  # LONG1 2**40, BININT2 3072, TUPLE2
    assert raw.count(shape) == 1
    (root / "data_batch_1").write_bytes(raw.replace(shape, huge))
    with pytest.raises(FlatbmaError, match="data_batch_1 is not a valid pickle"):
        load_cifar10(root)


# ---------------------------------------------------------------------------------------------------
# .npy (CIFAR-10-C)


def cifar_c_dir(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    np.save(root / "fog.npy", np.zeros((10, 4, 4, 3), np.uint8))
    np.save(root / "labels.npy", np.arange(10) % 2)
    return root


def npy_with_header(shape: str, descr: str = "'|u1'", data: bytes = b"", version: int = 1) -> bytes:
    """A ``.npy`` file with the given header fields (as Python literals) and data bytes."""
    header = f"{{'descr': {descr}, 'fortran_order': False, 'shape': {shape}, }}".encode("latin1")
    header += b" " * (63 - (len(header) + 10) % 64) + b"\n"
    length = struct.pack("<H", len(header)) if version == 1 else struct.pack("<I", len(header))
    return b"\x93NUMPY" + bytes([version, 0]) + length + header + data


def test_the_npy_writer_above_writes_what_numpy_reads(tmp_path: Path) -> None:
    (tmp_path / "x.npy").write_bytes(npy_with_header("(2, 3)", data=bytes(range(6))))
    assert np.load(tmp_path / "x.npy").tolist() == [[0, 1, 2], [3, 4, 5]]


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        (npy_with_header("(2**64, 4, 4, 3)"), "not a valid .npy file"),
        (npy_with_header("(4294967296, 4294967296, 4294967296, 3)"), "is truncated"),
        (npy_with_header("(-10, -4, 4, 3)", data=bytes(480)), "negative shape"),
        (npy_with_header("(10, 4, 4, 3)", data=bytes(479)), "is truncated"),
        (npy_with_header("(10, 4, 4, 3)", data=bytes(481)), "longer than its header says"),
        (npy_with_header("(10, 4, 4, 3)", descr="'|O'", data=bytes(3840)), "dtype object"),
        (npy_with_header("(10, 4, 4, 3)", descr="[('a', '|u1')]", data=bytes(480)), "only plain boolean"),
        (npy_with_header("(10, 4, 4, 3)", descr="'|V1'", data=bytes(480)), "only plain boolean"),
        (npy_with_header("(10, 4, 4, 3)", descr="'<U1'", data=bytes(1920)), "only plain boolean"),
        (npy_with_header("(10, 4, 4, 3)", descr="'nonsense'"), "not a valid .npy file"),
        (npy_with_header("(10, 4, 4, 3)", version=3), "format version 3.0"),
        (b"\x93NUMPY\x01\x00\xff\xff" + b"{" * 100, "not a valid .npy file"),
        (b"\x93NUM", "not a valid .npy file"),
    ],
)
def test_npy_headers_are_checked_before_the_file_is_mapped(tmp_path: Path, content: bytes, needle: str) -> None:
    root = cifar_c_dir(tmp_path / "c")
    (root / "fog.npy").write_bytes(content)
    with pytest.raises(FlatbmaError, match=needle) as info:
        load_cifar_c(root, "fog", 1)
    message = str(info.value)
    assert "fog.npy" in message and "zenodo" in message and "\n" not in message and len(message) < 1000, message


def test_a_good_npy_written_by_hand_loads(tmp_path: Path) -> None:
    root = cifar_c_dir(tmp_path / "c")
    (root / "fog.npy").write_bytes(npy_with_header("(10, 4, 4, 3)", data=bytes(range(240)) * 2))
    block = load_cifar_c(root, "fog", 2)
    assert block.images.shape == (2, 3, 4, 4) and int(block.images[0, 0, 0, 0]) == 96  # row 2 starts at byte 96
