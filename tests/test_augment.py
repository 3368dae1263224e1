"""Augmentation ops against independent numpy (float64) and plain-PIL references."""

from __future__ import annotations

import math
import pickle

import ml_collections
import numpy as np
import pytest
from PIL import Image

from skipless_jax.data import augment, randaugment, random_erasing, transforms

MEAN, STD = transforms.IMAGENET_MEAN, transforms.IMAGENET_STD


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def _smooth_image(height: int, width: int) -> np.ndarray:
    """A known, deterministic RGB image: smooth sinusoids and ramps (no bicubic overshoot)."""
    i = np.arange(height, dtype=np.float64)[:, None]
    j = np.arange(width, dtype=np.float64)[None, :]
    channels = [
        127.5 + 60 * np.sin(2 * np.pi * i / 37.0) + 60 * np.cos(2 * np.pi * j / 53.0),
        255.0 * (i + j) / (height + width),
        127.5 + 100 * np.sin(2 * np.pi * (i + 2 * j) / 97.0),
    ]
    return np.clip(np.round(np.stack(channels, -1)), 0, 255).astype(np.uint8)


def _noise_image(height: int, width: int, seed: int = 0) -> np.ndarray:
    return _rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def _deit_aug(**overrides) -> ml_collections.ConfigDict:
    fields = dict(randaug="rand-m9-mstd0.5-inc1", scale=(0.08, 1.0), flip=True, reprob=0.25,
                  mixup=0.8, cutmix=1.0, mixup_switch_prob=0.5)
    fields.update(overrides)
    return ml_collections.ConfigDict(fields)


# ------------------------------------------------------------------------------------------
# A float64 reimplementation of Pillow's separable bicubic resampling (a = −0.5, antialiased
# support scaled by the downscale factor, horizontal pass then vertical, 8-bit in between).


def _cubic(x: np.ndarray, a: float = -0.5) -> np.ndarray:
    x = np.abs(x)
    return np.where(x < 1, ((a + 2) * x - (a + 3)) * x * x + 1,
                    np.where(x < 2, ((a * x - 5 * a) * x + 8 * a) * x - 4 * a, 0.0))


def _resample_axis(x: np.ndarray, out_size: int, axis: int) -> np.ndarray:
    x = np.moveaxis(x.astype(np.float64), axis, 0)
    in_size = x.shape[0]
    scale = in_size / out_size
    filterscale = max(scale, 1.0)
    support = 2.0 * filterscale
    rows = []
    for i in range(out_size):
        center = (i + 0.5) * scale
        lo = max(int(center - support + 0.5), 0)
        hi = min(int(center + support + 0.5), in_size)
        w = _cubic((np.arange(lo, hi) - center + 0.5) / filterscale)
        rows.append(np.tensordot(w / w.sum(), x[lo:hi], axes=1))
    out = np.clip(np.round(np.stack(rows)), 0, 255)
    return np.moveaxis(out, 0, axis)


def _bicubic_reference(image: np.ndarray, out_h: int, out_w: int) -> np.ndarray:
    out = image.astype(np.float64)
    if out_w != image.shape[1]:
        out = _resample_axis(out, out_w, 1)
    if out_h != image.shape[0]:
        out = _resample_axis(out, out_h, 0)
    return out


# ------------------------------------------------------------------------------------------
# Eval geometry.


def test_eval_resize_center_crop_equals_explicit_pil_on_known_image():
    image = _smooth_image(375, 500)
    out = transforms.resize_center_crop(image, 224, crop_pct=0.875)
    # 224 / 0.875 = 256: shorter side 375 → 256, longer int(256·500/375) = 341; the centre
    # crop starts at round((256−224)/2) = 16 rows and round((341−224)/2) = round(58.5) = 58.
    expected = np.asarray(
        Image.fromarray(image).resize((341, 256), Image.Resampling.BICUBIC).crop((58, 16, 282, 240)))
    assert out.dtype == np.uint8 and out.shape == (224, 224, 3)
    np.testing.assert_array_equal(out, expected)
    reference = _bicubic_reference(image, 256, 341)[16:240, 58:282]
    assert np.max(np.abs(out.astype(np.float64) - reference)) <= 1


def test_eval_portrait_and_identity():
    portrait = _smooth_image(500, 333)
    out = transforms.resize_center_crop(portrait, 224, crop_pct=0.875)
    # shorter side 333 → 256, longer int(256·500/333) = 384; crop rows round(80) = 80.
    expected = np.asarray(Image.fromarray(portrait).resize((256, 384), Image.Resampling.BICUBIC))
    np.testing.assert_array_equal(out, expected[80:304, 16:240])
    odd = _smooth_image(375, 503)  # longer side int(343.38) = 343: left = round(59.5) = 60, not 59
    expected = np.asarray(Image.fromarray(odd).resize((343, 256), Image.Resampling.BICUBIC))
    np.testing.assert_array_equal(transforms.resize_center_crop(odd, 224), expected[16:240, 60:284])
    small = _noise_image(32, 32)  # CIFAR at its own size with crop_pct 1: untouched
    np.testing.assert_array_equal(transforms.resize_center_crop(small, 32, crop_pct=1.0), small)


def test_eval_transform_normalizes_the_crop():
    image = _smooth_image(375, 500)
    out = augment.eval_transform(224, 0.875, MEAN, STD)(image)
    crop = transforms.resize_center_crop(image, 224).astype(np.float64)
    reference = (crop / 255.0 - np.array(MEAN)) / np.array(STD)
    assert out.dtype == np.float32 and out.shape == (224, 224, 3)
    np.testing.assert_allclose(out, reference, atol=2e-6)


def test_normalize_matches_float64_reference():
    image = _noise_image(7, 5)
    mean, std = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
    out = transforms.normalize(image, mean, std)
    reference = (image / 255.0 - np.array(mean)) / np.array(std)
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, reference, atol=2e-6)
    np.testing.assert_array_equal(out, transforms.normalize(image.astype(np.float32), mean, std))
    with pytest.raises(ValueError, match="one entry per channel"):
        transforms.normalize(image, (0.5,), (0.5,))


# ------------------------------------------------------------------------------------------
# Random resized crop and flip.


def test_random_resized_crop_box_within_scale_and_ratio():
    height, width = 375, 500
    fractions, aspects = [], []
    for seed in range(400):
        top, left, h, w = transforms.random_resized_crop_box(height, width, _rng(seed))
        assert top >= 0 and top + h <= height and left >= 0 and left + w <= width
        # rounding h and w to integers moves the area by at most (h + w)/2 + 1/4 pixels
        slack = (0.5 * (h + w) + 0.25) / (height * width)
        fractions.append(h * w / (height * width))
        assert 0.08 - slack <= fractions[-1] <= 1.0 + slack
        aspects.append(w / h)
        assert (3 / 4) * (1 - 1 / h) / (1 + 1 / w) <= aspects[-1] <= (4 / 3) * (1 + 1 / w) / (1 - 1 / h)
    assert min(fractions) < 0.1 and max(fractions) > 0.7  # the whole range is used
    assert min(aspects) < 0.8 and max(aspects) > 1.25


def test_random_resized_crop_box_fallback_is_clamped_centre_crop():
    # No 10×10 image holds a crop of area 1 with w/h = 2: fall back to the centre crop at w/h = 2.
    assert transforms.random_resized_crop_box(10, 10, _rng(0), (1.0, 1.0), (2.0, 2.0)) == (2, 0, 5, 10)
    assert transforms.random_resized_crop_box(10, 40, _rng(0), (1.0, 1.0), (1.0, 1.0)) == (0, 15, 10, 10)


def test_random_resized_crop_equals_pil_crop_then_bicubic_resize():
    image = _smooth_image(375, 500)
    for seed in range(5):
        out = transforms.random_resized_crop(image, _rng(seed), 224)
        top, left, h, w = transforms.random_resized_crop_box(375, 500, _rng(seed))
        expected = np.asarray(Image.fromarray(image[top:top + h, left:left + w]).resize(
            (224, 224), Image.Resampling.BICUBIC))
        assert out.dtype == np.uint8 and out.shape == (224, 224, 3)
        np.testing.assert_array_equal(out, expected)


def test_random_pad_crop_is_a_window_of_the_zero_padded_image():
    image = _noise_image(32, 32)
    padded = np.pad(image, ((4, 4), (4, 4), (0, 0)))
    offsets = set()
    for seed in range(300):
        out = transforms.random_pad_crop(image, _rng(seed), 32, padding=4)
        rng = _rng(seed)
        top, left = int(rng.integers(0, 9)), int(rng.integers(0, 9))
        np.testing.assert_array_equal(out, padded[top:top + 32, left:left + 32])
        offsets.add((top, left))
    assert len(offsets) > 70  # most of the 9 × 9 offsets occur
    np.testing.assert_array_equal(transforms.random_pad_crop(image, _rng(0), 32, padding=0), image)
    with pytest.raises(ValueError, match="smaller than the crop 48"):
        transforms.random_pad_crop(image, _rng(0), 48, padding=4)


def test_random_flip_mirrors_half_the_time():
    image = _noise_image(4, 6)
    flipped = 0
    for seed in range(400):
        out = transforms.random_flip(image, _rng(seed))
        if np.array_equal(out, image[:, ::-1]):
            flipped += 1
        else:
            np.testing.assert_array_equal(out, image)
    assert 160 <= flipped <= 240  # Binomial(400, 0.5): ±4 σ


# ------------------------------------------------------------------------------------------
# RandAugment.


def test_randaug_op_lists_are_timms():
    assert len(randaugment.RAND_INCREASING_OPS) == len(randaugment.RAND_OPS) == 15
    assert "Cutout" not in randaugment.RAND_INCREASING_OPS
    for name in randaugment.RAND_OPS + randaugment.RAND_INCREASING_OPS:
        assert name in randaugment.LEVEL_TO_ARG and name in randaugment.APPLY_OP


@pytest.mark.parametrize("name, magnitude, expected", [
    ("Rotate", 9, 27.0),
    ("ShearX", 9, 0.27),
    ("ShearY", 5, 0.15),
    ("TranslateXRel", 9, 0.405),
    ("TranslateYRel", 10, 0.45),
    ("PosterizeIncreasing", 9, 1),  # keeps 4 − int(3.6) = 1 bit
    ("PosterizeIncreasing", 10, 0),
    ("Posterize", 9, 3),
    ("SolarizeIncreasing", 9, 26),  # threshold 256 − int(230.4)
    ("Solarize", 9, 230),
    ("SolarizeAdd", 9, 99),
    ("Color", 9, 1.72),
    ("Sharpness", 0, 0.1),
])
def test_randaug_level_to_arg(name, magnitude, expected):
    ctx = randaugment.OpContext((124, 116, 104), Image.Resampling.BICUBIC, 0.45)
    args = {randaugment.LEVEL_TO_ARG[name](magnitude, _rng(seed), ctx) for seed in range(20)}
    signed = name.startswith(("Rotate", "Shear", "Translate"))
    want = {expected, -expected} if signed else {expected}
    assert len(args) == len(want)
    for arg, value in zip(sorted(args), sorted(want), strict=True):
        assert arg == pytest.approx(value)


def test_randaug_increasing_enhance_is_one_plus_or_minus():
    ctx = randaugment.OpContext((124, 116, 104), Image.Resampling.BICUBIC, 0.45)
    for name in ("ColorIncreasing", "ContrastIncreasing", "BrightnessIncreasing", "SharpnessIncreasing"):
        args = sorted({round(randaugment.LEVEL_TO_ARG[name](9, _rng(s), ctx), 12) for s in range(20)})
        assert args == pytest.approx([0.19, 1.81])


def test_pixel_ops_match_numpy_references():
    image = _noise_image(16, 12)
    pil = Image.fromarray(image)
    x = image.astype(np.int64)
    np.testing.assert_array_equal(np.asarray(randaugment.invert(pil)), 255 - x)
    np.testing.assert_array_equal(np.asarray(randaugment.solarize(pil, 26)), np.where(x >= 26, 255 - x, x))
    np.testing.assert_array_equal(np.asarray(randaugment.solarize(pil, 256)), x)
    np.testing.assert_array_equal(np.asarray(randaugment.solarize_add(pil, 99)),
                                  np.where(x < 128, np.minimum(x + 99, 255), x))
    for bits in range(0, 9):
        keep = (0xFF << (8 - bits)) & 0xFF
        np.testing.assert_array_equal(np.asarray(randaugment.posterize(pil, bits)), x & keep)
    low = (image // 2 + 40).astype(np.uint8)  # range [40, 167]: autocontrast stretches it
    lo, hi = low.min((0, 1)).astype(np.float64), low.max((0, 1)).astype(np.float64)
    stretched = np.floor((low - lo) * 255.0 / (hi - lo))
    np.testing.assert_array_equal(np.asarray(randaugment.auto_contrast(Image.fromarray(low))), stretched)
    bright = np.asarray(randaugment.brightness(pil, 0.5)).astype(np.float64)
    assert np.max(np.abs(bright - x * 0.5)) <= 1.0
    narrow = (_noise_image(64, 64) // 4 + 60).astype(np.uint8)  # values 60..123
    equalized = np.asarray(randaugment.equalize(Image.fromarray(narrow)))
    for c in range(3):  # a monotone per-channel map spreading the values over [0, 255]
        order = np.argsort(narrow[..., c], axis=None, kind="stable")
        assert np.all(np.diff(equalized[..., c].ravel()[order].astype(int)) >= 0)
        assert equalized[..., c].min() <= 5 and equalized[..., c].max() >= 245


def test_geometric_ops_shift_and_fill():
    image = _noise_image(20, 30)
    pil, fill = Image.fromarray(image), (124, 116, 104)
    moved = np.asarray(randaugment.translate_x(pil, 5, fill))  # out(x) = in(x + 5)
    np.testing.assert_array_equal(moved[:, :25], image[:, 5:])
    assert np.all(moved[:, 25:] == np.array(fill, np.uint8))
    moved = np.asarray(randaugment.translate_y(pil, -3, fill))  # out(y) = in(y − 3)
    np.testing.assert_array_equal(moved[3:], image[:17])
    assert np.all(moved[:3] == np.array(fill, np.uint8))
    white = Image.fromarray(np.full((64, 64, 3), 255, np.uint8))
    rotated = np.asarray(randaugment.rotate(white, 45.0, fill))
    np.testing.assert_array_equal(rotated[0, 0], fill)  # uncovered corner: the fill colour
    np.testing.assert_array_equal(rotated[32, 32], (255, 255, 255))
    sheared = np.asarray(randaugment.shear_x(white, 0.3, fill))  # out(x, y) = in(x + 0.3 y, y)
    np.testing.assert_array_equal(sheared[63, 63], fill)
    np.testing.assert_array_equal(sheared[0, 63], (255, 255, 255))


def test_rand_augment_shapes_determinism_and_identity():
    image = _smooth_image(48, 40)
    out = randaugment.rand_augment(image, _rng(3))
    assert out.dtype == np.uint8 and out.shape == image.shape
    np.testing.assert_array_equal(out, randaugment.rand_augment(image, _rng(3)))
    distinct = {randaugment.rand_augment(image, _rng(s)).tobytes() for s in range(12)}
    assert len(distinct) >= 6  # P(no op fires) = 1/4 per seed
    np.testing.assert_array_equal(randaugment.rand_augment(image, _rng(0), num_layers=0), image)


def test_rand_augment_applies_each_chosen_op_with_probability_half():
    image = (_smooth_image(48, 40) // 2 + 60).astype(np.uint8)  # mid-range: every op changes it
    changed = sum(not np.array_equal(randaugment.rand_augment(image, _rng(s), num_layers=1), image)
                  for s in range(400))
    assert 160 <= changed <= 240  # Binomial(400, 0.5): ±4 σ
    assert randaugment.mean_fill(MEAN) == (124, 116, 104)  # DeiT's fill colour, round(255·mean)


def test_parse_randaug():
    spec = randaugment.parse_randaug("rand-m9-mstd0.5-inc1")
    assert spec == randaugment.RandAugmentSpec(num_layers=2, magnitude=9.0, magnitude_std=0.5,
                                           magnitude_max=10.0, increasing=True)
    assert randaugment.parse_randaug("rand-n3-m7").num_layers == 3
    assert randaugment.parse_randaug("rand-mstd101").magnitude_std == math.inf
    with pytest.raises(ValueError, match="must be a string starting with 'rand'"):
        randaugment.parse_randaug("auto-m9")
    with pytest.raises(ValueError, match="unknown section 'w0'"):
        randaugment.parse_randaug("rand-m9-w0")
    with pytest.raises(ValueError, match="bad value '9x' in section 'm9x'"):
        randaugment.parse_randaug("rand-m9x")
    with pytest.raises(ValueError, match=r"m=12 must be in \[0, 10\]"):
        randaugment.parse_randaug("rand-m12")


# ------------------------------------------------------------------------------------------
# Random erasing.


def test_random_erasing_box_area_and_aspect_within_bounds():
    height, width = 224, 224
    fractions, aspects = [], []
    for seed in range(500):
        box = random_erasing.random_erasing_box(height, width, _rng(seed))
        assert box is not None
        top, left, h, w = box
        assert top >= 0 and top + h <= height and left >= 0 and left + w <= width
        slack = (0.5 * (h + w) + 0.25) / (height * width)
        fractions.append(h * w / (height * width))
        assert 0.02 - slack <= fractions[-1] <= 1 / 3 + slack
        aspects.append(h / w)
        assert 0.3 * (1 - 0.5 / h) / (1 + 0.5 / w) <= aspects[-1] <= (1 / 0.3) * (1 + 0.5 / h) / (1 - 0.5 / w)
    assert min(fractions) < 0.03 and max(fractions) > 0.3
    assert min(aspects) < 0.4 and max(aspects) > 2.5


def test_random_erasing_replaces_exactly_its_box_with_noise():
    image = transforms.normalize(_noise_image(56, 64), MEAN, STD)
    for seed in range(10):
        out = random_erasing.random_erasing(image, _rng(seed), prob=1.0)
        rng = _rng(seed)
        rng.random()  # the apply/skip draw comes first
        top, left, h, w = random_erasing.random_erasing_box(56, 64, rng)
        mask = np.zeros((56, 64), bool)
        mask[top:top + h, left:left + w] = True
        assert out.dtype == np.float32
        np.testing.assert_array_equal(out[~mask], image[~mask])
        assert np.all(out[mask] != image[mask])
        assert abs(out[mask].mean()) < 0.2 and 0.8 < out[mask].std() < 1.2  # N(0, 1) per pixel
    chw = np.moveaxis(image, -1, 0)
    out_chw = random_erasing.random_erasing(chw, _rng(0), prob=1.0, channels_last=False)
    np.testing.assert_array_equal(np.moveaxis(out_chw, 0, -1), random_erasing.random_erasing(image, _rng(0), prob=1.0))
    np.testing.assert_array_equal(random_erasing.random_erasing(image, _rng(0), prob=0.0), image)
    erased = sum(not np.array_equal(random_erasing.random_erasing(image, _rng(s), prob=0.25), image)
                 for s in range(400))
    assert 65 <= erased <= 135  # Binomial(400, 0.25): ±4 σ


# ------------------------------------------------------------------------------------------
# Config validation and the composed transforms.


@pytest.mark.parametrize("field, value, message", [
    ("randaug", "rand-m11", r"aug.randaug='rand-m11': m=11 must be in \[0, 10\]"),
    ("randaug", 3, r"aug.randaug=3; must be None or a string"),
    ("scale", (0.0, 1.0), r"aug.scale=\(0.0, 1.0\); must be \(lo, hi\) with 0 < lo <= hi <= 1"),
    ("scale", (0.9, 0.5), r"aug.scale=\(0.9, 0.5\)"),
    ("flip", 1, r"aug.flip=1; must be True or False"),
    ("reprob", 1.5, r"aug.reprob=1.5; must be a number in \[0, 1\]"),
    ("mixup", -0.1, r"aug.mixup=-0.1; must be a Beta alpha >= 0"),
    ("cutmix", "1", r"aug.cutmix='1'; must be a Beta alpha >= 0"),
    ("mixup_switch_prob", 2.0, r"aug.mixup_switch_prob=2.0"),
    ("label_smoothing", 0.1, r"aug.label_smoothing=0.1 is not used; set config.label_smoothing instead"),
])
def test_validate_aug_config_names_the_bad_field(field, value, message):
    augment.validate_aug_config(_deit_aug())
    with pytest.raises(ValueError, match=message):
        augment.validate_aug_config(_deit_aug(**{field: value}))


def test_validate_aug_config_missing_field_and_optional_ones():
    config = _deit_aug()
    del config["reprob"]
    with pytest.raises(ValueError, match="aug.reprob is missing"):
        augment.validate_aug_config(config)
    with pytest.raises(ValueError, match=r"aug.ratio=\(2.0, 1.0\)"):
        augment.validate_aug_config(_deit_aug(ratio=(2.0, 1.0)))
    with pytest.raises(ValueError, match=r"aug.mixup_prob=-1"):
        augment.validate_aug_config(_deit_aug(mixup_prob=-1))
    with pytest.raises(ValueError, match=r"aug.crop='center' is unknown; allowed: \['rrc', 'pad'\]"):
        augment.validate_aug_config(_deit_aug(crop="center"))
    with pytest.raises(ValueError, match=r"aug.crop_padding=-1; must be an int >= 0"):
        augment.validate_aug_config(_deit_aug(crop="pad", crop_padding=-1))
    augment.validate_aug_config(_deit_aug(randaug=None, mixup=0.0, cutmix=0.0, reprob=0.0))


def test_train_transform_shapes_ranges_determinism_and_pickle():
    transform = augment.train_transform(_deit_aug(), 32, MEAN, STD)
    image = _smooth_image(50, 60)
    out = transform(image, _rng(7))
    assert out.dtype == np.float32 and out.shape == (32, 32, 3)
    # normalized uint8 lies in [(0 − mean)/std, (1 − mean)/std]; erasing noise is N(0, 1)
    assert np.all(np.isfinite(out)) and np.all(np.abs(out) < 10)
    np.testing.assert_array_equal(out, transform(image, _rng(7)))
    assert not np.array_equal(out, transform(image, _rng(8)))
    restored = pickle.loads(pickle.dumps(transform))  # grain worker processes pickle it
    np.testing.assert_array_equal(out, restored(image, _rng(7)))


def test_train_transform_without_extras_is_crop_then_normalize():
    config = _deit_aug(randaug=None, flip=False, reprob=0.0, scale=(0.5, 1.0))
    transform = augment.train_transform(config, 24, MEAN, STD)
    image = _smooth_image(40, 30)
    expected = transforms.normalize(transforms.random_resized_crop(image, _rng(1), 24, (0.5, 1.0)), MEAN, STD)
    np.testing.assert_array_equal(transform(image, _rng(1)), expected)


def test_train_transform_pad_crop_mode():
    config = _deit_aug(randaug=None, flip=False, reprob=0.0, crop="pad", crop_padding=4)
    image = _noise_image(32, 32)
    out = augment.train_transform(config, 32, MEAN, STD)(image, _rng(5))
    expected = transforms.normalize(transforms.random_pad_crop(image, _rng(5), 32, 4), MEAN, STD)
    np.testing.assert_array_equal(out, expected)


