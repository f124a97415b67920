import pytest
import torch
from torch.utils.data import DataLoader

from flatbma.data import ArrayDataset, DatasetSplits
from flatbma.errors import FlatbmaError

CLASSES = ["a", "b", "c"]


def _uint8_data(n: int = 6) -> ArrayDataset:
    images = torch.arange(n * 1 * 2 * 2, dtype=torch.int64).remainder(256).to(torch.uint8).view(n, 1, 2, 2)
    labels = torch.arange(n) % 3
    return ArrayDataset(images, labels, CLASSES)


def test_getitem_scales_uint8_to_unit_float_and_returns_int_label():
    data = ArrayDataset(torch.tensor([[[[0, 255], [51, 102]]]], dtype=torch.uint8), torch.tensor([2]), CLASSES)
    image, label = data[0]
    assert image.dtype == torch.float32 and image.shape == (1, 2, 2)
    torch.testing.assert_close(image, torch.tensor([[[0.0, 1.0], [0.2, 0.4]]]))
    assert label == 2 and isinstance(label, int)


def test_float_images_are_kept_and_not_aliased():
    images = torch.rand(4, 3, 5, 5, dtype=torch.float64)
    data = ArrayDataset(images, torch.tensor([0, 1, 2, 0]), CLASSES)
    assert data.images.dtype == torch.float32
    image, _ = data[1]
    image.zero_()
    torch.testing.assert_close(data.images[1], images[1].float())


def test_properties_subset_and_with_transform():
    data = _uint8_data()
    assert len(data) == 6 and data.num_classes == 3 and data.image_shape == (1, 2, 2)
    part = data.subset(torch.tensor([4, 1]))
    assert len(part) == 2 and part.labels.tolist() == [1, 1] and part.classes == CLASSES
    assert torch.equal(part.images[0], data.images[4])
    assert data.subset([0, 2]).labels.tolist() == [0, 2]
    doubled = data.with_transform(lambda x: 2 * x)
    assert doubled.transform is not None and data.transform is None
    torch.testing.assert_close(doubled[3][0], 2 * data[3][0])
    assert doubled.subset([3]).transform is doubled.transform


def test_works_with_dataloader():
    images, labels = next(iter(DataLoader(_uint8_data(), batch_size=4)))
    assert images.shape == (4, 1, 2, 2) and labels.tolist() == [0, 1, 2, 0]


def test_class_without_examples_is_allowed():
    data = ArrayDataset(torch.zeros(2, 1, 2, 2), torch.tensor([0, 0]), CLASSES)
    assert data.num_classes == 3


@pytest.mark.parametrize("label", [3, -1])
def test_label_out_of_range_names_label_and_range(label):
    with pytest.raises(FlatbmaError, match=rf"label {label} \(at index 1\).*\[0, 3\)"):
        ArrayDataset(torch.zeros(2, 1, 2, 2), torch.tensor([0, label]), CLASSES)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_pixels_are_rejected(bad):
    images = torch.zeros(3, 1, 2, 2)
    images[2, 0, 1, 1] = bad
    with pytest.raises(FlatbmaError, match=r"NaN or infinite.*index 2"):
        ArrayDataset(images, torch.tensor([0, 1, 2]), CLASSES)


@pytest.mark.parametrize(
    ("images", "labels", "classes", "message"),
    [
        (torch.zeros(2, 2, 2), torch.tensor([0, 1]), CLASSES, "4-D"),
        (torch.zeros(2, 1, 2, 2, dtype=torch.int32), torch.tensor([0, 1]), CLASSES, "uint8"),
        (torch.full((2, 1, 2, 2), 2.0), torch.tensor([0, 1]), CLASSES, r"\[0, 1\]"),
        (torch.zeros(2, 1, 2, 2), torch.tensor([0.0, 1.0]), CLASSES, "integer"),
        (torch.zeros(2, 1, 2, 2), torch.tensor([[0, 1]]), CLASSES, "1-D"),
        (torch.zeros(2, 1, 2, 2), torch.tensor([0, 1, 2]), CLASSES, "2 images but 3 labels"),
        (torch.zeros(2, 1, 2, 2), torch.tensor([0, 0]), [], "non-empty"),
        (torch.zeros(2, 1, 2, 2), torch.tensor([0, 0]), ["x", "x"], "unique"),
    ],
)
def test_constructor_validation(images, labels, classes, message):
    with pytest.raises(FlatbmaError, match=message):
        ArrayDataset(images, labels, classes)


def test_subset_rejects_bad_indices():
    data = _uint8_data()
    with pytest.raises(FlatbmaError, match=r"out of range"):
        data.subset([6])
    with pytest.raises(FlatbmaError, match=r"boolean mask"):
        data.subset(torch.ones(6, dtype=torch.bool))


def test_splits_must_share_classes():
    data = _uint8_data()
    other = ArrayDataset(data.images, data.labels, ["x", "y", "z"])
    with pytest.raises(FlatbmaError, match=r"class lists differ"):
        DatasetSplits(data, other, "toy")
