import pytest
import torch

from flatbma.data import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    Compose,
    GrayscaleToRGB,
    Normalize,
    RandomCrop,
    RandomHorizontalFlip,
    Resize,
    build_transform,
)
from flatbma.errors import FlatbmaError

IMAGE = torch.arange(12, dtype=torch.float32).view(1, 3, 4) / 12  # [C=1, H=3, W=4]


def test_normalize_exact_values_single_and_batch():
    x = torch.tensor([[[0.5, 1.0]], [[0.0, 0.25]]])  # [2, 1, 2]
    norm = Normalize([0.5, 0.25], [0.5, 0.25])
    expected = torch.tensor([[[0.0, 1.0]], [[-1.0, 0.0]]])
    torch.testing.assert_close(norm(x), expected)
    torch.testing.assert_close(norm(torch.stack([x, x])), torch.stack([expected, expected]))


def test_normalize_channel_mismatch_is_explained():
    with pytest.raises(FlatbmaError, match=r"3 channel statistics but the image has 1.*GrayscaleToRGB"):
        Normalize(IMAGENET_MEAN, IMAGENET_STD)(IMAGE)
    with pytest.raises(FlatbmaError, match=r"one mean and one std per channel"):
        Normalize([0.5, 0.5], [0.5])
    with pytest.raises(FlatbmaError, match=r"positive"):
        Normalize([0.5], [0.0])


def test_flip_exact_and_per_image_in_batch():
    x = torch.tensor([[[1.0, 2.0, 3.0]]])
    torch.testing.assert_close(RandomHorizontalFlip(p=1.0)(x), torch.tensor([[[3.0, 2.0, 1.0]]]))
    torch.testing.assert_close(RandomHorizontalFlip(p=0.0)(x), x)
    batch = torch.arange(64 * 3, dtype=torch.float32).view(64, 1, 1, 3)
    out = RandomHorizontalFlip(p=0.5, generator=torch.Generator().manual_seed(0))(batch)
    flipped = (out != batch).any(dim=(1, 2, 3))
    assert 0 < int(flipped.sum()) < 64
    torch.testing.assert_close(out[flipped], batch[flipped].flip(-1))


def test_random_crop_shapes_padding_and_content():
    generator = torch.Generator().manual_seed(0)
    crop = RandomCrop(2, padding=1, generator=generator)
    assert crop(IMAGE).shape == (1, 2, 2)
    assert crop(torch.stack([IMAGE] * 5)).shape == (5, 1, 2, 2)
    same = RandomCrop(None, padding=2, generator=generator)(IMAGE)
    assert same.shape == IMAGE.shape
    # Every crop of the zero-padded image is a window of it: values come from IMAGE or the zero border.
    assert set(same.flatten().tolist()) <= set(IMAGE.flatten().tolist()) | {0.0}
    torch.testing.assert_close(RandomCrop((3, 4))(IMAGE), IMAGE)
    with pytest.raises(FlatbmaError, match=r"larger than the padded image"):
        RandomCrop(5)(IMAGE)


def test_resize_shapes_and_constant_image():
    assert Resize(6)(IMAGE).shape == (1, 6, 6)
    assert Resize((2, 8))(torch.stack([IMAGE] * 3)).shape == (3, 1, 2, 8)
    constant = torch.full((3, 10, 10), 0.3)
    torch.testing.assert_close(Resize(4)(constant), torch.full((3, 4, 4), 0.3))
    torch.testing.assert_close(Resize((3, 4))(IMAGE), IMAGE)


def test_grayscale_to_rgb():
    rgb = GrayscaleToRGB()(IMAGE)
    assert rgb.shape == (3, 3, 4)
    for c in range(3):
        torch.testing.assert_close(rgb[c], IMAGE[0])
    three = torch.rand(2, 3, 2, 2)
    assert GrayscaleToRGB()(three) is three
    with pytest.raises(FlatbmaError, match=r"1 or 3 channels"):
        GrayscaleToRGB()(torch.rand(2, 2, 2))


def test_compose_and_build_transform():
    pipeline = Compose([GrayscaleToRGB(), Resize(8)])
    assert pipeline(IMAGE).shape == (3, 8, 8)
    transform = build_transform(size=8, to_rgb=True, normalize="imagenet")
    out = transform(torch.zeros(1, 3, 4))
    expected = -torch.tensor(IMAGENET_MEAN) / torch.tensor(IMAGENET_STD)
    torch.testing.assert_close(out[:, 0, 0], expected)
    assert out.shape == (3, 8, 8)
    augmented = build_transform(augment=True, generator=torch.Generator().manual_seed(0))
    assert augmented(torch.rand(4, 1, 8, 8)).shape == (4, 1, 8, 8)
    assert torch.equal(build_transform()(IMAGE), IMAGE)
    with pytest.raises(FlatbmaError, match=r"Did you mean 'imagenet'"):
        build_transform(normalize="imagnet")


def test_default_crop_padding_is_an_eighth_of_the_side():
    """``build_transform(augment=True)`` pads by side/8 (at least 1): crops of an 8×8 image shift by ≤ 1 pixel."""
    image = torch.arange(64.0).reshape(1, 1, 8, 8).repeat(200, 1, 1, 1)
    crop = RandomCrop(None, padding=None, generator=torch.Generator().manual_seed(0))
    out = crop(image)
    # the top-left pixel of a crop shifted by (dy, dx) is image[dy, dx] (or 0 from the padding)
    shifts = {(int(v) // 8, int(v) % 8) for v in out[:, 0, 1, 1]}  # pixel (1, 1) of the crop: never padding
    assert shifts <= {(dy, dx) for dy in range(3) for dx in range(3)} and len(shifts) == 9
    assert build_transform(augment=True).transforms[0].padding is None
    big = RandomCrop(None, padding=None, generator=torch.Generator().manual_seed(0))(torch.zeros(1, 1, 32, 32))
    assert big.shape == (1, 1, 32, 32)
