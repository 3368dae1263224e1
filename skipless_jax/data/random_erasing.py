"""Random erasing (timm RandomErasing, one box): the box draw and the host erase of a normalized
image. The trainers erase on the device (`device_images.erase`) with the box drawn here."""

from __future__ import annotations

import math

import numpy as np


def random_erasing_box(
    height: int,
    width: int,
    rng: np.random.Generator,
    min_area: float = 0.02,
    max_area: float = 1 / 3,
    min_aspect: float = 0.3,
    max_aspect: float | None = None,
) -> tuple[int, int, int, int] | None:
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
