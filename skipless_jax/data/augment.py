"""Image augmentation on the host: the DeiT train recipe and the resize/centre-crop eval.

Everything here is numpy + PIL and runs inside the input pipeline's map workers. Every
random choice is drawn from the `np.random.Generator` passed in, so an image's
augmentation depends only on that generator's seed (the pipeline derives it from
(seed, step, example index)); there is no global random state.

Semantics follow timm as DeiT used it (docs/method.md §1 recipe; the papers' ImageNet runs):
random resized crop (bicubic) → horizontal flip → RandAugment 'rand-m9-mstd0.5-inc1'
(bicubic, fill = the mean colour) → normalize → random erasing ('pixel', p 0.25) per
example, then mixup 0.8 / cutmix 1.0 (switch 0.5, 'batch' mode) with label smoothing 0.1
per batch. Eval: resize the shorter side to floor(size / crop_pct) (bicubic), centre crop.
Small images (CIFAR) may replace the random resized crop by zero-pad + random crop
(`aug.crop='pad'`).

Images are uint8 (H, W, 3) RGB until `normalize`, float32 (H, W, 3) after it; batches are
(B, H, W, 3).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from PIL import Image, ImageEnhance, ImageOps

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
DEFAULT_CROP_PCT = 0.875

Box = tuple[int, int, int, int]  # (top, left, height, width)

_BICUBIC = Image.Resampling.BICUBIC


def _check_uint8_image(image: np.ndarray, name: str) -> None:
    if not isinstance(image, np.ndarray) or image.dtype != np.uint8:
        kind = getattr(image, "dtype", type(image).__name__)
        raise ValueError(f"{name}: expected a uint8 numpy image, got {kind}")
    if image.ndim != 3 or image.shape[-1] != 3 or min(image.shape[:2]) < 1:
        raise ValueError(f"{name}: expected shape (H, W, 3), got {image.shape}")


def _check_size(size: int, name: str) -> None:
    if not isinstance(size, (int, np.integer)) or isinstance(size, bool) or size < 1:
        raise ValueError(f"{name}: size={size!r}; must be a positive int")


# ----------------------------------------------------------------------------------------
# Crops, flips, normalization.


def random_resized_crop_box(
    height: int,
    width: int,
    rng: np.random.Generator,
    scale: tuple[float, float] = (0.08, 1.0),
    ratio: tuple[float, float] = (3 / 4, 4 / 3),
) -> Box:
    """Draws the crop box of `random_resized_crop` (torchvision/timm semantics).

    Ten tries of area ~ U(scale)·H·W and aspect w/h ~ logU(ratio); a box that fits is
    placed uniformly. Otherwise the fallback is the centre crop of the whole image,
    clamped to the ratio range.

    Returns:
        (top, left, h, w) in pixels, with 1 <= h <= height and 1 <= w <= width.
    """
    area = height * width
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target_area = area * rng.uniform(scale[0], scale[1])
        aspect = math.exp(rng.uniform(log_ratio[0], log_ratio[1]))
        w = int(round(math.sqrt(target_area * aspect)))
        h = int(round(math.sqrt(target_area / aspect)))
        if 0 < w <= width and 0 < h <= height:
            top = int(rng.integers(0, height - h + 1))
            left = int(rng.integers(0, width - w + 1))
            return top, left, h, w
    in_ratio = width / height
    if in_ratio < min(ratio):
        w, h = width, int(round(width / min(ratio)))
    elif in_ratio > max(ratio):
        w, h = int(round(height * max(ratio))), height
    else:
        w, h = width, height
    h, w = max(h, 1), max(w, 1)
    return (height - h) // 2, (width - w) // 2, h, w


def random_resized_crop(
    image: np.ndarray,
    rng: np.random.Generator,
    size: int,
    scale: tuple[float, float] = (0.08, 1.0),
    ratio: tuple[float, float] = (3 / 4, 4 / 3),
) -> np.ndarray:
    """Random resized crop: crop the box of `random_resized_crop_box`, resize bicubic.

    Args:
        image: uint8 (H, W, 3).
        size: output side length.

    Returns:
        uint8 (size, size, 3).
    """
    _check_uint8_image(image, "random_resized_crop")
    _check_size(size, "random_resized_crop")
    top, left, h, w = random_resized_crop_box(image.shape[0], image.shape[1], rng, scale, ratio)
    # Crop first, then resize: the resampling filter must not read pixels outside the box.
    crop = Image.fromarray(np.ascontiguousarray(image[top:top + h, left:left + w]))
    return np.asarray(crop.resize((size, size), _BICUBIC))


def random_pad_crop(image: np.ndarray, rng: np.random.Generator, size: int, padding: int = 4) -> np.ndarray:
    """Zero-pad by `padding` on every side, then a uniform (size, size) window (CIFAR style).

    torchvision's RandomCrop(size, padding): the window's top-left is uniform over all
    positions inside the padded image.

    Returns:
        (size, size, C) of the input dtype.
    """
    _check_size(size, "random_pad_crop")
    padded = np.pad(image, ((padding, padding), (padding, padding), (0, 0)))
    height, width = padded.shape[:2]
    if height < size or width < size:
        raise ValueError(f"random_pad_crop: padded image {height}x{width} is smaller than the crop {size}")
    top = int(rng.integers(0, height - size + 1))
    left = int(rng.integers(0, width - size + 1))
    return padded[top:top + size, left:left + size]


def random_flip(image: np.ndarray, rng: np.random.Generator, prob: float = 0.5) -> np.ndarray:
    """Mirrors an (H, W, C) image left-right with probability `prob`."""
    if rng.random() < prob:
        return image[:, ::-1]
    return image


def resize_shorter_side(image: np.ndarray, size: int) -> np.ndarray:
    """Bicubic resize so the shorter side is `size`; the longer is int(size·long/short).

    The rounding down of the longer side is torchvision's `Resize(int)` rule.
    """
    _check_uint8_image(image, "resize_shorter_side")
    _check_size(size, "resize_shorter_side")
    height, width = image.shape[:2]
    if height <= width:
        new_h, new_w = size, int(size * width / height)
    else:
        new_h, new_w = int(size * height / width), size
    return np.asarray(Image.fromarray(image).resize((new_w, new_h), _BICUBIC))


def center_crop(image: np.ndarray, size: int) -> np.ndarray:
    """Centre (size, size) crop; offsets int(round((H - size)/2)) as torchvision's CenterCrop."""
    height, width = image.shape[:2]
    if height < size or width < size:
        raise ValueError(f"center_crop: image {height}x{width} is smaller than the crop {size}")
    top = int(round((height - size) / 2.0))
    left = int(round((width - size) / 2.0))
    return image[top:top + size, left:left + size]


def resize_center_crop(
    image: np.ndarray, size: int, crop_pct: float = DEFAULT_CROP_PCT
) -> np.ndarray:
    """Eval geometry: shorter side → floor(size / crop_pct) bicubic, then centre crop.

    Args:
        image: uint8 (H, W, 3).
        size: output side length (224 for ImageNet).
        crop_pct: fraction of the resized shorter side kept (0.875 → resize to 256).

    Returns:
        uint8 (size, size, 3).
    """
    if not 0.0 < crop_pct <= 1.0:
        raise ValueError(f"resize_center_crop: crop_pct={crop_pct!r}; must be in (0, 1]")
    _check_size(size, "resize_center_crop")
    scale_size = int(math.floor(size / crop_pct))
    return np.ascontiguousarray(center_crop(resize_shorter_side(image, scale_size), size))


def normalize(image: np.ndarray, mean: Sequence[float], std: Sequence[float]) -> np.ndarray:
    """(image / 255 − mean) / std per channel; mean and std in [0, 1] units.

    Args:
        image: uint8 (..., C).

    Returns:
        float32 of the same shape.
    """
    mean = np.asarray(mean, np.float64)
    std = np.asarray(std, np.float64)
    if mean.shape != (image.shape[-1],) or std.shape != (image.shape[-1],):
        raise ValueError(
            f"normalize: mean {mean.shape} and std {std.shape} must have one entry per channel "
            f"({image.shape[-1]})"
        )
    if np.any(std <= 0):
        raise ValueError(f"normalize: std={tuple(std)} must be positive")
    scale = (1.0 / (255.0 * std)).astype(np.float32)
    shift = (mean / std).astype(np.float32)
    if image.dtype != np.uint8:
        return image.astype(np.float32) * scale - shift
    # uint8: a 256-entry table per channel holds the same float32 values, ~4x faster.
    table = np.arange(256, dtype=np.float32)[:, None] * scale - shift
    out = np.empty(image.shape, np.float32)
    for c in range(image.shape[-1]):
        np.take(table[:, c], image[..., c], out=out[..., c], mode="clip")
    return out


# ----------------------------------------------------------------------------------------
# RandAugment (timm 'rand-…' semantics). Ops take and return PIL RGB images.

_LEVEL_DENOM = 10.0  # magnitude m maps to the fraction m / 10 of each op's range


def auto_contrast(img: Image.Image) -> Image.Image:
    """Per-channel stretch of [min, max] to [0, 255]."""
    return ImageOps.autocontrast(img)


def equalize(img: Image.Image) -> Image.Image:
    """Per-channel histogram equalization."""
    return ImageOps.equalize(img)


def invert(img: Image.Image) -> Image.Image:
    """255 − x."""
    return ImageOps.invert(img)


def posterize(img: Image.Image, bits: int) -> Image.Image:
    """Keeps the `bits` most significant bits (0 bits gives a black image, as in timm)."""
    if bits >= 8:
        return img
    # A lookup table, not ImageOps.posterize: recent Pillow rejects bits=0.
    mask = 0xFF & ~(2 ** (8 - bits) - 1)
    return img.point([i & mask for i in range(256)] * len(img.getbands()))


def solarize(img: Image.Image, threshold: int) -> Image.Image:
    """Inverts pixels >= threshold."""
    return ImageOps.solarize(img, threshold)


def solarize_add(img: Image.Image, add: int, threshold: int = 128) -> Image.Image:
    """Adds `add` (clipped at 255) to pixels below `threshold`."""
    lut = [min(255, i + add) if i < threshold else i for i in range(256)]
    return img.point(lut * len(img.getbands()))


def color(img: Image.Image, factor: float) -> Image.Image:
    """Saturation: blend with the grayscale image (factor 1 = identity)."""
    return ImageEnhance.Color(img).enhance(factor)


def contrast(img: Image.Image, factor: float) -> Image.Image:
    """Blend with the mean gray level (factor 1 = identity)."""
    return ImageEnhance.Contrast(img).enhance(factor)


def brightness(img: Image.Image, factor: float) -> Image.Image:
    """Blend with black (factor 1 = identity)."""
    return ImageEnhance.Brightness(img).enhance(factor)


def sharpness(img: Image.Image, factor: float) -> Image.Image:
    """Blend with the 3x3 smoothed image (factor 1 = identity)."""
    return ImageEnhance.Sharpness(img).enhance(factor)


def _affine(img: Image.Image, matrix: tuple[float, ...], fill: tuple[int, ...],
            resample: Image.Resampling) -> Image.Image:
    # PIL maps each output pixel (x, y) to the input (a x + b y + c, d x + e y + f).
    return img.transform(img.size, Image.Transform.AFFINE, matrix, resample=resample, fillcolor=fill)


def rotate(img: Image.Image, degrees: float, fill: tuple[int, ...],
           resample: Image.Resampling = _BICUBIC) -> Image.Image:
    """Counter-clockwise rotation about the centre; uncovered corners get `fill`."""
    return img.rotate(degrees, resample=resample, fillcolor=fill)


def shear_x(img: Image.Image, factor: float, fill: tuple[int, ...],
            resample: Image.Resampling = _BICUBIC) -> Image.Image:
    """out(x, y) = in(x + factor·y, y)."""
    return _affine(img, (1, factor, 0, 0, 1, 0), fill, resample)


def shear_y(img: Image.Image, factor: float, fill: tuple[int, ...],
            resample: Image.Resampling = _BICUBIC) -> Image.Image:
    """out(x, y) = in(x, factor·x + y)."""
    return _affine(img, (1, 0, 0, factor, 1, 0), fill, resample)


def translate_x(img: Image.Image, pixels: float, fill: tuple[int, ...],
                resample: Image.Resampling = _BICUBIC) -> Image.Image:
    """out(x, y) = in(x + pixels, y): content moves left for pixels > 0."""
    return _affine(img, (1, 0, pixels, 0, 1, 0), fill, resample)


def translate_y(img: Image.Image, pixels: float, fill: tuple[int, ...],
                resample: Image.Resampling = _BICUBIC) -> Image.Image:
    """out(x, y) = in(x, y + pixels): content moves up for pixels > 0."""
    return _affine(img, (1, 0, 0, 0, 1, pixels), fill, resample)


@dataclasses.dataclass(frozen=True)
class OpContext:
    """What the geometric ops share: fill colour, resampling filter, translate range."""

    fill: tuple[int, int, int]
    resample: Image.Resampling
    translate_pct: float


def _negate_half(value: float, rng: np.random.Generator) -> float:
    # timm's _randomly_negate: the sign is one more draw after the magnitude.
    return -value if rng.random() > 0.5 else value


def _enhance_increasing(m: float, rng: np.random.Generator) -> float:
    return max(0.1, 1.0 + _negate_half(m / _LEVEL_DENOM * 0.9, rng))


# name -> (magnitude, rng, ctx) -> the op's argument (None for ops without one).
LEVEL_TO_ARG: dict[str, Callable[[float, np.random.Generator, OpContext], Any] | None] = {
    "AutoContrast": None,
    "Equalize": None,
    "Invert": None,
    "Rotate": lambda m, rng, ctx: _negate_half(m / _LEVEL_DENOM * 30.0, rng),
    "Posterize": lambda m, rng, ctx: int(m / _LEVEL_DENOM * 4),
    "PosterizeIncreasing": lambda m, rng, ctx: 4 - int(m / _LEVEL_DENOM * 4),
    "Solarize": lambda m, rng, ctx: int(m / _LEVEL_DENOM * 256),
    "SolarizeIncreasing": lambda m, rng, ctx: 256 - int(m / _LEVEL_DENOM * 256),
    "SolarizeAdd": lambda m, rng, ctx: int(m / _LEVEL_DENOM * 110),
    "Color": lambda m, rng, ctx: m / _LEVEL_DENOM * 1.8 + 0.1,
    "ColorIncreasing": lambda m, rng, ctx: _enhance_increasing(m, rng),
    "Contrast": lambda m, rng, ctx: m / _LEVEL_DENOM * 1.8 + 0.1,
    "ContrastIncreasing": lambda m, rng, ctx: _enhance_increasing(m, rng),
    "Brightness": lambda m, rng, ctx: m / _LEVEL_DENOM * 1.8 + 0.1,
    "BrightnessIncreasing": lambda m, rng, ctx: _enhance_increasing(m, rng),
    "Sharpness": lambda m, rng, ctx: m / _LEVEL_DENOM * 1.8 + 0.1,
    "SharpnessIncreasing": lambda m, rng, ctx: _enhance_increasing(m, rng),
    "ShearX": lambda m, rng, ctx: _negate_half(m / _LEVEL_DENOM * 0.3, rng),
    "ShearY": lambda m, rng, ctx: _negate_half(m / _LEVEL_DENOM * 0.3, rng),
    "TranslateXRel": lambda m, rng, ctx: _negate_half(m / _LEVEL_DENOM * ctx.translate_pct, rng),
    "TranslateYRel": lambda m, rng, ctx: _negate_half(m / _LEVEL_DENOM * ctx.translate_pct, rng),
}

# name -> (img, arg, ctx) -> img.
APPLY_OP: dict[str, Callable[[Image.Image, Any, OpContext], Image.Image]] = {
    "AutoContrast": lambda img, _, ctx: auto_contrast(img),
    "Equalize": lambda img, _, ctx: equalize(img),
    "Invert": lambda img, _, ctx: invert(img),
    "Rotate": lambda img, a, ctx: rotate(img, a, ctx.fill, ctx.resample),
    "Posterize": lambda img, a, ctx: posterize(img, a),
    "PosterizeIncreasing": lambda img, a, ctx: posterize(img, a),
    "Solarize": lambda img, a, ctx: solarize(img, a),
    "SolarizeIncreasing": lambda img, a, ctx: solarize(img, a),
    "SolarizeAdd": lambda img, a, ctx: solarize_add(img, a),
    "Color": lambda img, a, ctx: color(img, a),
    "ColorIncreasing": lambda img, a, ctx: color(img, a),
    "Contrast": lambda img, a, ctx: contrast(img, a),
    "ContrastIncreasing": lambda img, a, ctx: contrast(img, a),
    "Brightness": lambda img, a, ctx: brightness(img, a),
    "BrightnessIncreasing": lambda img, a, ctx: brightness(img, a),
    "Sharpness": lambda img, a, ctx: sharpness(img, a),
    "SharpnessIncreasing": lambda img, a, ctx: sharpness(img, a),
    "ShearX": lambda img, a, ctx: shear_x(img, a, ctx.fill, ctx.resample),
    "ShearY": lambda img, a, ctx: shear_y(img, a, ctx.fill, ctx.resample),
    "TranslateXRel": lambda img, a, ctx: translate_x(img, a * img.size[0], ctx.fill, ctx.resample),
    "TranslateYRel": lambda img, a, ctx: translate_y(img, a * img.size[1], ctx.fill, ctx.resample),
}

# timm's _RAND_TRANSFORMS and _RAND_INCREASING_TRANSFORMS (Cutout is random erasing instead).
RAND_OPS = (
    "AutoContrast", "Equalize", "Invert", "Rotate", "Posterize", "Solarize", "SolarizeAdd",
    "Color", "Contrast", "Brightness", "Sharpness", "ShearX", "ShearY", "TranslateXRel",
    "TranslateYRel",
)
RAND_INCREASING_OPS = (
    "AutoContrast", "Equalize", "Invert", "Rotate", "PosterizeIncreasing", "SolarizeIncreasing",
    "SolarizeAdd", "ColorIncreasing", "ContrastIncreasing", "BrightnessIncreasing",
    "SharpnessIncreasing", "ShearX", "ShearY", "TranslateXRel", "TranslateYRel",
)


@dataclasses.dataclass(frozen=True)
class RandAugmentSpec:
    """Parsed 'rand-m9-mstd0.5-inc1'-style string (timm's config grammar)."""

    num_layers: int = 2
    magnitude: float = 10.0
    magnitude_std: float = 0.0
    magnitude_max: float = _LEVEL_DENOM
    increasing: bool = False


# key -> (RandAugmentSpec field, value regex, converter); the grammar of timm's rand_augment_transform.
_RANDAUG_KEYS: dict[str, tuple[str, str, Callable[[str], Any]]] = {
    "m": ("magnitude", r"\d+", float),
    "n": ("num_layers", r"\d+", int),
    "mstd": ("magnitude_std", r"\d+(\.\d*)?", lambda v: math.inf if float(v) > 100 else float(v)),
    "mmax": ("magnitude_max", r"\d+", float),
    "inc": ("increasing", r"[01]", lambda v: v == "1"),
}


def parse_randaug(spec: str) -> RandAugmentSpec:
    """Parses timm's RandAugment string: "rand" then "-"-separated m, n, mstd, mmax, inc.

    mstd above 100 means a uniform magnitude in [0, m] (timm). "inc0" turns the increasing
    op set off (timm reads any inc value as on; only "inc1" occurs in the recipes).
    """
    example = "e.g. 'rand-m9-mstd0.5-inc1'"
    if not isinstance(spec, str) or spec.split("-")[0] != "rand":
        raise ValueError(f"randaug={spec!r}: must be a string starting with 'rand', {example}")
    fields: dict[str, Any] = {}
    for section in spec.split("-")[1:]:
        match = re.fullmatch(r"([a-z]*)(\d.*)?", section)  # letters, then a value from the first digit
        key, value = (match.group(1), match.group(2) or "") if match else (section, "")
        if key not in _RANDAUG_KEYS:
            raise ValueError(f"randaug={spec!r}: unknown section {section!r}; "
                             f"allowed keys {sorted(_RANDAUG_KEYS)}, {example}")
        name, pattern, convert = _RANDAUG_KEYS[key]
        if not re.fullmatch(pattern, value):
            raise ValueError(f"randaug={spec!r}: bad value {value!r} in section {section!r}, {example}")
        fields[name] = convert(value)
    parsed = RandAugmentSpec(**fields)
    if not 0 <= parsed.magnitude <= parsed.magnitude_max:
        raise ValueError(f"randaug={spec!r}: m={parsed.magnitude:g} must be in "
                         f"[0, {parsed.magnitude_max:g}] (set mmax to allow more)")
    return parsed


def rand_augment(
    image: np.ndarray,
    rng: np.random.Generator,
    num_layers: int = 2,
    magnitude: float = 9.0,
    magnitude_std: float = 0.5,
    increasing: bool = True,
    magnitude_max: float = _LEVEL_DENOM,
    fill: tuple[int, int, int] = (124, 116, 104),
    translate_pct: float = 0.45,
) -> np.ndarray:
    """RandAugment as timm's 'rand-m{magnitude}-mstd{magnitude_std}-inc1' (DeiT's setting).

    `num_layers` ops are drawn uniformly with replacement from the 15-op list; each is applied
    with probability 0.5, at magnitude ~ N(magnitude, magnitude_std) clipped to
    [0, magnitude_max] (uniform in [0, magnitude] for an infinite std), with a random sign for
    signed ops. Geometric ops resample bicubic and fill with `fill` (DeiT: the ImageNet mean
    colour, round(255·mean)).

    Args:
        image: uint8 (H, W, 3).

    Returns:
        uint8 (H, W, 3).
    """
    _check_uint8_image(image, "rand_augment")
    names = RAND_INCREASING_OPS if increasing else RAND_OPS
    ctx = OpContext(fill=tuple(int(v) for v in fill), resample=_BICUBIC, translate_pct=translate_pct)
    img = Image.fromarray(image)
    for index in rng.integers(0, len(names), size=num_layers):
        name = names[int(index)]
        if rng.random() > 0.5:  # each chosen op fires with probability 0.5
            continue
        m = magnitude
        if magnitude_std == math.inf:
            m = rng.uniform(0.0, magnitude)
        elif magnitude_std > 0:
            m = rng.normal(magnitude, magnitude_std)
        m = float(min(max(m, 0.0), magnitude_max))
        level_to_arg = LEVEL_TO_ARG[name]
        arg = level_to_arg(m, rng, ctx) if level_to_arg is not None else None
        img = APPLY_OP[name](img, arg, ctx)
    return np.asarray(img)


# ----------------------------------------------------------------------------------------
# Random erasing (timm RandomErasing, count 1).


def random_erasing_box(
    height: int,
    width: int,
    rng: np.random.Generator,
    min_area: float = 0.02,
    max_area: float = 1 / 3,
    min_aspect: float = 0.3,
    max_aspect: float | None = None,
) -> Box | None:
    """Draws the erased rectangle: area ~ U(min_area, max_area)·H·W, h/w ~ logU(aspect).

    Ten tries for a box strictly smaller than the image; None if none fits.

    Returns:
        (top, left, h, w) or None.
    """
    max_aspect = max_aspect or 1.0 / min_aspect
    log_aspect = (math.log(min_aspect), math.log(max_aspect))
    area = height * width
    for _ in range(10):
        target_area = rng.uniform(min_area, max_area) * area
        aspect = math.exp(rng.uniform(log_aspect[0], log_aspect[1]))
        h = int(round(math.sqrt(target_area * aspect)))
        w = int(round(math.sqrt(target_area / aspect)))
        if w < width and h < height:
            top = int(rng.integers(0, height - h + 1))
            left = int(rng.integers(0, width - w + 1))
            return top, left, h, w
    return None


def random_erasing(
    image: np.ndarray,
    rng: np.random.Generator,
    prob: float = 0.25,
    min_area: float = 0.02,
    max_area: float = 1 / 3,
    min_aspect: float = 0.3,
    max_aspect: float | None = None,
    mode: str = "pixel",
    channels_last: bool = True,
) -> np.ndarray:
    """Random erasing of a normalized image (timm semantics, one box).

    With probability `prob`, a `random_erasing_box` rectangle is replaced by N(0, 1) noise per
    pixel and channel ('pixel'), one N(0, 1) colour per channel ('rand') or zeros ('const').

    Args:
        image: float (H, W, C) if channels_last else (C, H, W).

    Returns:
        A new array of the same shape and dtype.
    """
    if mode not in ("pixel", "rand", "const"):
        raise ValueError(f"random_erasing: mode={mode!r}; allowed: 'pixel', 'rand', 'const'")
    if image.ndim != 3 or not np.issubdtype(image.dtype, np.floating):
        raise ValueError(f"random_erasing: expected a float 3-D image, got {image.dtype} {image.shape}")
    out = np.array(image, copy=True)
    if rng.random() > prob:
        return out
    view = out if channels_last else np.moveaxis(out, 0, -1)  # a view: writes land in `out`
    height, width, channels = view.shape
    box = random_erasing_box(height, width, rng, min_area, max_area, min_aspect, max_aspect)
    if box is None:
        return out
    top, left, h, w = box
    if mode == "pixel":
        patch = rng.standard_normal((h, w, channels), dtype=np.float32)
    elif mode == "rand":
        patch = rng.standard_normal((1, 1, channels), dtype=np.float32)
    else:
        patch = np.zeros((1, 1, channels), np.float32)
    view[top:top + h, left:left + w] = patch
    return out


# ----------------------------------------------------------------------------------------
# Mixup / CutMix (timm Mixup, 'batch' mode: one λ per batch, partner = the reversed batch).


def smooth_one_hot(labels: np.ndarray, num_classes: int, label_smoothing: float) -> np.ndarray:
    """Integer (B,) or soft (B, K) labels → (1 − s)·y + s/K, float32 (B, K)."""
    labels = np.asarray(labels)
    if labels.ndim == 1:
        if not np.issubdtype(labels.dtype, np.integer):
            raise ValueError(f"labels: 1-D labels must be integers, got {labels.dtype}")
        if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
            raise ValueError(f"labels: values must be in [0, {num_classes}), "
                             f"got [{labels.min()}, {labels.max()}]")
        targets = np.zeros((labels.shape[0], num_classes), np.float64)
        targets[np.arange(labels.shape[0]), labels] = 1.0
    elif labels.ndim == 2 and labels.shape[1] == num_classes:
        targets = labels.astype(np.float64)
    else:
        raise ValueError(f"labels: expected (B,) ints or (B, {num_classes}) soft labels, "
                         f"got {labels.shape}")
    return (targets * (1.0 - label_smoothing) + label_smoothing / num_classes).astype(np.float32)


def cutmix_box(height: int, width: int, lam: float, rng: np.random.Generator) -> Box:
    """timm's rand_bbox: a box of about (1 − λ)·H·W pixels, centred uniformly, clipped.

    Returns:
        (top, left, h, w); h or w may be 0.
    """
    cut_ratio = math.sqrt(1.0 - lam)
    cut_h, cut_w = int(height * cut_ratio), int(width * cut_ratio)
    cy = int(rng.integers(0, height))
    cx = int(rng.integers(0, width))
    top, bottom = np.clip([cy - cut_h // 2, cy + cut_h // 2], 0, height)
    left, right = np.clip([cx - cut_w // 2, cx + cut_w // 2], 0, width)
    return int(top), int(left), int(bottom - top), int(right - left)


def mixup_cutmix(
    images: np.ndarray,
    labels: np.ndarray,
    num_classes: int,
    rng: np.random.Generator,
    mixup_alpha: float = 0.8,
    cutmix_alpha: float = 1.0,
    switch_prob: float = 0.5,
    prob: float = 1.0,
    label_smoothing: float = 0.1,
) -> tuple[np.ndarray, np.ndarray]:
    """Mixup or CutMix of a batch with its reverse (timm Mixup, mode 'batch').

    With probability `prob` the batch is mixed: CutMix with probability `switch_prob` when
    both are on (λ ~ Beta(cutmix_alpha), the box from `cutmix_box`, λ corrected to
    1 − box area / image area), else mixup (λ ~ Beta(mixup_alpha), x ← λ x + (1 − λ) x_rev).
    Labels: λ·ỹ + (1 − λ)·ỹ_rev with ỹ the smoothed one-hot; every row sums to 1.
    An odd batch mixes its middle example with itself.

    Args:
        images: float (B, H, W, C).
        labels: int (B,) or soft (B, num_classes).

    Returns:
        (images float (B, H, W, C) of the input dtype, labels float32 (B, num_classes)).
    """
    if images.ndim != 4 or not np.issubdtype(images.dtype, np.floating):
        raise ValueError(f"mixup_cutmix: expected float (B, H, W, C) images, "
                         f"got {images.dtype} {images.shape}")
    targets = smooth_one_hot(labels, num_classes, label_smoothing)
    if targets.shape[0] != images.shape[0]:
        raise ValueError(f"mixup_cutmix: {images.shape[0]} images but {targets.shape[0]} labels")
    lam, use_cutmix = 1.0, False
    if (mixup_alpha > 0 or cutmix_alpha > 0) and rng.random() < prob:
        if mixup_alpha > 0 and cutmix_alpha > 0:
            use_cutmix = bool(rng.random() < switch_prob)
        else:
            use_cutmix = cutmix_alpha > 0
        alpha = cutmix_alpha if use_cutmix else mixup_alpha
        lam = float(rng.beta(alpha, alpha))
    out = np.array(images, copy=True)
    if lam == 1.0:
        return out, targets
    reverse = images[::-1]
    if use_cutmix:
        height, width = images.shape[1:3]
        top, left, h, w = cutmix_box(height, width, lam, rng)
        out[:, top:top + h, left:left + w] = reverse[:, top:top + h, left:left + w]
        lam = 1.0 - h * w / (height * width)
    else:
        out = (images * lam + reverse * (1.0 - lam)).astype(images.dtype)
    mixed = lam * targets + (1.0 - lam) * targets[::-1]
    return out, mixed.astype(np.float32)


# ----------------------------------------------------------------------------------------
# Config validation and the transforms the pipeline maps.

MIX_ON = ("device", "host")
_AUG_FIELDS = ("randaug", "scale", "flip", "reprob", "mixup", "cutmix", "mixup_switch_prob")


def _field(aug_config: Any, name: str) -> Any:
    try:
        return aug_config[name]
    except (KeyError, AttributeError, TypeError):
        raise ValueError(f'aug.{name} is missing; the aug config needs {", ".join(_AUG_FIELDS)}') from None


def _optional(aug_config: Any, name: str, default: Any) -> Any:
    return aug_config.get(name, default) if hasattr(aug_config, "get") else default


CROPS = ("rrc", "pad")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


def _check_unit(value: Any, name: str, upper_open: bool = False) -> None:
    upper = "1)" if upper_open else "1]"
    if not _is_number(value) or not (0 <= value < 1 if upper_open else 0 <= value <= 1):
        raise ValueError(f"aug.{name}={value!r}; must be a number in [0, {upper}")


def validate_aug_config(aug_config: Any) -> None:
    """Raises a one-line ValueError naming the first out-of-range augmentation field.

    Fields: randaug (None or 'rand-…'), scale (0 < lo <= hi <= 1), flip (bool), reprob [0, 1],
    mixup >= 0, cutmix >= 0, mixup_switch_prob [0, 1]. Optional: ratio
    (0 < lo <= hi; default (3/4, 4/3)), mixup_prob [0, 1] (default 1), crop ('rrc' random
    resized crop, default; 'pad' zero-pad + random crop, CIFAR style), crop_padding (int >= 0,
    default 4), mix_on ('device': mixup/cutmix of the global batch inside the train step,
    data/device_mix.py, default; 'host': of each process's batch in the pipeline).
    """
    randaug = _field(aug_config, "randaug")
    if randaug is not None and not isinstance(randaug, str):
        raise ValueError(f"aug.randaug={randaug!r}; must be None or a string like 'rand-m9-mstd0.5-inc1'")
    if randaug:
        try:
            parse_randaug(randaug)
        except ValueError as err:
            raise ValueError(f"aug.{err}") from None
    scale = _field(aug_config, "scale")
    if (not isinstance(scale, (tuple, list)) or len(scale) != 2 or not all(map(_is_number, scale))
        or not 0 < scale[0] <= scale[1] <= 1):
        raise ValueError(f"aug.scale={scale!r}; must be (lo, hi) with 0 < lo <= hi <= 1")
    ratio = _optional(aug_config, "ratio", None)
    if ratio is not None and (not isinstance(ratio, (tuple, list)) or len(ratio) != 2
                              or not all(map(_is_number, ratio)) or not 0 < ratio[0] <= ratio[1]):
        raise ValueError(f"aug.ratio={ratio!r}; must be (lo, hi) with 0 < lo <= hi")
    flip = _field(aug_config, "flip")
    if not isinstance(flip, (bool, np.bool_)):
        raise ValueError(f"aug.flip={flip!r}; must be True or False")
    _check_unit(_field(aug_config, "reprob"), "reprob")
    for name in ("mixup", "cutmix"):
        value = _field(aug_config, name)
        if not _is_number(value) or value < 0:
            raise ValueError(f"aug.{name}={value!r}; must be a Beta alpha >= 0 (0 turns it off)")
    _check_unit(_field(aug_config, "mixup_switch_prob"), "mixup_switch_prob")
    smoothing = _optional(aug_config, "label_smoothing", None)
    if smoothing:  # one smoothing, in the loss: it applies to mixed targets the same way (it is linear)
        raise ValueError(f"aug.label_smoothing={smoothing!r} is not used; set config.label_smoothing instead")
    _check_unit(_optional(aug_config, "mixup_prob", 1.0), "mixup_prob")
    crop = _optional(aug_config, "crop", "rrc")
    if crop not in CROPS:
        raise ValueError(f"aug.crop={crop!r} is unknown; allowed: {list(CROPS)}")
    padding = _optional(aug_config, "crop_padding", 4)
    if not isinstance(padding, (int, np.integer)) or isinstance(padding, bool) or padding < 0:
        raise ValueError(f"aug.crop_padding={padding!r}; must be an int >= 0")
    mix_on = _optional(aug_config, "mix_on", "device")
    if mix_on not in MIX_ON:
        raise ValueError(f"aug.mix_on={mix_on!r} is unknown; allowed: {list(MIX_ON)}")


def mix_site(aug_config: Any) -> str | None:
    """Where mixup/cutmix runs for `config.input.aug`: 'device' (in the train step), 'host' (in
    the pipeline, over float32 batches), or None (off: no aug, or both alphas 0)."""
    if aug_config is None or not (aug_config.get("mixup", 0) or aug_config.get("cutmix", 0)):
        return None
    return aug_config.get("mix_on", "device")


def _mean_fill(mean: Sequence[float]) -> tuple[int, int, int]:
    # timm's RandAugment fill colour for DeiT: round(255 · mean), clipped.
    return tuple(min(255, round(255 * m)) for m in mean)  # type: ignore[return-value]


@dataclasses.dataclass(frozen=True)
class TrainTransform:
    """Per-example train chain: crop (random resized, or pad + crop) → flip → RandAugment →
    normalize → random erasing.

    A frozen dataclass (not a closure) so grain worker processes can pickle it.
    Call: (uint8 (H, W, 3), rng) → float32 (image_size, image_size, 3).
    """

    image_size: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    scale: tuple[float, float]
    ratio: tuple[float, float]
    flip: bool
    randaug: RandAugmentSpec | None
    reprob: float
    crop: str = "rrc"
    crop_padding: int = 4
    uint8: bool = False  # stop before normalize: {'image': uint8, 'erase': box}, the rest on device

    def __call__(self, image: np.ndarray, rng: np.random.Generator) -> np.ndarray | dict[str, np.ndarray]:
        if self.crop == "pad":
            image = random_pad_crop(image, rng, self.image_size, self.crop_padding)
        else:
            image = random_resized_crop(image, rng, self.image_size, self.scale, self.ratio)
        if self.flip:
            image = random_flip(image, rng)
        if self.randaug is not None:
            ra = self.randaug
            image = rand_augment(
                np.ascontiguousarray(image), rng, num_layers=ra.num_layers, magnitude=ra.magnitude,
                magnitude_std=ra.magnitude_std, increasing=ra.increasing,
                magnitude_max=ra.magnitude_max, fill=_mean_fill(self.mean))
        if self.uint8:  # the same draws as random_erasing below, without the noise (drawn on device)
            if self.reprob <= 0:
                return np.ascontiguousarray(image)
            box = None
            if rng.random() <= self.reprob:
                box = random_erasing_box(image.shape[0], image.shape[1], rng)
            return {"image": np.ascontiguousarray(image), "erase": np.array(box or (0, 0, 0, 0), np.int32)}
        image = normalize(image, self.mean, self.std)
        if self.reprob > 0:
            image = random_erasing(image, rng, prob=self.reprob)
        return image


@dataclasses.dataclass(frozen=True)
class EvalTransform:
    """Eval chain: `resize_center_crop` → normalize. Call: (uint8 image, rng=None) → float32."""

    image_size: int
    crop_pct: float
    mean: tuple[float, ...]
    std: tuple[float, ...]
    uint8: bool = False  # the uint8 crop; normalized on device (data/device_images.py)

    def __call__(self, image: np.ndarray, rng: np.random.Generator | None = None) -> np.ndarray:
        del rng  # deterministic; the argument keeps the train and eval call signatures alike
        crop = resize_center_crop(image, self.image_size, self.crop_pct)
        return crop if self.uint8 else normalize(crop, self.mean, self.std)


@dataclasses.dataclass(frozen=True)
class BatchMix:
    """Per-batch mixup/cutmix (with probability `prob`). Call: (images, labels, rng) → (images, soft labels).

    Label smoothing is not applied here: the loss applies `config.label_smoothing` to the mixed
    targets, which is the same (smoothing and mixing commute).
    """

    num_classes: int
    mixup_alpha: float
    cutmix_alpha: float
    switch_prob: float
    prob: float

    def __call__(self, images: np.ndarray, labels: np.ndarray,
                 rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        return mixup_cutmix(images, labels, self.num_classes, rng, self.mixup_alpha,
                            self.cutmix_alpha, self.switch_prob, self.prob, label_smoothing=0.0)


def train_transform(
    aug_config: Any, image_size: int, mean: Sequence[float] = IMAGENET_MEAN,
    std: Sequence[float] = IMAGENET_STD,
) -> TrainTransform:
    """Builds the per-example train transform from `config.aug` (validated first)."""
    validate_aug_config(aug_config)
    _check_size(image_size, "train_transform")
    ratio = _optional(aug_config, "ratio", None)
    randaug = _field(aug_config, "randaug")
    return TrainTransform(
        image_size=int(image_size), mean=tuple(map(float, mean)), std=tuple(map(float, std)),
        scale=tuple(map(float, _field(aug_config, "scale"))),  # type: ignore[arg-type]
        ratio=tuple(map(float, ratio)) if ratio is not None else (3 / 4, 4 / 3),  # type: ignore[arg-type]
        flip=bool(_field(aug_config, "flip")),
        randaug=parse_randaug(randaug) if randaug else None,
        reprob=float(_field(aug_config, "reprob")),
        crop=_optional(aug_config, "crop", "rrc"),
        crop_padding=int(_optional(aug_config, "crop_padding", 4)),
    )


def eval_transform(
    image_size: int, crop_pct: float = DEFAULT_CROP_PCT, mean: Sequence[float] = IMAGENET_MEAN,
    std: Sequence[float] = IMAGENET_STD,
) -> EvalTransform:
    """Builds the eval transform (resize shorter side to floor(size/crop_pct), centre crop)."""
    _check_size(image_size, "eval_transform")
    if not _is_number(crop_pct) or not 0 < crop_pct <= 1:
        raise ValueError(f"crop_pct={crop_pct!r}; must be in (0, 1]")
    return EvalTransform(int(image_size), float(crop_pct), tuple(map(float, mean)),
                         tuple(map(float, std)))


def batch_transform(aug_config: Any, num_classes: int) -> BatchMix:
    """Builds the per-batch mixup/cutmix from `config.aug` (mixup, cutmix, mixup_switch_prob, mixup_prob)."""
    validate_aug_config(aug_config)
    if not isinstance(num_classes, (int, np.integer)) or num_classes < 1:
        raise ValueError(f"num_classes={num_classes!r}; must be a positive int")
    mixup_prob = _optional(aug_config, "mixup_prob", 1.0)
    return BatchMix(
        num_classes=int(num_classes), mixup_alpha=float(_field(aug_config, "mixup")),
        cutmix_alpha=float(_field(aug_config, "cutmix")),
        switch_prob=float(_field(aug_config, "mixup_switch_prob")), prob=float(mixup_prob))
