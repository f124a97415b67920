"""In-memory image datasets and loaders for the formats flatbma reads.

Over 500 lines on purpose: the registry :data:`DATASETS` and the seven readers it names, over shared checks.

Every loader reads only local files (nothing is downloaded) and returns a :class:`DatasetSplits` of two
:class:`ArrayDataset` objects sharing one class list. :data:`DATASETS` (configs, the CLI) maps a name to its loader:

============== ======================================================================================
name           source
============== ======================================================================================
digits         scikit-learn's bundled 8x8 digits, split 2/3 train, 1/3 test (stratified, seed 0)
animal-mnist   the files shipped in the ``animal-mnist`` PyPI package, split 80/20 (stratified, seed 0)
idx            any MNIST-format directory (``train-images-idx3-ubyte[.gz]`` and friends)
fashion-mnist  idx files, by default in ``/usr/share/datasets/fashion-mnist`` (Debian package)
cifar10        the official ``cifar-10-batches-py`` folder
cifar100       the official ``cifar-100-python`` folder
image-folder   ``root/{train,test}/<class>/*.{png,jpg,jpeg,bmp}``
============== ======================================================================================
"""

from __future__ import annotations

import importlib.util
import inspect
import logging
import re
import struct
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError
from torch import Tensor

from flatbma.checks import check_int, shown
from flatbma.data._readers import load_data_pickle, read_idx
from flatbma.data.arrays import ArrayDataset, DatasetSplits, check_learnable
from flatbma.data.fewshot import stratified_split
from flatbma.errors import FlatbmaError, suggest

__all__ = [
    "ANIMAL_MNIST_CLASSES",
    "DATASETS",
    "FASHION_MNIST_CLASSES",
    "FASHION_MNIST_ROOT",
    "ArrayDataset",
    "DatasetSplits",
    "check_learnable",
    "dataset_names",
    "load_animal_mnist",
    "load_cifar10",
    "load_cifar100",
    "load_dataset",
    "load_digits",
    "load_fashion_mnist",
    "load_idx",
    "load_image_folder",
]

#: Seed of the stratified train/test splits of the datasets that ship without one.
SPLIT_SEED = 0
DIGITS_TEST_FRACTION = 1 / 3
ANIMAL_MNIST_TEST_FRACTION = 0.2
ANIMAL_MNIST_MAX_BYTES = 64 << 20
"""The most bytes an animal-mnist pickle may decompress to (the images are 7.8 MB): a gzip bomb is refused."""

FASHION_MNIST_ROOT = Path("/usr/share/datasets/fashion-mnist")
FASHION_MNIST_CLASSES = (
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
)
# Named only in the animal-mnist PyPI description; labels 0..9 follow this alphabetical order (checked
# on the images of every label).
ANIMAL_MNIST_CLASSES = (
    "Bear",
    "Bird",
    "Cat",
    "Cow",
    "Dog",
    "Elephant",
    "Giraffe",
    "Horse",
    "Sheep",
    "Zebra",
)
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp")
# The formats PIL may decode them as (whatever a file's extension): PIL's rarer decoders are kept out.
_IMAGE_FORMATS = ("PNG", "JPEG", "BMP")

T = TypeVar("T")


# ---------------------------------------------------------------------------------------------------
# Helpers for loaders
# ---------------------------------------------------------------------------------------------------


def _existing_dir(root: str | Path | None, name: str, help_text: str) -> Path:
    if root is None:
        raise FlatbmaError(f"dataset '{name}' needs root, the directory holding its files. {help_text}")
    try:
        path = Path(root).expanduser()
    except RuntimeError:  # '~user/...' for an unknown user, or no home directory
        raise FlatbmaError(f"dataset '{name}': cannot expand '~' in root {str(root)!r}. {help_text}") from None
    if not path.is_dir():
        what = "is a file, not a directory" if path.exists() else "does not exist"
        raise FlatbmaError(f"dataset '{name}': root {path} {what}. {help_text}")
    return path


def _splits(images: Tensor, labels: Tensor, classes: Sequence[str], fraction: float, name: str) -> DatasetSplits:
    data = ArrayDataset(images, labels, list(classes))
    train_idx, test_idx = stratified_split(data.labels, fraction, SPLIT_SEED)
    return DatasetSplits(data.subset(train_idx), data.subset(test_idx), name)


def _int_labels(values: object, path: Path, help_text: str) -> np.ndarray:
    try:
        array = np.asarray(values)
    except (ValueError, TypeError, OverflowError) as exc:  # e.g. a ragged list: [[1], 2]
        raise FlatbmaError(f"{path}: labels must be a 1-D sequence of integers ({exc}). {help_text}") from None
    if array.ndim != 1 or not np.issubdtype(array.dtype, np.integer):
        raise FlatbmaError(
            f"{path}: labels must be a 1-D sequence of integers, got {array.dtype} with shape "
            f"{array.shape}. {help_text}"
        )
    return array.astype(np.int64)


# ---------------------------------------------------------------------------------------------------
# Loaders
# ---------------------------------------------------------------------------------------------------


def load_digits(root: str | Path | None = None) -> DatasetSplits:
    """Load scikit-learn's 8x8 handwritten digits (1,797 images, 10 classes).

    Pixels (0-16) are divided by 16: float32 images ``[N, 1, 8, 8]`` in ``[0, 1]``. A stratified third of each
    class is held out for testing (seed 0, the same on every machine). ``root`` must be ``None``.
    """
    if root is not None:
        raise FlatbmaError("dataset 'digits' ships with scikit-learn and takes no root; leave root unset.")
    from sklearn.datasets import load_digits as sklearn_load_digits

    bunch = sklearn_load_digits()
    images = torch.from_numpy(np.asarray(bunch.images, dtype=np.float32) / 16.0).unsqueeze(1)
    labels = torch.from_numpy(np.asarray(bunch.target, dtype=np.int64))
    classes = [str(c) for c in range(10)]
    return _splits(images, labels, classes, DIGITS_TEST_FRACTION, "digits")


_ANIMAL_HELP = (
    "Install the data with `pip install --no-deps animal-mnist` (its Python modules need TensorFlow, "
    "so skip the dependencies; flatbma reads only its two data files), or pass root=<directory holding "
    "animal_data_version_3.gz and animal_label_version_3.gz>."
)


def load_animal_mnist(root: str | Path | None = None) -> DatasetSplits:
    """Load Animal-MNIST: 10,000 grayscale 28x28 animal silhouettes, 1,000 per class (:data:`ANIMAL_MNIST_CLASSES`).

    Reads the gzipped numpy pickles of the ``animal-mnist`` PyPI package (found without importing it: it imports
    TensorFlow) with a restricted unpickler that rebuilds numpy arrays only. Images ``uint8 [N, 1, 28, 28]``; a
    stratified 20 % of each class is held out (seed 0: 8,000 train / 2,000 test). ``root`` holds
    ``animal_data_version_3.gz`` and ``animal_label_version_3.gz`` (default: the installed package's).
    """
    if root is None:
        spec = importlib.util.find_spec("animal_mnist")
        if spec is None or not spec.submodule_search_locations:
            raise FlatbmaError(f"dataset 'animal-mnist' is not installed. {_ANIMAL_HELP}")
        directory = Path(next(iter(spec.submodule_search_locations))) / "data" / "Animal_MNIST"
    else:
        directory = _existing_dir(root, "animal-mnist", _ANIMAL_HELP)
    images_path = directory / "animal_data_version_3.gz"
    labels_path = directory / "animal_label_version_3.gz"
    for path in (images_path, labels_path):
        if not path.is_file():
            raise FlatbmaError(f"dataset 'animal-mnist': {path} is missing. {_ANIMAL_HELP}")
    # 10,000 images of 28×28 bytes (7.8 MB) and their labels: anything far larger is not the dataset
    images = load_data_pickle(images_path, compressed=True, source=_ANIMAL_HELP, max_bytes=ANIMAL_MNIST_MAX_BYTES)
    labels = load_data_pickle(labels_path, compressed=True, source=_ANIMAL_HELP, max_bytes=ANIMAL_MNIST_MAX_BYTES)
    if not isinstance(images, np.ndarray) or images.dtype != np.uint8 or images.ndim != 3:
        raise FlatbmaError(
            f"{images_path} should hold a uint8 array [N, H, W], got "
            f"{getattr(images, 'dtype', type(images).__name__)} {getattr(images, 'shape', '')}. "
            f"{_ANIMAL_HELP}"
        )
    labels = _int_labels(labels, labels_path, _ANIMAL_HELP)
    return _splits(
        torch.from_numpy(np.ascontiguousarray(images)).unsqueeze(1),
        torch.from_numpy(labels),
        ANIMAL_MNIST_CLASSES,
        ANIMAL_MNIST_TEST_FRACTION,
        "animal-mnist",
    )


_IDX_FILE = re.compile(r"(?P<kind>images|labels)[-_.]idx(?P<ndim>[13])[-_.]ubyte(?P<gz>\.gz)?$", re.IGNORECASE)
_IDX_LAYOUT = (
    "Expected an MNIST-format (idx) directory with train-images-idx3-ubyte, train-labels-idx1-ubyte, "
    "t10k-images-idx3-ubyte and t10k-labels-idx1-ubyte (each optionally .gz; test files may start with "
    "'test' instead of 't10k'), directly in root or in root/raw."
)
_FASHION_HELP = (
    f"Get Fashion-MNIST with `sudo apt install dataset-fashion-mnist` (Debian/Ubuntu; it installs to "
    f"{FASHION_MNIST_ROOT}/) or download the four .gz files from "
    f"https://github.com/zalandoresearch/fashion-mnist (data/fashion) and pass root=<that directory>."
)


def _find_idx_files(root: Path) -> tuple[Path, dict[tuple[str, str], Path]]:
    """Find the four idx files in ``root``, ``root/raw`` or ``root/*/raw`` (torchvision's layout)."""
    candidates = [root, root / "raw", *sorted(p for p in root.glob("*/raw") if p.is_dir())]
    for directory in candidates:
        if not directory.is_dir():
            continue
        found: dict[tuple[str, str], list[Path]] = {}
        for path in sorted(directory.iterdir()):
            match = _IDX_FILE.search(path.name)
            lower = path.name.lower()
            if match is None or not path.is_file():
                continue
            split = "train" if lower.startswith("train") else "test" if lower.startswith(("t10k", "test")) else None
            if split is not None:
                found.setdefault((split, match["kind"].lower()), []).append(path)
        if not found:
            continue
        chosen: dict[tuple[str, str], Path] = {}
        for key, paths in found.items():
            stems = {p.name.lower().removesuffix(".gz") for p in paths}
            if len(stems) > 1:
                raise FlatbmaError(
                    f"{directory} holds several {key[0]} {key[1]} files ({[p.name for p in paths]}); keep one."
                )
            # The same file both raw and gzipped: read the raw one (no decompression).
            chosen[key] = min(paths, key=lambda p: p.suffix == ".gz")
        return directory, chosen
    return root, {}


def _load_idx(root: Path, classes: Sequence[str] | None, name: str, help_text: str) -> DatasetSplits:
    directory, files = _find_idx_files(root)
    keys = [(s, k) for s in ("train", "test") for k in ("images", "labels")]
    missing = [f"{s} {k}" for s, k in keys if (s, k) not in files]
    if missing:
        raise FlatbmaError(
            f"dataset '{name}': no {', '.join(missing)} file(s) found in {directory}. {_IDX_LAYOUT} {help_text}"
        )
    parts: dict[str, tuple[Tensor, Tensor]] = {}
    for split in ("train", "test"):
        images = read_idx(files[(split, "images")], ndim=3, source=help_text)
        labels = read_idx(files[(split, "labels")], ndim=1, source=help_text)
        if len(images) != len(labels):
            raise FlatbmaError(
                f"dataset '{name}': {files[(split, 'images')].name} has {len(images)} images but "
                f"{files[(split, 'labels')].name} has {len(labels)} labels; the files do not belong together."
                f" {help_text}"
            )
        parts[split] = (
            torch.from_numpy(images.copy()).unsqueeze(1),
            torch.from_numpy(labels.astype(np.int64)),
        )
    if classes is None:
        top = max(int(labels.max()) if labels.numel() else -1 for _, labels in parts.values())
        classes = [str(c) for c in range(top + 1)]
    for split, (_, labels) in parts.items():
        if labels.numel() and int(labels.max()) >= len(classes):
            raise FlatbmaError(
                f"dataset '{name}': {files[(split, 'labels')]} holds label {int(labels.max())}, but the dataset has "
                f"{len(classes)} classes (labels 0..{len(classes) - 1}); the file is not this dataset's. {help_text}"
            )
    splits = {s: ArrayDataset(images, labels, list(classes)) for s, (images, labels) in parts.items()}
    return DatasetSplits(splits["train"], splits["test"], name)


def load_idx(root: str | Path | None = None, *, classes: Sequence[str] | None = None) -> DatasetSplits:
    """Load an MNIST-format (idx) directory: MNIST, Fashion-MNIST, KMNIST, ...

    Files are found by name in ``root``, ``root/raw`` or ``root/<name>/raw`` (torchvision's layout):
    ``train*images-idx3-ubyte``, ``train*labels-idx1-ubyte`` and their ``t10k*``/``test*`` pair, optionally
    gzipped. Headers and sizes are checked (truncated files are reported). Images are ``uint8 [N, 1, H, W]``.
    ``classes`` defaults to ``"0"`` .. ``str(max label)``.
    """
    root = _existing_dir(root, "idx", _IDX_LAYOUT)
    return _load_idx(root, classes, "idx", "")


def load_fashion_mnist(root: str | Path | None = None) -> DatasetSplits:
    """Load Fashion-MNIST (60,000 train / 10,000 test, 28x28 grayscale, 10 classes) from idx files.

    ``root`` defaults to :data:`FASHION_MNIST_ROOT`, where Debian's ``dataset-fashion-mnist`` package installs it.
    """
    root = _existing_dir(FASHION_MNIST_ROOT if root is None else root, "fashion-mnist", _FASHION_HELP)
    return _load_idx(root, FASHION_MNIST_CLASSES, "fashion-mnist", _FASHION_HELP)


def _get(record: dict[Any, Any], key: str) -> Any:
    """Look ``key`` up as bytes (official files, ``encoding='bytes'``) or as str (re-pickled files)."""
    return record[key.encode()] if key.encode() in record else record.get(key)


def _cifar_dir(root: str | Path | None, name: str, folder: str, required: Sequence[str], help_text: str) -> Path:
    base = _existing_dir(root, name, help_text)
    for directory in (base, base / folder):
        if all((directory / f).is_file() for f in required):
            return directory
    tarballs = [p.name for p in base.glob("*.tar.gz")] if base.is_dir() else []
    extract = f" Found {tarballs}: extract it first (tar xzf <file>)." if tarballs else ""
    raise FlatbmaError(
        f"dataset '{name}': {base} is not a {folder} folder (or its parent): missing "
        f"{[f for f in required if not (base / f).is_file() and not (base / folder / f).is_file()]}."
        f"{extract} {help_text}"
    )


def _cifar_batch(path: Path, label_key: str, help_text: str) -> tuple[np.ndarray, np.ndarray]:
    record = load_data_pickle(path, source=help_text)
    if not isinstance(record, dict):
        raise FlatbmaError(f"{path} should hold a dict, got {type(record).__name__}. {help_text}")
    data, labels = _get(record, "data"), _get(record, label_key)
    if data is None or labels is None:
        raise FlatbmaError(f"{path} has no 'data' or '{label_key}' entry (keys: {list(record)}). {help_text}")
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072:
        raise FlatbmaError(
            f"{path}: 'data' must be a uint8 array [N, 3072] (32x32 RGB, channel-major), got "
            f"{getattr(data, 'dtype', type(data).__name__)} {getattr(data, 'shape', '')}. {help_text}"
        )
    labels = _int_labels(labels, path, help_text)
    if len(labels) != len(data):
        raise FlatbmaError(f"{path}: {len(data)} images but {len(labels)} labels. {help_text}")
    return data.reshape(-1, 3, 32, 32), labels


def _cifar_names(path: Path, key: str, help_text: str) -> list[str]:
    meta = load_data_pickle(path, source=help_text)
    names = _get(meta, key) if isinstance(meta, dict) else None
    if not isinstance(names, list) or not all(isinstance(n, (bytes, str)) for n in names):
        raise FlatbmaError(f"{path} has no list of class names under '{key}'. {help_text}")
    return [n.decode("utf-8") if isinstance(n, bytes) else n for n in names]


def _cifar_splits(
    directory: Path,
    train: Sequence[str],
    test: str,
    label_key: str,
    classes: list[str],
    name: str,
    help_text: str,
) -> DatasetSplits:
    parts = [_cifar_batch(directory / f, label_key, help_text) for f in train]
    train_images = np.concatenate([p[0] for p in parts])
    train_labels = np.concatenate([p[1] for p in parts])
    test_images, test_labels = _cifar_batch(directory / test, label_key, help_text)
    return DatasetSplits(
        ArrayDataset(torch.from_numpy(train_images), torch.from_numpy(train_labels), classes),
        ArrayDataset(torch.from_numpy(np.ascontiguousarray(test_images)), torch.from_numpy(test_labels), classes),
        name,
    )


_CIFAR10_HELP = (
    "Expected the official python version: cifar-10-batches-py/ with data_batch_1 .. data_batch_5, "
    "test_batch and batches.meta. Download https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz, "
    "extract it, and pass root=<the extracted folder or its parent>."
)
_CIFAR100_HELP = (
    "Expected the official python version: cifar-100-python/ with train, test and meta. Download "
    "https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz, extract it, and pass root=<the "
    "extracted folder or its parent>."
)


def load_cifar10(root: str | Path | None = None) -> DatasetSplits:
    """Load CIFAR-10 (50,000 train / 10,000 test, 32x32 RGB, 10 classes) from the official pickles.

    A restricted unpickler rebuilds only built-in containers and plain numpy arrays, so a tampered file cannot
    run code. Images are ``uint8 [N, 3, 32, 32]``; class names come from ``batches.meta``. ``root`` is
    ``cifar-10-batches-py`` or the directory containing it.
    """
    train = [f"data_batch_{i}" for i in range(1, 6)]
    directory = _cifar_dir(
        root, "cifar10", "cifar-10-batches-py", [*train, "test_batch", "batches.meta"], _CIFAR10_HELP
    )
    classes = _cifar_names(directory / "batches.meta", "label_names", _CIFAR10_HELP)
    return _cifar_splits(directory, train, "test_batch", "labels", classes, "cifar10", _CIFAR10_HELP)


def load_cifar100(root: str | Path | None = None) -> DatasetSplits:
    """Load CIFAR-100 (50,000 train / 10,000 test, 32x32 RGB, 100 fine classes) from the official pickles.

    Read like :func:`load_cifar10`, with ``fine_labels`` and ``meta``'s ``fine_label_names``; ``root`` is
    ``cifar-100-python`` or the directory containing it.
    """
    directory = _cifar_dir(root, "cifar100", "cifar-100-python", ["train", "test", "meta"], _CIFAR100_HELP)
    classes = _cifar_names(directory / "meta", "fine_label_names", _CIFAR100_HELP)
    return _cifar_splits(directory, ["train"], "test", "fine_labels", classes, "cifar100", _CIFAR100_HELP)


_FOLDER_HELP = (
    "Expected root/train/<class>/*.png|jpg|jpeg|bmp and root/test/<class>/... (one sub-directory per "
    "class; the class list is the sorted union of both splits' sub-directories)."
)
_SIXTEEN_BIT_GREY = frozenset({"I;16", "I;16L", "I;16B", "I;16N", "I"})
_GREY_MODES = frozenset({"1", "L", "LA"}) | _SIXTEEN_BIT_GREY
# What PIL's decoders raise on a damaged file besides OSError (tests/data/test_bad_headers.py).
_DECODE_ERRORS = (
    OSError,
    ValueError,
    SyntaxError,
    EOFError,
    struct.error,
    IndexError,
    KeyError,
    TypeError,
    NotImplementedError,
    ZeroDivisionError,
    OverflowError,
)
_BOMB_PIXELS = re.compile(r"\((\d+) pixels\)")


def _decoded(path: Path, use: Callable[[Image.Image], T]) -> T:
    """``use(image)`` for the image file ``path`` opened with PIL; every decoding failure is a :class:`FlatbmaError`.

    A decompression bomb (over ``PIL.Image.MAX_IMAGE_PIXELS``) is refused from its header; PIL's other warnings and
    log records are dropped. Only the PNG, JPEG and BMP decoders are used.
    """
    pil_log = logging.getLogger("PIL")  # its plugins log to child loggers, which inherit this level
    level = pil_log.level
    pil_log.setLevel(logging.CRITICAL)
    try:
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(path, formats=_IMAGE_FORMATS) as image:
                return use(image)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        found = _BOMB_PIXELS.search(str(exc))
        pixels = f"{int(found[1]):,} pixels, " if found else ""
        raise FlatbmaError(
            f"dataset 'image-folder': image {path} is refused as a possible decompression bomb ({pixels}over the "
            f"limit of {Image.MAX_IMAGE_PIXELS:,} pixels, PIL.Image.MAX_IMAGE_PIXELS): remove the file or store it "
            "at a smaller size."
        ) from None
    except _DECODE_ERRORS as exc:
        if isinstance(exc, UnidentifiedImageError):  # its message repeats the path
            detail = f"not a {', '.join(_IMAGE_FORMATS[:-1])} or {_IMAGE_FORMATS[-1]} image"
        else:
            detail = str(exc).splitlines()[0][:120] if str(exc).strip() else type(exc).__name__
        raise FlatbmaError(
            f"dataset 'image-folder': cannot read image {path} ({detail}); the file is damaged or not an image: "
            "replace or remove it."
        ) from None
    finally:
        pil_log.setLevel(level)


def _listing(directory: Path) -> list[Path]:
    """The entries of ``directory``, sorted; one that cannot be listed (no permission) is a :class:`FlatbmaError`."""
    try:
        return sorted(directory.iterdir())
    except OSError as exc:
        raise FlatbmaError(
            f"dataset 'image-folder': cannot list {directory} ({exc.strerror or type(exc).__name__}): give the user "
            "running flatbma read and execute permission on it, or remove it"
        ) from None


def _eight_bit(image: Image.Image) -> Image.Image:
    """``image`` with 8-bit samples: 16-bit greyscale (PNG's ``I;16``, PIL's ``I``) scaled by 255/65535, rounded.

    PIL's own conversion to ``L`` clips values above 255 instead of scaling; other modes are returned as they
    are (PIL scales 16-bit colour PNGs on opening).
    """
    if image.mode not in _SIXTEEN_BIT_GREY:
        return image
    values = np.asarray(image).astype(np.int64).clip(0, 65535)  # the read formats hold 16 bits at most
    return Image.fromarray(((values * 255 + 32767) // 65535).astype(np.uint8), mode="L")


def load_image_folder(root: str | Path | None = None, *, size: int | None = None) -> DatasetSplits:
    """Load ``root/train/<class>/*`` and ``root/test/<class>/*`` image files with PIL.

    Images become ``uint8 [N, C, H, W]``: single-channel ``L`` if every image is grayscale, else ``RGB``
    (16-bit greyscale scaled to 8 bits, ``v·255/65535``). Files are decoded as PNG, JPEG or BMP whatever their
    extension; a damaged file, another format or a decompression bomb (over ``PIL.Image.MAX_IMAGE_PIXELS``)
    is a :class:`FlatbmaError` naming the file. ``size`` resizes every image to ``size x size`` (bilinear,
    antialiased when shrinking); it is required when the images differ in size.
    """
    root = _existing_dir(root, "image-folder", _FOLDER_HELP)
    if size is not None:
        check_int(size, f"size must be a positive int or None, got {size!r}.", minimum=1)
    split_dirs = {split: root / split for split in ("train", "test")}
    missing = [str(d) for d in split_dirs.values() if not d.is_dir()]
    if missing:
        raise FlatbmaError(f"dataset 'image-folder': missing {missing}. {_FOLDER_HELP}")
    classes = sorted(
        {p.name for d in split_dirs.values() for p in _listing(d) if p.is_dir() and not p.name.startswith(".")}
    )
    if not classes:
        raise FlatbmaError(f"dataset 'image-folder': no class sub-directories in {root}. {_FOLDER_HELP}")
    files: dict[str, list[tuple[Path, int]]] = {
        split: [
            (path, c)
            for c, cls in enumerate(classes)
            if (d / cls).is_dir()
            for path in _listing(d / cls)
            if path.suffix.lower() in IMAGE_EXTENSIONS and path.is_file() and not path.name.startswith(".")
        ]
        for split, d in split_dirs.items()
    }
    for split, entries in files.items():
        if not entries:
            raise FlatbmaError(
                f"dataset 'image-folder': no {'/'.join(IMAGE_EXTENSIONS)} images under {split_dirs[split]}. "
                f"{_FOLDER_HELP}"
            )
    # First pass reads headers only: mode and size, without decoding pixels.
    headers = {
        path: _decoded(path, lambda image: (image.mode, image.size)) for path, _ in files["train"] + files["test"]
    }
    mode = "L" if all(m in _GREY_MODES for m, _ in headers.values()) else "RGB"
    sizes: dict[tuple[int, int], Path] = {}
    for path, (_, wh) in headers.items():
        sizes.setdefault(wh, path)
    if size is None and len(sizes) > 1:
        (size_a, path_a), (size_b, path_b) = list(sizes.items())[:2]
        raise FlatbmaError(
            f"dataset 'image-folder': images differ in size ({path_a} is {size_a[0]}x{size_a[1]}, {path_b} "
            f"is {size_b[0]}x{size_b[1]}; {len(sizes)} sizes in all). Pass size=<pixels> (data.image_size in "
            f"a run config) to resize every image to a square of that size."
        )

    def pixels(image: Image.Image) -> np.ndarray:
        image = _eight_bit(image).convert(mode)
        if size is not None and image.size != (size, size):
            image = image.resize((size, size), Image.Resampling.BILINEAR)
        return np.asarray(image, dtype=np.uint8)

    def read(path: Path) -> np.ndarray:
        array = _decoded(path, pixels)
        return array[None] if array.ndim == 2 else array.transpose(2, 0, 1)

    splits = {
        split: ArrayDataset(
            torch.from_numpy(np.stack([read(p) for p, _ in entries])),
            torch.tensor([c for _, c in entries], dtype=torch.int64),
            classes,
        )
        for split, entries in files.items()
    }
    return DatasetSplits(splits["train"], splits["test"], "image-folder")


# ---------------------------------------------------------------------------------------------------
# Registry
# ---------------------------------------------------------------------------------------------------

DATASETS: dict[str, Callable[..., DatasetSplits]] = {
    "digits": load_digits,
    "animal-mnist": load_animal_mnist,
    "idx": load_idx,
    "fashion-mnist": load_fashion_mnist,
    "cifar10": load_cifar10,
    "cifar100": load_cifar100,
    "image-folder": load_image_folder,
}


def dataset_names() -> list[str]:
    """Return the registered dataset names, sorted."""
    return sorted(DATASETS)


def load_dataset(name: str, root: str | Path | None = None, **options: Any) -> DatasetSplits:
    """Load a registered dataset by name (case-insensitive, ``_`` read as ``-``).

    ``root`` and ``**options`` (e.g. ``size`` for ``image-folder``) go to the loader of that name.

    Raises:
        FlatbmaError: Unknown name or option, or the loader's own errors (missing files, wrong format).
    """
    if not isinstance(name, str):
        raise FlatbmaError(f"dataset name must be a string, got {type(name).__name__}.")
    key = name.strip().lower().replace("_", "-")
    if key not in DATASETS:
        raise FlatbmaError(
            f"unknown dataset {shown(name)}.{suggest(key, DATASETS)} Known datasets: {', '.join(dataset_names())}."
        )
    loader = DATASETS[key]
    parameters = inspect.signature(loader).parameters
    accepted = [p for p in parameters if p != "root"]
    open_ended = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    for option in [] if open_ended else options:
        if option not in accepted:
            raise FlatbmaError(
                f"dataset '{key}' has no option {shown(option)}.{suggest(option, accepted)} "
                f"Its options: {accepted or 'none'}."
            )
    return loader(root, **options)
