"""Bad data on disk, through the whole ``flatbma train`` path (``data.root``): one actionable error line.

Each case writes an image-folder or an idx (MNIST-format) directory under ``tmp_path`` and trains on it
with the CLI, so the loader, the dataset checks, the k-shot draw and the model build are all exercised.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from flatbma.data import ArrayDataset, load_image_folder
from flatbma.errors import FlatbmaError
from flatbma.experiment.cli import main
from tests.data.test_bad_headers import with_png_size
from tests.helpers import DONE

BASE = {
    "seed": 0,
    "method": {"name": "sgd"},
    "model": {"name": "mlp", "width": 8},
    "optim": {"lr": 0.05},
    "train": {"epochs": 1, "progress": False},
    "eval": {"num_samples": 1, "hessian_examples": 16, "n_bins": 4},  # 12 test images: a few calibration bins
}


def train(tmp_path: Path, **data: Any) -> tuple[int, str]:
    """``flatbma train`` on ``data`` (the config's data section); returns (exit code, stderr)."""
    config = tmp_path / f"config{next(_COUNT)}.yaml"
    config.write_text(yaml.safe_dump({**BASE, "data": data, "output_dir": str(tmp_path / "run")}))
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["train", "--config", str(config), "--force"])
    return code, err.getvalue()


_COUNT = itertools.count()


def trains(tmp_path: Path, **data: Any) -> None:
    """Train on ``data``, expect success (stderr may hold progress lines, but no error).

    A one-epoch run on a handful of images may end at chance and be flagged by a health rule (exit 3, a
    warning line): the data were read, which is what these cases test.
    """
    code, err = train(tmp_path, **data)
    assert code in DONE and "error" not in err, err


def one_error(tmp_path: Path, *needles: str, **data: Any) -> str:
    """Train on ``data``, expect exit 2 with one ``flatbma: error:`` line holding every needle."""
    code, err = train(tmp_path, **data)
    lines = err.splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("flatbma: error: "), err
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


# ---------------------------------------------------------------------------------------------------
# writers


def image_folder(root: Path, layout: dict[str, dict[str, list[tuple[int, int]]]], dtype: Any = np.uint8) -> Path:
    """``root/<split>/<class>/<i>.png`` with random pixels, one (height, width) per image."""
    rng = np.random.default_rng(0)
    for split, classes in layout.items():
        for name, sizes in classes.items():
            folder = root / split / name
            folder.mkdir(parents=True, exist_ok=True)
            for i, (h, w) in enumerate(sizes):
                Image.fromarray(rng.integers(0, 255, (h, w)).astype(dtype)).save(folder / f"{i}.png")
    return root


def idx_file(path: Path, array: np.ndarray, type_code: int = 0x08) -> None:
    """An idx file: ``0 0 type ndim``, big-endian uint32 sizes, then the big-endian data."""
    dtype = {0x08: ">u1", 0x0D: ">f4"}[type_code]
    header = bytes([0, 0, type_code, array.ndim]) + b"".join(struct.pack(">I", d) for d in array.shape)
    path.write_bytes(header + np.asarray(array).astype(dtype).tobytes())


def idx_dir(
    root: Path,
    train_labels: Any,
    test_labels: Any,
    *,
    train_size: int = 6,
    test_size: int | None = None,
    train_images: np.ndarray | None = None,
    type_code: int = 0x08,
) -> Path:
    """An MNIST-format directory with random images for the given labels."""
    rng = np.random.default_rng(0)
    root.mkdir(parents=True, exist_ok=True)
    train_labels, test_labels = np.asarray(train_labels), np.asarray(test_labels)
    size = test_size or train_size
    if train_images is None:
        train_images = rng.integers(0, 255, (len(train_labels), train_size, train_size))
    idx_file(root / "train-images-idx3-ubyte", train_images, type_code)
    idx_file(root / "train-labels-idx1-ubyte", train_labels)
    idx_file(root / "t10k-images-idx3-ubyte", rng.integers(0, 255, (len(test_labels), size, size)))
    idx_file(root / "t10k-labels-idx1-ubyte", test_labels)
    return root


LABELS = np.arange(40) % 4  # four balanced classes
TEST_LABELS = np.arange(12) % 4
SQUARE = [(6, 6)] * 6


# ---------------------------------------------------------------------------------------------------
# the good cases train (so every failure below comes from the damage)


def test_good_image_folder_and_idx_train(tmp_path: Path) -> None:
    folder = image_folder(tmp_path / "f", {"train": {"a": SQUARE, "b": SQUARE}, "test": {"a": SQUARE, "b": SQUARE}})
    trains(tmp_path, name="image-folder", root=str(folder), k_shot=3)
    idx = idx_dir(tmp_path / "i", LABELS, TEST_LABELS)
    trains(tmp_path, name="idx", root=str(idx), k_shot=5)


# ---------------------------------------------------------------------------------------------------
# NaN pixels


def test_nan_pixels_in_an_idx_file_are_refused(tmp_path: Path) -> None:
    """idx image files must be uint8; a float file (here full of NaN) is named with its type."""
    images = np.full((40, 6, 6), np.nan, dtype=np.float32)
    root = idx_dir(tmp_path / "i", LABELS, TEST_LABELS, train_images=images, type_code=0x0D)
    one_error(tmp_path, "train-images-idx3-ubyte", "float32", "uint8", name="idx", root=str(root))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nan_pixels_in_memory_are_refused(bad: float) -> None:
    images = torch.rand(5, 1, 4, 4)
    images[3, 0, 1, 2] = bad
    with pytest.raises(FlatbmaError, match=r"NaN or infinite pixels in 1 image\(s\) \(first: index 3\)"):
        ArrayDataset(images, torch.zeros(5, dtype=torch.long), ["a"])


# ---------------------------------------------------------------------------------------------------
# wrong image shapes


def test_images_of_several_sizes_need_data_image_size(tmp_path: Path) -> None:
    layout = {"train": {"a": SQUARE, "b": [*SQUARE[:-1], (7, 5)]}, "test": {"a": SQUARE, "b": SQUARE}}
    root = image_folder(tmp_path / "f", layout)
    one_error(tmp_path, "differ in size", "b/5.png is 5x7", "data.image_size", name="image-folder", root=str(root))
    # ... and the fix the message names works: the loader resizes while reading
    trains(tmp_path, name="image-folder", root=str(root), image_size=6)


def test_train_and_test_idx_images_of_different_sizes(tmp_path: Path) -> None:
    root = idx_dir(tmp_path / "i", LABELS, TEST_LABELS, train_size=6, test_size=7)
    one_error(tmp_path, "train images are (1, 6, 6) but test images are (1, 7, 7)", name="idx", root=str(root))


def test_idx_images_of_the_wrong_rank(tmp_path: Path) -> None:
    root = idx_dir(tmp_path / "i", LABELS, TEST_LABELS)
    idx_file(root / "train-images-idx3-ubyte", np.zeros((40, 36), dtype=np.uint8))  # flattened images
    one_error(tmp_path, "2 dimensions", "expected", name="idx", root=str(root))


def test_idx_images_without_pixels(tmp_path: Path) -> None:
    root = idx_dir(tmp_path / "i", LABELS, TEST_LABELS, train_size=0)
    one_error(tmp_path, "at least one channel and pixel", name="idx", root=str(root))


def test_grey_images_with_imagenet_normalization_name_data_to_rgb(tmp_path: Path) -> None:
    root = idx_dir(tmp_path / "i", LABELS, TEST_LABELS)
    one_error(tmp_path, "3 channel statistics", "data.to_rgb", name="idx", root=str(root), normalize="imagenet")


# ---------------------------------------------------------------------------------------------------
# labels out of range, label/image count mismatch


def test_labels_beyond_the_class_list_name_the_file(tmp_path: Path) -> None:
    """Fashion-MNIST has 10 classes; a label file holding 12 is not its file."""
    root = idx_dir(tmp_path / "i", np.arange(40) % 13, TEST_LABELS)
    one_error(tmp_path, "train-labels-idx1-ubyte", "holds label 12", "10 classes", name="fashion-mnist", root=str(root))


def test_more_labels_than_images(tmp_path: Path) -> None:
    root = idx_dir(tmp_path / "i", LABELS, TEST_LABELS)
    idx_file(root / "train-labels-idx1-ubyte", np.arange(41) % 4)
    one_error(tmp_path, "40 images", "41 labels", name="idx", root=str(root))


# ---------------------------------------------------------------------------------------------------
# empty classes and splits


@pytest.mark.parametrize("k_shot", [3, None])
def test_a_class_only_in_the_test_split_is_refused(tmp_path: Path, k_shot: int | None) -> None:
    """The empty class sorts last; with or without a k-shot draw it is refused when the data is read (#23)."""
    layout = {"train": {"a": SQUARE, "b": SQUARE}, "test": {"a": SQUARE, "b": SQUARE, "zebra": SQUARE}}
    root = image_folder(tmp_path / "f", layout)
    one_error(tmp_path, "no training example", "'zebra'", name="image-folder", root=str(root), k_shot=k_shot)


def _empty_folder(class_dir: Path) -> None:
    class_dir.mkdir(parents=True)


def _hidden_files_only(class_dir: Path) -> None:
    class_dir.mkdir(parents=True)
    Image.fromarray(np.zeros((6, 6), np.uint8)).save(class_dir / ".hidden.png")
    (class_dir / ".DS_Store").write_bytes(b"\0")


def _a_file_in_place_of_the_folder(class_dir: Path) -> None:
    class_dir.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.zeros((6, 6), np.uint8)).save(class_dir.with_suffix(".png"))
    class_dir.with_suffix(".png").rename(class_dir)


@pytest.mark.parametrize("make", [_empty_folder, _hidden_files_only, _a_file_in_place_of_the_folder])
def test_a_training_class_folder_without_images_is_refused(tmp_path: Path, make: Any) -> None:
    """``train/c`` empty, holding only hidden files, or a file (class ``c`` has test images): refused (#23)."""
    root = image_folder(tmp_path / "f", {"train": {"a": SQUARE, "b": SQUARE}, "test": {n: SQUARE for n in "abc"}})
    make(root / "train" / "c")
    one_error(tmp_path, "1 of its 3 classes has no training example", "'c'", name="image-folder", root=str(root))


def test_an_idx_class_missing_from_training_is_refused(tmp_path: Path) -> None:
    root = idx_dir(tmp_path / "i", np.arange(40) % 3, TEST_LABELS)  # class 3 only in the test labels
    one_error(tmp_path, "no training example", "'3'", name="idx", root=str(root), k_shot=2)


def test_one_class_is_refused(tmp_path: Path) -> None:
    """A one-class data set trained to accuracy 1.0 (#23): a classifier needs two classes."""
    root = idx_dir(tmp_path / "i", np.zeros(40, np.int64), np.zeros(12, np.int64))
    one_error(tmp_path, "has 1 class ('0')", "at least two", name="idx", root=str(root))
    folder = image_folder(tmp_path / "f", {"train": {"a": SQUARE}, "test": {"a": SQUARE}})
    one_error(tmp_path, "has 1 class ('a')", name="image-folder", root=str(folder))


def test_an_unreadable_class_folder_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A class folder without read permission (simulated: tests may run as root, who ignores it) (#23)."""
    root = image_folder(tmp_path / "f", {"train": {"a": SQUARE, "b": SQUARE}, "test": {"a": SQUARE, "b": SQUARE}})
    locked, real = root / "train" / "b", Path.iterdir

    def iterdir(self: Path) -> Any:
        if self == locked:
            raise PermissionError(13, "Permission denied", str(self))
        return real(self)

    monkeypatch.setattr(Path, "iterdir", iterdir)
    one_error(tmp_path, f"cannot list {locked} (Permission denied)", name="image-folder", root=str(root))


def test_16_bit_grey_pngs_are_scaled_not_clipped(tmp_path: Path) -> None:
    """PNG's 16-bit grey (mode ``I;16``) was clipped to 255 on every pixel (#23): scaled by 255/65535 instead."""
    root = tmp_path / "f"
    values = np.array([[0, 257, 32896], [40000, 65280, 65535]], dtype=np.uint16)
    for split in ("train", "test"):
        for name in ("a", "b"):
            (root / split / name).mkdir(parents=True)
            image = Image.fromarray(values)
            assert image.mode == "I;16"
            image.save(root / split / name / "0.png")
    loaded = load_image_folder(root).train.images[0, 0]
    assert loaded.tolist() == [[0, 1, 128], [156, 254, 255]]


def test_a_class_smaller_than_k(tmp_path: Path) -> None:
    root = idx_dir(tmp_path / "i", [*([0] * 10), *([1] * 10), 2, 2], TEST_LABELS[:6] % 3)
    one_error(tmp_path, "k=5", "only 2 examples", "k <= 2", name="idx", root=str(root), k_shot=5)


@pytest.mark.parametrize("split", ["train", "test"])
def test_an_empty_split(tmp_path: Path, split: str) -> None:
    labels = {"train": LABELS, "test": TEST_LABELS}
    labels[split] = np.zeros(0, dtype=np.int64)
    root = idx_dir(tmp_path / "i", labels["train"], labels["test"])
    one_error(tmp_path, f"the {split} split has no examples", name="idx", root=str(root))


def test_a_test_limit_that_keeps_nothing(tmp_path: Path) -> None:
    root = idx_dir(tmp_path / "i", LABELS, TEST_LABELS)
    one_error(tmp_path, "data.test_limit=1", ">= 4", name="idx", root=str(root), test_limit=1)


# ---------------------------------------------------------------------------------------------------
# missing and damaged files


def test_folder_problems(tmp_path: Path) -> None:
    one_error(tmp_path, "does not exist", name="image-folder", root=str(tmp_path / "nowhere"))
    one_error(tmp_path, "cannot expand '~'", name="image-folder", root="~no_such_user_xyz/data")
    one_error(tmp_path, "needs root", name="image-folder")
    only_train = image_folder(tmp_path / "only_train", {"train": {"a": SQUARE}})
    one_error(tmp_path, "missing", "test", name="image-folder", root=str(only_train))
    root = image_folder(tmp_path / "f", {"train": {"a": SQUARE, "b": SQUARE}, "test": {"a": SQUARE, "b": SQUARE}})
    png = root / "train" / "b" / "2.png"
    png.write_bytes(png.read_bytes()[:60])
    one_error(tmp_path, "cannot read image", "2.png", name="image-folder", root=str(root))


def test_a_decompression_bomb_png_is_one_error_line(tmp_path: Path) -> None:
    """A PNG of a few dozen pixels whose header declares 10⁸ (PIL only warned about it) ends in one line (#13)."""
    root = image_folder(tmp_path / "f", {"train": {"a": SQUARE, "b": SQUARE}, "test": {"a": SQUARE, "b": SQUARE}})
    png = root / "test" / "b" / "1.png"
    png.write_bytes(with_png_size(png.read_bytes(), 10_000, 10_000))
    one_error(
        tmp_path,
        "b/1.png",
        "decompression bomb",
        "100,000,000 pixels",
        f"{Image.MAX_IMAGE_PIXELS:,}",
        name="image-folder",
        root=str(root),
        image_size=6,
    )
    assert not (tmp_path / "run" / "checkpoint.safetensors").exists()


def test_idx_sizes_overflowing_64_bits_are_one_error_line(tmp_path: Path) -> None:
    """(2³¹, 2³¹, 4) images declare 2⁶⁴ bytes, which int64 wrapped to 0, the size of an empty file (#13)."""
    root = idx_dir(tmp_path / "i", LABELS, TEST_LABELS)
    (root / "t10k-images-idx3-ubyte").write_bytes(bytes([0, 0, 8, 3]) + struct.pack(">III", 2**31, 2**31, 4))
    one_error(tmp_path, "t10k-images-idx3-ubyte is truncated", "18446744073709551616 bytes", name="idx", root=str(root))


def test_damaged_idx_files_are_named(tmp_path: Path) -> None:
    root = idx_dir(tmp_path / "i", LABELS, TEST_LABELS)
    images = root / "t10k-images-idx3-ubyte"
    images.write_bytes(images.read_bytes()[:-7])
    one_error(tmp_path, "t10k-images-idx3-ubyte is truncated", name="idx", root=str(root))
    images.unlink()
    one_error(tmp_path, "no test images file", name="idx", root=str(root))


@pytest.fixture(scope="module")
def good_idx(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, bytes]]:
    root = idx_dir(tmp_path_factory.mktemp("good") / "i", LABELS, TEST_LABELS)
    return root, {p.name: p.read_bytes() for p in root.iterdir()}


@settings(deadline=None, max_examples=40, suppress_health_check=[HealthCheck.too_slow])
@given(
    name=st.sampled_from(
        ["train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"]
    ),
    cut=st.integers(0, 200),
    flips=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 255)), max_size=4),
    k_shot=st.sampled_from([None, 3]),
)
def test_random_idx_damage_trains_or_fails_with_one_line(
    good_idx: tuple[Path, dict[str, bytes]], tmp_path_factory: pytest.TempPathFactory, name, cut, flips, k_shot
) -> None:
    """Header bytes overwritten (magic, rank, sizes, labels) and/or the file truncated."""
    _, files = good_idx
    work = tmp_path_factory.mktemp("damaged")
    root = work / "idx"
    root.mkdir()
    for file, data in files.items():
        (root / file).write_bytes(data)
    data = bytearray(files[name])
    for at, value in flips:
        data[at % len(data)] = value
    (root / name).write_bytes(bytes(data[: max(len(data) - cut, 0)]))
    code, err = train(work, name="idx", root=str(root), k_shot=k_shot)
    if code not in DONE:
        lines = err.splitlines()
        assert code == 2 and len(lines) == 1 and lines[0].startswith("flatbma: error: "), err
