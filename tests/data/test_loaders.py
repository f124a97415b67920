import gzip
import importlib.util
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from flatbma.data import (
    ANIMAL_MNIST_CLASSES,
    DATASETS,
    FASHION_MNIST_CLASSES,
    dataset_names,
    load_animal_mnist,
    load_cifar10,
    load_cifar100,
    load_dataset,
    load_digits,
    load_fashion_mnist,
    load_idx,
    load_image_folder,
)
from flatbma.errors import FlatbmaError

# --------------------------------------------------------------------------------------------------
# Bundled / installed datasets
# --------------------------------------------------------------------------------------------------


def test_digits_real_load_and_split():
    splits = load_digits()
    assert splits.name == "digits" and len(splits.train) + len(splits.test) == 1797
    assert len(splits.test) == 599 and splits.train.image_shape == (1, 8, 8)
    assert splits.train.images.dtype == torch.float32
    assert float(splits.train.images.min()) == 0.0 and float(splits.train.images.max()) == 1.0
    test_counts = torch.bincount(splits.test.labels, minlength=10)
    all_counts = test_counts + torch.bincount(splits.train.labels, minlength=10)
    assert torch.all((test_counts.float() - all_counts.float() / 3).abs() <= 0.5)
    again = load_dataset("digits")
    assert torch.equal(again.test.images, splits.test.images)
    with pytest.raises(FlatbmaError, match=r"takes no root"):
        load_digits("/tmp")


def test_animal_mnist_real_load():
    splits = load_dataset("animal-mnist")
    assert len(splits.train) == 8000 and len(splits.test) == 2000
    assert splits.train.image_shape == (1, 28, 28) and splits.train.images.dtype == torch.uint8
    assert splits.train.classes == list(ANIMAL_MNIST_CLASSES) and splits.train.num_classes == 10
    assert torch.bincount(splits.test.labels).tolist() == [200] * 10
    assert torch.bincount(splits.train.labels).tolist() == [800] * 10
    image, label = splits.test[0]
    assert image.shape == (1, 28, 28) and 0.0 <= float(image.min()) <= float(image.max()) <= 1.0
    assert isinstance(label, int)


def test_animal_mnist_missing_package_or_files(monkeypatch, tmp_path):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(FlatbmaError, match=r"pip install --no-deps animal-mnist"):
        load_animal_mnist()
    with pytest.raises(FlatbmaError, match=r"animal_data_version_3.gz is missing"):
        load_animal_mnist(tmp_path)


def test_animal_mnist_root_override(tmp_path):
    images = np.random.default_rng(0).integers(0, 256, (50, 28, 28), dtype=np.uint8)
    labels = np.repeat(np.arange(10), 5)
    for name, array in [("animal_data_version_3.gz", images), ("animal_label_version_3.gz", labels)]:
        (tmp_path / name).write_bytes(gzip.compress(pickle.dumps(array, protocol=4)))
    splits = load_animal_mnist(tmp_path)
    assert len(splits.train) == 40 and len(splits.test) == 10
    assert torch.bincount(splits.test.labels).tolist() == [1] * 10


def test_animal_mnist_gzip_bomb_is_refused_before_it_is_decompressed(tmp_path, monkeypatch):
    """A .gz that decompresses past the cap is refused by name; at most cap + 1 bytes are ever decompressed."""
    from flatbma.data import datasets

    monkeypatch.setattr(datasets, "ANIMAL_MNIST_MAX_BYTES", 1 << 20)
    bomb = gzip.compress(b"\0" * (64 << 20))  # 64 MiB of zeros in 64 KiB
    (tmp_path / "animal_data_version_3.gz").write_bytes(bomb)
    (tmp_path / "animal_label_version_3.gz").write_bytes(gzip.compress(pickle.dumps(np.arange(10))))
    reads = []
    real_open = gzip.open

    def recording_open(*a, **k):
        f = real_open(*a, **k)
        real_read = f.read
        f.read = lambda n=-1: reads.append(n) or real_read(n)
        return f

    monkeypatch.setattr(gzip, "open", recording_open)
    with pytest.raises(FlatbmaError, match=r"animal_data_version_3\.gz holds more than 1048576 bytes decompressed"):
        load_animal_mnist(tmp_path)
    assert reads == [(1 << 20) + 1]


# --------------------------------------------------------------------------------------------------
# Registry
# --------------------------------------------------------------------------------------------------


def test_registry_names_and_errors():
    assert dataset_names() == sorted(DATASETS)
    assert {"digits", "animal-mnist", "idx", "fashion-mnist", "cifar10", "cifar100", "image-folder"} <= set(DATASETS)
    assert load_dataset("Animal_MNIST").name == "animal-mnist"
    with pytest.raises(FlatbmaError, match=r"unknown dataset 'cifar-10'\. Did you mean 'cifar10'\?.*digits"):
        load_dataset("cifar-10")
    with pytest.raises(FlatbmaError, match=r"no option 'sise'. Did you mean 'size'"):
        load_dataset("image-folder", "/tmp", sise=3)


# --------------------------------------------------------------------------------------------------
# idx
# --------------------------------------------------------------------------------------------------


def _idx_bytes(array: np.ndarray) -> bytes:
    header = bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    return header + array.astype(np.uint8).tobytes()


def _write_idx(directory: Path, *, gz: bool, test_prefix: str = "t10k", n_train: int = 6, n_test: int = 4):
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    arrays = {
        "train-images-idx3-ubyte": rng.integers(0, 256, (n_train, 5, 4), dtype=np.uint8),
        "train-labels-idx1-ubyte": np.arange(n_train) % 3,
        f"{test_prefix}-images-idx3-ubyte": rng.integers(0, 256, (n_test, 5, 4), dtype=np.uint8),
        f"{test_prefix}-labels-idx1-ubyte": np.arange(n_test) % 3,
    }
    for name, array in arrays.items():
        data = _idx_bytes(array)
        if gz:
            (directory / f"{name}.gz").write_bytes(gzip.compress(data))
        else:
            (directory / name).write_bytes(data)
    return arrays


@pytest.mark.parametrize("gz", [False, True])
def test_idx_raw_and_gz(tmp_path, gz):
    arrays = _write_idx(tmp_path, gz=gz)
    splits = load_dataset("idx", tmp_path)
    assert splits.train.image_shape == (1, 5, 4) and len(splits.train) == 6 and len(splits.test) == 4
    assert splits.train.classes == ["0", "1", "2"]
    np.testing.assert_array_equal(splits.train.images[:, 0].numpy(), arrays["train-images-idx3-ubyte"])
    assert splits.test.labels.tolist() == [0, 1, 2, 0]


def test_idx_test_prefix_and_raw_subfolder(tmp_path):
    _write_idx(tmp_path / "MNIST" / "raw", gz=False, test_prefix="test")
    assert len(load_idx(tmp_path).test) == 4
    assert len(load_idx(tmp_path / "MNIST").test) == 4


def test_idx_truncated_file(tmp_path):
    _write_idx(tmp_path, gz=False)
    path = tmp_path / "train-images-idx3-ubyte"
    path.write_bytes(path.read_bytes()[:-7])
    with pytest.raises(FlatbmaError, match=r"truncated.*\(6, 5, 4\).*120 bytes.*113 bytes"):
        load_idx(tmp_path)


def test_idx_truncated_gzip(tmp_path):
    _write_idx(tmp_path, gz=True)
    path = tmp_path / "t10k-labels-idx1-ubyte.gz"
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(FlatbmaError, match=r"could not be read or decompressed"):
        load_idx(tmp_path)


def test_idx_wrong_magic_and_swapped_files(tmp_path):
    _write_idx(tmp_path, gz=False)
    path = tmp_path / "train-labels-idx1-ubyte"
    good = path.read_bytes()
    path.write_bytes(b"\x12\x34" + good[2:])
    with pytest.raises(FlatbmaError, match=r"not an idx file: magic number 0x12340801, expected 0x00000801"):
        load_idx(tmp_path)
    path.write_bytes((tmp_path / "train-images-idx3-ubyte").read_bytes())
    with pytest.raises(FlatbmaError, match=r"3 dimensions.*expected 0x00000801.*swapped"):
        load_idx(tmp_path)


def test_idx_count_mismatch(tmp_path):
    _write_idx(tmp_path, gz=False)
    (tmp_path / "t10k-labels-idx1-ubyte").write_bytes(_idx_bytes(np.zeros(3, np.uint8)))
    with pytest.raises(FlatbmaError, match=r"4 images but .* 3 labels"):
        load_idx(tmp_path)


def test_idx_missing_files_and_fashion_hint(tmp_path):
    with pytest.raises(FlatbmaError, match=r"train images.*t10k-images-idx3-ubyte"):
        load_idx(tmp_path)
    with pytest.raises(FlatbmaError, match=r"needs root"):
        load_idx()
    with pytest.raises(FlatbmaError, match=r"/usr/share/datasets/fashion-mnist"):
        load_fashion_mnist(tmp_path / "nowhere")
    _write_idx(tmp_path, gz=True)
    splits = load_dataset("fashion-mnist", tmp_path)
    assert splits.train.classes == list(FASHION_MNIST_CLASSES) and splits.name == "fashion-mnist"


# --------------------------------------------------------------------------------------------------
# CIFAR
# --------------------------------------------------------------------------------------------------


def _cifar_record(n: int, label_key: bytes, labels: list[int], seed: int) -> dict[bytes, object]:
    data = np.random.default_rng(seed).integers(0, 256, (n, 3072), dtype=np.uint8)
    return {
        b"batch_label": b"batch",
        label_key: labels,
        b"data": data,
        b"filenames": [f"img{i}.png".encode() for i in range(n)],
    }


def _dump(path: Path, record: object) -> None:
    path.write_bytes(pickle.dumps(record, protocol=2))


def _write_cifar10(root: Path) -> dict[str, dict[bytes, object]]:
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    records = {f"data_batch_{i}": _cifar_record(3, b"labels", [i % 10, 2, 9], seed=i) for i in range(1, 6)}
    records["test_batch"] = _cifar_record(2, b"labels", [4, 5], seed=9)
    for name, record in records.items():
        _dump(folder / name, record)
    names = [
        b"airplane",
        b"automobile",
        b"bird",
        b"cat",
        b"deer",
        b"dog",
        b"frog",
        b"horse",
        b"ship",
        b"truck",
    ]
    _dump(folder / "batches.meta", {b"label_names": names, b"num_cases_per_batch": 3, b"num_vis": 3072})
    return records


def test_cifar10_official_layout(tmp_path):
    records = _write_cifar10(tmp_path)
    for root in (tmp_path, tmp_path / "cifar-10-batches-py"):
        splits = load_dataset("cifar10", root)
        assert len(splits.train) == 15 and len(splits.test) == 2
        assert splits.train.image_shape == (3, 32, 32) and splits.train.classes[1] == "automobile"
        assert splits.train.labels.tolist()[:6] == [1, 2, 9, 2, 2, 9]
    # Row layout: 1024 red, then 1024 green, then 1024 blue values, each row-major 32x32.
    data = records["test_batch"][b"data"]
    assert splits.test.images[1, 1, 2, 3] == data[1, 1024 + 2 * 32 + 3]
    assert splits.test.images[0, 2, 31, 31] == data[0, 3071]


def test_cifar10_missing_files_and_tarball_hint(tmp_path):
    records = _write_cifar10(tmp_path)
    assert records
    (tmp_path / "cifar-10-batches-py" / "data_batch_3").unlink()
    with pytest.raises(FlatbmaError, match=r"missing \['data_batch_3'\].*cifar-10-python.tar.gz"):
        load_cifar10(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "cifar-10-python.tar.gz").write_bytes(b"")
    with pytest.raises(FlatbmaError, match=r"extract it first"):
        load_cifar10(empty)
    with pytest.raises(FlatbmaError, match=r"needs root"):
        load_dataset("cifar10")


def test_cifar10_bad_batch_content(tmp_path):
    _write_cifar10(tmp_path)
    folder = tmp_path / "cifar-10-batches-py"
    _dump(folder / "test_batch", {b"data": np.zeros((2, 100), np.uint8), b"labels": [0, 1]})
    with pytest.raises(FlatbmaError, match=r"uint8 array \[N, 3072\]"):
        load_cifar10(folder)
    _dump(folder / "test_batch", {b"data": np.zeros((2, 3072), np.uint8), b"labels": [0, 10]})
    with pytest.raises(FlatbmaError, match=r"label 10 .*\[0, 10\)"):
        load_cifar10(folder)


def test_cifar100_official_layout(tmp_path):
    folder = tmp_path / "cifar-100-python"
    folder.mkdir()
    train = _cifar_record(4, b"fine_labels", [0, 99, 5, 7], seed=1)
    train[b"coarse_labels"] = [0, 19, 1, 2]
    _dump(folder / "train", train)
    _dump(folder / "test", _cifar_record(2, b"fine_labels", [3, 98], seed=2))
    fine = [f"class{i}".encode() for i in range(100)]
    _dump(folder / "meta", {b"fine_label_names": fine, b"coarse_label_names": [b"c"] * 20})
    splits = load_cifar100(tmp_path)
    assert splits.train.num_classes == 100 and splits.train.classes[99] == "class99"
    assert splits.train.labels.tolist() == [0, 99, 5, 7] and splits.test.labels.tolist() == [3, 98]
    np.testing.assert_array_equal(splits.train.images.reshape(4, -1).numpy(), train[b"data"])
    with pytest.raises(FlatbmaError, match=r"cifar-100-python.tar.gz"):
        load_cifar100(tmp_path / "cifar-100-python" / "missing")


# --------------------------------------------------------------------------------------------------
# Image folder
# --------------------------------------------------------------------------------------------------


def _png(path: Path, size: tuple[int, int], mode: str = "RGB", value: int = 100) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    color = value if mode == "L" else (value, 255 - value, 7)
    Image.new(mode, size, color).save(path)


def test_image_folder_rgb(tmp_path):
    _png(tmp_path / "train" / "cat" / "a.png", (5, 3), value=10)
    _png(tmp_path / "train" / "cat" / "b.PNG", (5, 3), mode="L", value=20)
    _png(tmp_path / "train" / "dog" / "c.png", (5, 3), value=30)
    _png(tmp_path / "test" / "dog" / "d.png", (5, 3), value=40)
    _png(tmp_path / "test" / "eel" / "e.png", (5, 3), value=50)
    (tmp_path / "train" / "dog" / "notes.txt").write_text("ignored")
    splits = load_image_folder(tmp_path)
    assert splits.train.classes == ["cat", "dog", "eel"]
    assert splits.train.labels.tolist() == [0, 0, 1] and splits.test.labels.tolist() == [1, 2]
    assert splits.train.image_shape == (3, 3, 5) and splits.train.images.dtype == torch.uint8
    assert splits.train.images[0, :, 0, 0].tolist() == [10, 245, 7]
    assert splits.train.images[1, :, 0, 0].tolist() == [20, 20, 20]


def test_image_folder_grayscale_and_sizes(tmp_path):
    _png(tmp_path / "train" / "a" / "1.png", (4, 4), mode="L")
    _png(tmp_path / "train" / "b" / "2.png", (6, 4), mode="L")
    _png(tmp_path / "test" / "a" / "3.png", (4, 4), mode="L")
    with pytest.raises(FlatbmaError, match=r"differ in size.*4x4.*6x4.*size="):
        load_image_folder(tmp_path)
    splits = load_dataset("image-folder", tmp_path, size=3)
    assert splits.train.image_shape == (1, 3, 3) and splits.test.image_shape == (1, 3, 3)
    assert torch.all(splits.train.images == 100)


def test_image_folder_layout_errors(tmp_path):
    _png(tmp_path / "train" / "a" / "1.png", (4, 4))
    with pytest.raises(FlatbmaError, match=r"missing .*test.*root/train/<class>"):
        load_image_folder(tmp_path)
    (tmp_path / "test" / "a").mkdir(parents=True)
    with pytest.raises(FlatbmaError, match=r"no .* images under"):
        load_image_folder(tmp_path)
    (tmp_path / "test" / "a" / "broken.png").write_bytes(b"not a png")
    with pytest.raises(FlatbmaError, match=r"cannot read image .*broken.png"):
        load_image_folder(tmp_path)
