"""Crops, flips, resizes and normalization of host images (numpy + PIL), the steps of the
train and eval chains (data/augment.py).

Every random choice is drawn from the `np.random.Generator` passed in (no global random state).
Semantics follow timm as DeiT used it: random resized crop (bicubic), horizontal flip; eval:
resize the shorter side to floor(size / crop_pct) (bicubic), centre crop. Small images (CIFAR)
may use zero-pad + random crop instead. Images are uint8 (H, W, 3) RGB until `normalize`,
float32 (H, W, 3) after it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from PIL import Image

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
DEFAULT_CROP_PCT = 0.875

Box = tuple[int, int, int, int]  # (top, left, height, width)

_BICUBIC = Image.Resampling.BICUBIC
# Resampling of the random resized crop: timm's (DeiT) bicubic; torchvision RandomResizedCrop's default bilinear (DINO).
INTERPOLATIONS = {"bicubic": _BICUBIC, "bilinear": Image.Resampling.BILINEAR}


def check_uint8_image(image: np.ndarray, name: str, channels: tuple[int, ...] = (3,)) -> None:
    """One-line ValueError unless `image` is a uint8 (H, W, C) numpy array with C in `channels`;
    `name`: the caller."""
    if not isinstance(image, np.ndarray) or image.dtype != np.uint8:
        kind = getattr(image, "dtype", type(image).__name__)
        raise ValueError(f"{name}: expected a uint8 numpy image, got {kind}")
    if image.ndim != 3 or image.shape[-1] not in channels or min(image.shape[:2]) < 1:
        shapes = " or ".join(f"(H, W, {c})" for c in channels)
        raise ValueError(f"{name}: expected shape {shapes}, got {image.shape}")


def check_size(size: int, name: str) -> None:
    """One-line ValueError unless `size` is a positive int; `name`: the caller."""
    if not isinstance(size, (int, np.integer)) or isinstance(size, bool) or size < 1:
        raise ValueError(f"{name}: size={size!r}; must be a positive int")



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
    interpolation: str = "bicubic",
) -> np.ndarray:
    """Random resized crop: crop the box of `random_resized_crop_box`, resize bicubic (or
    `interpolation`, a name in INTERPOLATIONS).

    Args:
        image: uint8 (H, W, 3).
        size: output side length.

    Returns:
        uint8 (size, size, 3).
    """
    check_uint8_image(image, "random_resized_crop")
    check_size(size, "random_resized_crop")
    top, left, h, w = random_resized_crop_box(image.shape[0], image.shape[1], rng, scale, ratio)
    # Crop first, then resize: the resampling filter must not read pixels outside the box.
    crop = Image.fromarray(np.ascontiguousarray(image[top:top + h, left:left + w]))
    return np.asarray(crop.resize((size, size), INTERPOLATIONS[interpolation]))


def random_pad_crop(image: np.ndarray, rng: np.random.Generator, size: int, padding: int = 4) -> np.ndarray:
    """Zero-pad by `padding` on every side, then a uniform (size, size) window (CIFAR style).

    torchvision's RandomCrop(size, padding): the window's top-left is uniform over all
    positions inside the padded image.

    Returns:
        (size, size, C) of the input dtype.
    """
    check_size(size, "random_pad_crop")
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
    """Bicubic resize so the shorter side is `size`; the longer is int(size·long/short). RGB or
    one channel (grayscale digits: PIL's 'L' mode), the channels kept.

    The rounding down of the longer side is torchvision's `Resize(int)` rule.
    """
    check_uint8_image(image, "resize_shorter_side", channels=(1, 3))
    check_size(size, "resize_shorter_side")
    height, width = image.shape[:2]
    if height <= width:
        new_h, new_w = size, int(size * width / height)
    else:
        new_h, new_w = int(size * height / width), size
    gray = image.shape[-1] == 1
    resized = np.asarray(Image.fromarray(image[..., 0] if gray else image).resize((new_w, new_h), _BICUBIC))
    return resized[..., None] if gray else resized


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
    check_size(size, "resize_center_crop")
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
