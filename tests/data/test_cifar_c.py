from pathlib import Path

import numpy as np
import pytest
import torch

from flatbma.data import CIFAR10_CLASSES, CIFAR_C_CORRUPTIONS, cifar_c_corruptions, load_cifar_c
from flatbma.errors import FlatbmaError

N = 6  # test images per severity
SIDE = 8


def blocks(n: int = N) -> np.ndarray:
    """uint8 [5 * n, SIDE, SIDE, 3] in the published layout; pixel value 40 * severity + image index."""
    values = [40 * severity + i for severity in range(1, 6) for i in range(n)]
    images = np.array(values, dtype=np.uint8)[:, None, None, None] * np.ones((1, SIDE, SIDE, 3), np.uint8)
    images[:, 0, 0, :] = [1, 2, 3]  # mark the channel order at the top-left pixel
    return images


LABELS = np.array([3, 0, 9, 1, 1, 7], dtype=np.uint8)


def write_cifar_c(directory: Path, names=("gaussian_noise", "fog"), labels: np.ndarray | None = None) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for name in names:
        np.save(directory / f"{name}.npy", blocks())
    np.save(directory / "labels.npy", np.tile(LABELS, 5) if labels is None else labels)
    return directory


def test_loads_each_severity_block_with_labels_and_default_classes(tmp_path):
    root = write_cifar_c(tmp_path / "CIFAR-10-C")
    for severity in range(1, 6):
        ds = load_cifar_c(root, "gaussian_noise", severity)
        assert ds.images.dtype == torch.uint8 and ds.images.shape == (N, 3, SIDE, SIDE)
        expected = torch.tensor([40 * severity + i for i in range(N)], dtype=torch.uint8)
        assert torch.equal(ds.images[:, 1, 5, 5], expected)
        assert ds.images[0, :, 0, 0].tolist() == [1, 2, 3]
        assert ds.labels.tolist() == LABELS.tolist() and ds.classes == list(CIFAR10_CLASSES)
    image, label = ds[2]
    assert image.dtype == torch.float32 and label == 9
    torch.testing.assert_close(image[0, 4, 4], torch.tensor((40 * 5 + 2) / 255))


def test_parent_directory_names_and_label_file_of_n(tmp_path):
    write_cifar_c(tmp_path / "CIFAR-100-C", labels=LABELS)  # n labels instead of 5n
    classes = [f"c{i}" for i in range(100)]
    ds = load_cifar_c(tmp_path, "Gaussian-Noise", 3, classes=classes)
    assert ds.labels.tolist() == LABELS.tolist() and ds.num_classes == 100
    assert int(ds.images[0, 0, 3, 3]) == 120


def test_lists_available_corruptions_in_published_order(tmp_path):
    root = write_cifar_c(tmp_path, names=("my_blur", "spatter", "fog", "gaussian_noise"))
    assert cifar_c_corruptions(root) == ["gaussian_noise", "fog", "spatter", "my_blur"]
    assert len(CIFAR_C_CORRUPTIONS) == 19 and CIFAR_C_CORRUPTIONS[-1] == "spatter"
    assert load_cifar_c(root, "spatter", 1).images.shape == (N, 3, SIDE, SIDE)


def test_missing_root_labels_and_unknown_corruption(tmp_path):
    with pytest.raises(FlatbmaError, match=r"does not exist.*zenodo\.org/records/2535967"):
        load_cifar_c(tmp_path / "nowhere", "fog", 1)
    (tmp_path / "file").write_text("x")
    with pytest.raises(FlatbmaError, match="is a file"):
        cifar_c_corruptions(tmp_path / "file")
    np.save(tmp_path / "fog.npy", blocks())
    with pytest.raises(FlatbmaError, match=r"labels\.npy is missing.*Nothing is downloaded"):
        load_cifar_c(tmp_path, "fog", 1)
    write_cifar_c(tmp_path)
    with pytest.raises(FlatbmaError, match=r"no file 'gausian_noise'\.npy.*Did you mean 'gaussian_noise'"):
        load_cifar_c(tmp_path, "gausian_noise", 1)
    with pytest.raises(FlatbmaError, match="Available: gaussian_noise, fog"):
        load_cifar_c(tmp_path, "../fog", 1)
    with pytest.raises(FlatbmaError, match="must be a string"):
        load_cifar_c(tmp_path, None, 1)


def test_both_cifar_folders_are_ambiguous(tmp_path):
    write_cifar_c(tmp_path / "CIFAR-10-C")
    write_cifar_c(tmp_path / "CIFAR-100-C")
    with pytest.raises(FlatbmaError, match="holds both CIFAR-10-C and CIFAR-100-C"):
        load_cifar_c(tmp_path, "fog", 1)


@pytest.mark.parametrize("severity", [0, 6, 1.0, True])
def test_bad_severity(tmp_path, severity):
    write_cifar_c(tmp_path)
    with pytest.raises(FlatbmaError, match="severity must be an integer from 1 to 5"):
        load_cifar_c(tmp_path, "fog", severity)


def test_numpy_integer_severity_is_an_integer_but_numpy_bool_is_not(tmp_path):
    root = write_cifar_c(tmp_path)
    assert torch.equal(load_cifar_c(root, "fog", np.int64(2)).images, load_cifar_c(root, "fog", 2).images)
    with pytest.raises(FlatbmaError, match="severity must be an integer from 1 to 5"):
        load_cifar_c(root, "fog", np.bool_(True))


@pytest.mark.parametrize(
    ("images", "message"),
    [
        (blocks().astype(np.float32), "float32.*expected uint8 \\[5\\*n, H, W, 3\\]"),
        (blocks()[..., :1], "expected uint8 \\[5\\*n, H, W, 3\\]"),
        (blocks()[:, :, :, 0], "expected uint8 \\[5\\*n, H, W, 3\\]"),
        (blocks()[:-1], "29 images, not a positive multiple of 5"),
        (blocks()[:0], "0 images"),
    ],
)
def test_wrong_image_arrays(tmp_path, images, message):
    write_cifar_c(tmp_path)
    np.save(tmp_path / "fog.npy", images)
    with pytest.raises(FlatbmaError, match=message) as info:
        load_cifar_c(tmp_path, "fog", 1)
    assert "fog.npy" in str(info.value)


@pytest.mark.parametrize(
    ("labels", "message"),
    [
        (np.tile(LABELS, 4), "24 labels but fog.npy has 30 images \\(6 per severity\\); expected 30 or 6"),
        (np.tile(LABELS, 5).astype(np.float32), "expected integer labels"),
        (np.tile(LABELS, 5).reshape(5, N), "expected integer labels"),
        (np.tile(LABELS + 10, 5), "labels in \\[10, 19\\] but 10 classes.*CIFAR-100"),
    ],
)
def test_wrong_labels(tmp_path, labels, message):
    write_cifar_c(tmp_path, labels=labels)
    with pytest.raises(FlatbmaError, match=message):
        load_cifar_c(tmp_path, "fog", 2)


def test_unreadable_files_are_clear_errors(tmp_path):
    write_cifar_c(tmp_path)
    np.save(tmp_path / "fog.npy", np.array([{"a": 1}] * 5, dtype=object), allow_pickle=True)
    with pytest.raises(FlatbmaError, match=r"cannot read .*fog\.npy"):
        load_cifar_c(tmp_path, "fog", 1)
    (tmp_path / "snow.npy").write_bytes(b"not a numpy file")
    with pytest.raises(FlatbmaError, match=r"cannot read .*snow\.npy"):
        load_cifar_c(tmp_path, "snow", 1)
