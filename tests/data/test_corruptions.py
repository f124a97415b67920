import colorsys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import flatbma.data.corruptions as corruptions_module
from flatbma.data import (
    BENCHMARK_CORRUPTIONS,
    CORRUPTIONS,
    ArrayDataset,
    applicable,
    corrupt,
    corrupt_dataset,
    corruption_names,
)
from flatbma.errors import FlatbmaError

ALL = corruption_names()
RANDOM = {
    "gaussian_noise",
    "shot_noise",
    "impulse_noise",
    "speckle_noise",
    "glass_blur",
    "motion_blur",
    "snow",
    "frost",
    "fog",
    "elastic_transform",
}
# Published constants whose severities are not ordered by image change; each has its own test below.
NON_MONOTONE = {"saturate", "glass_blur", "elastic_transform", "pixelate"}
# Published near-ties: motion blur (6, 2) vs (8, 2) differ only in taps of weight < 0.3 %; snow 2 and 3
# have the same blend and about the same snow mass (severity 3 has larger flakes).
NEAR_TIES = {"motion_blur": {3}, "snow": {2}}


def structured(n: int, channels: int, size: int, seed: int = 0) -> torch.Tensor:
    """Smooth random fields mixed with stripes and a disk: image-like content in [0, 1]."""
    g = torch.Generator().manual_seed(seed)
    smooth = F.interpolate(torch.rand(n, channels, 4, 4, generator=g), size=(size, size), mode="bicubic")
    yy, xx = torch.meshgrid(torch.linspace(0, 1, size), torch.linspace(0, 1, size), indexing="ij")
    stripes = (0.5 + 0.4 * torch.sin(xx * 6.28 * 3)).expand(n, channels, size, size)
    disk = (((xx - 0.5) ** 2 + (yy - 0.5) ** 2) < 0.09).float().expand(n, channels, size, size)
    w = torch.rand(n, 3, 1, 1, 1, generator=g)
    w = w / w.sum(1, keepdim=True)
    return (w[:, 0] * smooth.clamp(0, 1) + w[:, 1] * stripes + w[:, 2] * disk).clamp(0, 1)


def mean_abs(x: torch.Tensor, y: torch.Tensor) -> float:
    return float((x - y).abs().mean())


def one_minus_corr(x: torch.Tensor, y: torch.Tensor) -> float:
    """1 - Pearson correlation per image, averaged (the structure term of SSIM)."""
    xf, yf = x.flatten(1), y.flatten(1)
    xf, yf = xf - xf.mean(1, keepdim=True), yf - yf.mean(1, keepdim=True)
    return float(1 - ((xf * yf).sum(1) / (xf.norm(dim=1) * yf.norm(dim=1))).mean())


def distances(name: str, x: torch.Tensor, measure=mean_abs, seed: int = 1) -> list[float]:
    return [measure(x, corrupt(x, name, s, seed=seed)) for s in range(1, 6)]


# ---------------------------------------------------------------------------------------------------
# Names and applicability
# ---------------------------------------------------------------------------------------------------


def test_names_registry_and_applicability():
    assert ALL == list(CORRUPTIONS) and len(ALL) == 18
    assert BENCHMARK_CORRUPTIONS == tuple(ALL[:15]) and "saturate" not in BENCHMARK_CORRUPTIONS
    assert corruption_names(3) == ALL
    assert corruption_names(1) == [n for n in ALL if n != "saturate"]
    assert applicable("saturate", 3) and not applicable("saturate", 1)
    assert applicable("Gaussian-Noise", 1) and not applicable("fog", 4)
    with pytest.raises(FlatbmaError, match="Did you mean 'frost'"):
        applicable("frots", 3)


# ---------------------------------------------------------------------------------------------------
# Shape, dtype, range; determinism
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ALL)
def test_shape_dtype_and_range_are_kept(name):
    g = torch.Generator().manual_seed(0)
    for channels in (1, 3):
        if not applicable(name, channels):
            continue
        batches = [
            structured(3, channels, 16),
            torch.rand(2, channels, 9, 13, generator=g, dtype=torch.float64),  # non-square, float64
            torch.stack([torch.zeros(channels, 8, 8), torch.ones(channels, 8, 8)]),  # extremes, smallest size
        ]
        for x in batches:
            before = x.clone()
            for severity in (1, 3, 5):
                y = corrupt(x, name, severity, seed=severity)
                assert y.shape == x.shape and y.dtype == x.dtype
                assert bool(torch.isfinite(y).all()) and float(y.min()) >= 0.0 and float(y.max()) <= 1.0
            assert torch.equal(x, before), "the input must not be modified"


@pytest.mark.parametrize("name", ALL)
def test_deterministic_per_seed_and_random_draws_differ(name):
    x = structured(4, 3, 16)
    a, b = corrupt(x, name, 3, seed=7), corrupt(x, name, 3, seed=7)
    assert torch.equal(a, b)
    other = corrupt(x, name, 3, seed=8)
    if name in RANDOM:
        assert not torch.equal(a, other)
        # Every image gets its own draws: two copies of one image are corrupted differently.
        twins = corrupt(x[:1].repeat(2, 1, 1, 1), name, 3, seed=7)
        assert not torch.equal(twins[0], twins[1])
    else:
        assert torch.equal(a, other)


def test_empty_batch_and_float16():
    assert corrupt(torch.zeros(0, 3, 8, 8), "fog", 2, seed=0).shape == (0, 3, 8, 8)
    y = corrupt(structured(2, 3, 16).half(), "gaussian_blur", 2, seed=0)
    assert y.dtype == torch.float16


# ---------------------------------------------------------------------------------------------------
# Severity ordering
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", [n for n in ALL if n not in NON_MONOTONE])
@pytest.mark.parametrize("channels", [1, 3])
def test_severity_is_monotone(name, channels):
    # Frost darkens the image by (1 - a) while adding a bright texture; both cancel in the mean absolute
    # difference, so frost is measured by the loss of correlation with the clean image (SSIM's structure
    # term), which grows with the frost-to-image weight ratio b / a = 0.2, 0.3, 0.44, 0.47, 0.6.
    measure = one_minus_corr if name == "frost" else mean_abs
    d = distances(name, structured(16, channels, 16), measure)
    assert d[0] > 1e-3, d
    for s in range(1, 5):
        if s in NEAR_TIES.get(name, set()):
            assert d[s] > 0.9 * d[s - 1], (s, d)
        else:
            assert d[s] > d[s - 1], (s, d)
    assert d[4] > 1.2 * d[0], d


def test_saturate_lowers_then_raises_saturation():
    # Published: x0.3 and x0.1 at severities 1-2, x1.5, x2 + 0.1, x2.5 + 0.2 at 3-5.
    x = structured(16, 3, 16)

    def saturation(img):
        v, m = img.amax(1), img.amin(1)
        return float(((v - m) / v.clamp_min(1e-6)).mean())

    s = [saturation(corrupt(x, "saturate", k, seed=0)) for k in range(1, 6)]
    clean = saturation(x)
    assert s[1] < s[0] < clean < s[2] < s[3] < s[4]
    d = distances("saturate", x)
    assert d[0] < d[1] and d[2] < d[3] < d[4] and d[2] < d[1]


def test_glass_blur_two_passes_shuffle_more():
    # Severities 1-3 share one shuffling pass and differ only in the blur sigma (0.05, 0.25, 0.4), which
    # smooths the shuffled pixels back towards their neighbours; 4-5 shuffle twice.
    for channels in (1, 3):
        d = distances("glass_blur", structured(16, channels, 16))
        assert min(d[3], d[4]) > max(d[:3]), d
        assert max(d[:3]) < 1.2 * min(d[:3]), d


def test_elastic_transform_affine_part_dominates():
    # Published CIFAR constants: the affine shift shrinks (0.08 .. 0.03 of the side) while the elastic
    # field grows from nothing to a small, rough one, so severity 1 moves pixels the most.
    d = distances("elastic_transform", structured(16, 3, 32))
    assert min(d) > 0.02 and d[0] > d[4], d


def test_pixelate_keeps_int_side_times_factor_distinct_rows_and_columns():
    x = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    for severity, kept in zip(range(1, 6), (30, 28, 27, 24, 20)):
        y = corrupt(x, "pixelate", severity, seed=0)
        for image in y:
            assert torch.unique(image, dim=1).shape[1] == kept
            assert torch.unique(image, dim=2).shape[2] == kept


# ---------------------------------------------------------------------------------------------------
# Maths against independent formulas
# ---------------------------------------------------------------------------------------------------


def test_noise_statistics_match_the_published_constants():
    grey = torch.full((40, 3, 16, 16), 0.5)  # 30,720 values per draw
    for severity, std in enumerate((0.04, 0.06, 0.08, 0.09, 0.10), start=1):
        noise = corrupt(grey, "gaussian_noise", severity, seed=0) - grey
        assert abs(float(noise.std()) / std - 1) < 0.03 and abs(float(noise.mean())) < 2e-3
    for severity, photons in enumerate((500, 250, 100, 75, 50), start=1):
        y = corrupt(grey, "shot_noise", severity, seed=0)
        assert abs(float(y.var()) / (0.5 / photons) - 1) < 0.05
        assert torch.allclose(y * photons, (y * photons).round(), atol=1e-3)
    for severity, amount in enumerate((0.01, 0.02, 0.03, 0.05, 0.07), start=1):
        y = corrupt(grey, "impulse_noise", severity, seed=0)
        hit = y != 0.5
        assert abs(float(hit.float().mean()) / amount - 1) < 0.2  # >= 300 hits: 3.5 standard errors
        assert abs(float(y[hit].mean()) - 0.5) < 0.05 and set(y[hit].unique().tolist()) == {0.0, 1.0}
    for severity, std in enumerate((0.06, 0.1, 0.12, 0.16, 0.2), start=1):
        noise = corrupt(grey, "speckle_noise", severity, seed=0) - grey
        assert abs(float(noise.std()) / (0.5 * std) - 1) < 0.03


def test_brightness_and_saturate_match_colorsys_hsv():
    x = torch.rand(1, 3, 8, 8, generator=torch.Generator().manual_seed(3)).double()
    x[0, :, 0, 0] = torch.tensor([0.3, 0.3, 0.3])  # grey pixel: hue 0, so added saturation turns it red
    x[0, :, 0, 1] = 0.0  # black pixel
    pixels = x[0].permute(1, 2, 0).reshape(-1, 3).tolist()

    def reference(change):
        out = []
        for rgb in pixels:
            h, s, v = colorsys.rgb_to_hsv(*rgb)
            out.append(colorsys.hsv_to_rgb(h, *change(s, v)))
        return torch.tensor(out, dtype=torch.float64).reshape(8, 8, 3).permute(2, 0, 1)[None]

    for severity, shift in enumerate((0.05, 0.1, 0.15, 0.2, 0.3), start=1):
        expected = reference(lambda s, v, shift=shift: (s, min(v + shift, 1.0)))
        torch.testing.assert_close(corrupt(x, "brightness", severity, seed=0), expected, atol=1e-6, rtol=0)
    for severity, (a, b) in enumerate(((0.3, 0), (0.1, 0), (1.5, 0), (2, 0.1), (2.5, 0.2)), start=1):
        expected = reference(lambda s, v, a=a, b=b: (min(max(s * a + b, 0.0), 1.0), v))
        torch.testing.assert_close(corrupt(x, "saturate", severity, seed=0), expected, atol=1e-6, rtol=0)
    grey = torch.rand(2, 1, 8, 8, generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(corrupt(grey, "brightness", 5, seed=0), (grey + 0.3).clamp(max=1))


def test_contrast_scales_about_the_per_channel_mean():
    x = structured(2, 3, 16)
    mean = x.mean(dim=(2, 3), keepdim=True)
    torch.testing.assert_close(corrupt(x, "contrast", 2, seed=0), (x - mean) * 0.5 + mean)


def test_gaussian_and_defocus_blur_match_scipy():
    ndimage = pytest.importorskip("scipy.ndimage")
    x = structured(2, 3, 12).double()
    for severity, sigma in enumerate((0.4, 0.6, 0.7, 0.8, 1.0), start=1):
        expected = ndimage.gaussian_filter(x.numpy(), sigma=(0, 0, sigma, sigma), mode="nearest", truncate=4.0)
        torch.testing.assert_close(corrupt(x, "gaussian_blur", severity, seed=0), torch.from_numpy(expected))
    # Severity 4: disk of radius 1 (a plus of 5 pixels) with an anti-alias blur of sigma 0.2 (leaks < 1e-5),
    # filtered like cv2.filter2D with BORDER_REFLECT_101 (scipy's "mirror").
    plus = np.array([[0, 1, 0], [1, 1, 1], [0, 1, 0]], dtype=np.float64)[None, None] / 5
    expected = ndimage.correlate(x.numpy(), plus, mode="mirror")
    torch.testing.assert_close(corrupt(x, "defocus_blur", 4, seed=0), torch.from_numpy(expected), atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", ["gaussian_blur", "defocus_blur", "motion_blur", "zoom_blur", "glass_blur"])
def test_blurs_keep_constant_images(name):
    x = torch.full((2, 3, 12, 10), 0.6)
    for severity in (1, 5):
        # glass_blur quantizes to 8 bits on the way (numpy.uint8 truncation, as published).
        torch.testing.assert_close(corrupt(x, name, severity, seed=0), x, atol=1 / 255, rtol=0)


def test_motion_blur_is_a_one_sided_trail_within_45_degrees():
    x = torch.zeros(16, 1, 41, 41)
    x[:, :, 20, 20] = 1.0
    y = corrupt(x, "motion_blur", 5, seed=0)  # radius 9: 19 taps, sigma 2.5
    torch.testing.assert_close(y.sum(dim=(1, 2, 3)), torch.ones(16), atol=1e-5, rtol=0)
    rows, cols = torch.nonzero(y[:, 0] > 0, as_tuple=True)[1:]
    d_row, d_col = 20 - rows, 20 - cols  # the pixel that reads the impulse sits at minus the tap offset
    assert bool((d_col >= 0).all()) and bool((d_row.abs() <= d_col).all()) and int(d_col.max()) <= 18


def test_large_batches_match_small_ones():
    # Deterministic corruptions process each image alone: big batches (BLAS path) equal small ones.
    x = structured(24, 3, 32)
    for name in ("zoom_blur", "pixelate", "gaussian_blur", "jpeg_compression"):
        torch.testing.assert_close(corrupt(x, name, 5, seed=0)[:2], corrupt(x[:2], name, 5, seed=0))


def test_jpeg_output_is_8_bit_and_worse_at_lower_quality():
    x = structured(8, 3, 16)
    y = corrupt(x, "jpeg_compression", 3, seed=0)
    torch.testing.assert_close(y * 255, (y * 255).round(), atol=1e-4, rtol=0)
    assert corrupt(x[:, :1], "jpeg_compression", 1, seed=0).shape == (8, 1, 16, 16)


def test_fog_and_frost_and_snow_brighten_or_veil_black_images():
    black = torch.zeros(4, 3, 16, 16)
    assert float(corrupt(black, "fog", 3, seed=0).max()) == 0.0  # published: scaled by max(x) / (max(x) + c)
    frost = corrupt(black, "frost", 5, seed=0)
    assert 0.1 < float(frost.mean()) < 0.35 and float(frost[:, 2].mean()) > float(frost[:, 0].mean())
    assert float(corrupt(black, "snow", 5, seed=0).mean()) > 0.1


# ---------------------------------------------------------------------------------------------------
# Datasets
# ---------------------------------------------------------------------------------------------------


def test_corrupt_dataset_keeps_labels_classes_transform_and_storage(monkeypatch):
    images = (structured(7, 3, 16) * 255).round().to(torch.uint8)
    labels = torch.tensor([0, 1, 2, 0, 1, 2, 0])
    ds = ArrayDataset(images, labels, ["a", "b", "c"], transform=lambda t: t * 2)
    monkeypatch.setattr(corruptions_module, "DATASET_CHUNK", 3)
    out = corrupt_dataset(ds, "gaussian_noise", 5, 11)
    assert out.images.dtype == torch.uint8 and out.images.shape == images.shape
    assert torch.equal(out.labels, labels) and out.classes == ds.classes and out.transform is ds.transform
    assert not torch.equal(out.images, images) and torch.equal(ds.images, images)
    assert torch.equal(corrupt_dataset(ds, "gaussian_noise", 5, 11).images, out.images)
    assert not torch.equal(corrupt_dataset(ds, "gaussian_noise", 5, 12).images, out.images)
    image, label = out[4]
    torch.testing.assert_close(image, out.images[4].float() / 255 * 2)
    assert label == 1
    # Chunks get their own seeds: equal images in different chunks are corrupted differently.
    same = ArrayDataset(images[:1].repeat(7, 1, 1, 1), labels, ["a", "b", "c"])
    noisy = corrupt_dataset(same, "gaussian_noise", 5, 0).images
    assert not torch.equal(noisy[0], noisy[3])
    # Deterministic corruptions of 8-bit data equal the rounded float result.
    blurred = corrupt_dataset(same, "gaussian_blur", 2, 0).images
    assert torch.equal(blurred, (corrupt(same.images.float() / 255, "gaussian_blur", 2, seed=0) * 255).round().byte())


def test_corrupt_dataset_float_storage_and_grey_saturate():
    ds = ArrayDataset(structured(4, 1, 12), torch.zeros(4, dtype=torch.int64), ["only"])
    out = corrupt_dataset(ds, "fog", 2, 0)
    assert out.images.dtype == torch.float32 and not torch.equal(out.images, ds.images)
    with pytest.raises(FlatbmaError, match="needs RGB"):
        corrupt_dataset(ds, "saturate", 1, 0)
    with pytest.raises(FlatbmaError, match="ArrayDataset"):
        corrupt_dataset(ds.images, "fog", 1, 0)


# ---------------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------------


def test_unknown_names_and_aliases():
    x = structured(1, 3, 8)
    with pytest.raises(FlatbmaError, match=r"unknown corruption 'gausian_noise'\. Did you mean 'gaussian_noise'"):
        corrupt(x, "gausian_noise", 1, seed=0)
    with pytest.raises(FlatbmaError, match="Known corruptions: gaussian_noise"):
        corrupt(x, "blizzard", 1, seed=0)
    with pytest.raises(FlatbmaError, match="must be a string"):
        corrupt(x, 3, 1, seed=0)
    assert torch.equal(corrupt(x, "JPEG", 2, seed=0), corrupt(x, "jpeg_compression", 2, seed=0))
    assert torch.equal(corrupt(x, "Gaussian Noise", 2, seed=0), corrupt(x, "gaussian-noise", 2, seed=0))


@pytest.mark.parametrize("severity", [0, 6, -1, 2.0, True, "3", None])
def test_bad_severity(severity):
    with pytest.raises(FlatbmaError, match="severity must be an integer from 1 to 5"):
        corrupt(structured(1, 3, 8), "fog", severity, seed=0)


@pytest.mark.parametrize("seed", [-1, 2**63, 1.5, "0", None])
def test_bad_seed(seed):
    with pytest.raises(FlatbmaError, match="seed"):
        corrupt(structured(1, 3, 8), "fog", 1, seed=seed)


@pytest.mark.parametrize(
    ("images", "message"),
    [
        (np.zeros((1, 3, 8, 8), dtype=np.float32), "torch.Tensor"),
        (torch.zeros(3, 8, 8), "unsqueeze"),
        (torch.zeros(1, 3, 8, 8, dtype=torch.uint8), "float"),
        (torch.zeros(1, 2, 8, 8), "1 \\(grey\\) or 3 \\(RGB\\) channels"),
        (torch.zeros(1, 3, 7, 8), "at least 8x8"),
        (torch.full((1, 3, 8, 8), 1.5), "\\[0, 1\\]"),
        (torch.full((1, 3, 8, 8), -0.1), "\\[0, 1\\]"),
        (torch.full((1, 3, 8, 8), float("nan")), "NaN"),
        (torch.zeros(1, 1, 8, 8), "needs RGB"),
    ],
)
def test_bad_images(images, message):
    with pytest.raises(FlatbmaError, match=message):
        corrupt(images, "saturate", 1, seed=0)
