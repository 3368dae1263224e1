"""Digit scenes: an embedded real-data miniature for dense evaluations (object discovery, segmentation).

Built deterministically from scikit-learn's bundled handwritten digits (1,797 real 8×8
images), through the fixed split of `skipless_jax.data.record_sources.digits_split()`: 'train'
scenes only use digits of its train split and 'test' scenes only digits of its test split.

A scene is an (H, W) canvas (default 32×32) with one to three digits:

* background: a low-amplitude texture, a base level in [10, 40] plus smooth noise (a 4×4
  Gaussian grid, bilinearly upsampled) and a sinusoidal stripe pattern of random orientation,
  period and phase, clipped to [0, 100] (per channel when channels = 3);
* digits: each 8×8 digit (0..255) resized bilinearly (half-pixel centres) to s×s,
  s ~ U{digit_size}, default 12..20 px, its s×s square inside the canvas; a digit's ink box
  (below) must keep ≥ 1 px away from the ink boxes already placed: the square's top-left
  corner is drawn uniformly among the corners that allow it, and when there is none the
  digit is dropped (so a scene may hold fewer digits than drawn, and boxes never overlap);
  composited in order as image = image·(1 − a) + colour·a with a = digit/255 (colour 255 for
  one channel, a random RGB in [150, 255]³ per digit for three);
* mask (H, W) uint8: 0 background, 1 + digit class where the resized digit exceeds
  DIGIT_THRESHOLD = 255·4/16 (ink above 4/16 of full scale);
* boxes (k, 4) float32 [x0, y0, x1, y1], x1/y1 exclusive: each digit's tight box around its
  mask pixels, sorted by decreasing area (ties: placement order); box_labels (k,) int32 the
  digit classes; label = box_labels[0], the class of the largest digit.

Scene i depends only on (split, seed, image size, i) (its own generator), and its layout not
on `channels`; the first digit of scene i is the split's digit perm[i mod M] (perm a fixed
permutation of the split's M digits), so the default num_scenes = 2·M uses every digit twice
as the first digit. The arrays of a source are built once per argument set and cached.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from skipless_jax import rng_streams
from skipless_jax.data import dense
from skipless_jax.data.record_sources import digits_split

MAX_OBJECTS = 3
NUM_CLASSES = 10  # digit classes; the mask has NUM_CLASSES + 1 values (0 = background)
DIGIT_THRESHOLD = 255.0 * 4.0 / 16.0
DIGIT_SIZE = (12, 20)
_SPLIT_CODE = {"train": 0, "test": 1}


def _resize_matrix(out: int, inp: int = 8) -> np.ndarray:
    return dense.bilinear_matrix(out, inp)


@functools.cache
def _grid(h: int, w: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float64)
    return yy, xx, np.kron(_resize_matrix(h, 4), _resize_matrix(w, 4))  # (h·w, 16) upsampling


def _background(rng: np.random.Generator, h: int, w: int, channels: int) -> np.ndarray:
    """(channels, h, w) float64 texture in [0, 100]."""
    yy, xx, up = _grid(h, w)
    base = rng.uniform(10, 40, (channels, 1, 1))
    coarse = rng.normal(size=(channels, 4, 4))
    smooth = (coarse.reshape(channels, 16) @ up.T).reshape(channels, h, w)
    noise_amp = rng.uniform(3, 12, (channels, 1, 1))
    theta = rng.uniform(0, np.pi)
    period = rng.uniform(4, 12)
    phase = rng.uniform(0, 2 * np.pi)
    stripe_amp = rng.uniform(0, 10, (channels, 1, 1))
    stripes = np.sin(2 * np.pi * (xx * np.cos(theta) + yy * np.sin(theta)) / period + phase)
    return np.clip(base + noise_amp * smooth + stripe_amp * stripes[None], 0, 100)


def _scene(
    rng: np.random.Generator,
    first: int,
    digits: np.ndarray,
    classes: np.ndarray,
    h: int,
    w: int,
    channels: int,
    size_range: tuple[int, int],
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """One scene: image (h, w, C) uint8, mask (h, w) uint8, boxes (k, 4), classes (k,), digit indices (k,)."""
    k = int(rng.integers(1, MAX_OBJECTS + 1))
    idx = [first] + [int(v) for v in rng.integers(0, len(digits), k - 1)]
    sizes = [int(v) for v in rng.integers(size_range[0], size_range[1] + 1, k)]
    placed = []  # (digit index, size, y, x, resized digit, ink, ink box (y0, x0, y1, x1) in the canvas)
    for di, s in zip(idx, sizes):
        r = _resize_matrix(s)
        up = r @ digits[di] @ r.T  # (s, s), 0..255
        ink = up > DIGIT_THRESHOLD
        if not ink.any():  # cannot happen for sklearn's digits (all reach 16/16); keep the square
            ink = np.ones_like(ink)
        rows, cols = np.nonzero(ink)
        by0, bx0, by1, bx1 = int(rows.min()), int(cols.min()), int(rows.max()) + 1, int(cols.max()) + 1
        # Top-left corners of the s×s square (inside the canvas) whose ink box keeps >= 1 px
        # away from every ink box already placed.
        free = np.ones((h - s + 1, w - s + 1), bool)
        for *_, (y0, x0, y1, x1) in placed:
            free[max(y0 - by1, 0) : max(y1 - by0 + 1, 0), max(x0 - bx1, 0) : max(x1 - bx0 + 1, 0)] = False
        corners = np.flatnonzero(free)
        if len(corners) == 0:  # no room left: the scene keeps fewer digits
            continue
        y, x = divmod(int(corners[rng.integers(0, len(corners))]), w - s + 1)
        placed.append((di, s, y, x, up, ink, (y + by0, x + bx0, y + by1, x + bx1)))
    bg = _background(rng, h, w, channels)
    if channels == 1:
        colours = np.full((len(placed), 1), 255.0)
    else:
        colours = rng.uniform(150, 255, (len(placed), channels))
    image = bg.transpose(1, 2, 0).copy()
    mask = np.zeros((h, w), np.uint8)
    boxes, labels, used = [], [], []
    for (di, s, y, x, up, ink, (y0, x0, y1, x1)), colour in zip(placed, colours):
        a = (up / 255.0)[..., None]
        image[y : y + s, x : x + s] = image[y : y + s, x : x + s] * (1 - a) + colour * a
        mask[y : y + s, x : x + s][ink] = 1 + classes[di]
        boxes.append([x0, y0, x1, y1])
        labels.append(classes[di])
        used.append(di)
    boxes_a = np.asarray(boxes, np.float32).reshape(-1, 4)
    area = (boxes_a[:, 2] - boxes_a[:, 0]) * (boxes_a[:, 3] - boxes_a[:, 1])
    order = np.argsort(-area, kind="stable")
    image_u8 = np.round(np.clip(image, 0, 255)).astype(np.uint8)
    return image_u8, mask, boxes_a[order], np.asarray(labels, np.int32)[order], np.asarray(used, np.int32)[order]


@functools.cache
def build_digit_scenes(
    split: str,
    image_size: int | tuple[int, int] = 32,
    channels: int = 1,
    seed: int = 0,
    num_scenes: int | None = None,
    digit_size: tuple[int, int] = DIGIT_SIZE,
) -> dict[str, np.ndarray]:
    """All scenes of a split as stacked read-only arrays (cached per argument set).

    Returns {'image': (N, H, W, C) uint8, 'mask': (N, H, W) uint8, 'label': (N,) int32,
    'boxes_padded': (N, MAX_OBJECTS, 4) float32 (−1 padding), 'box_labels_padded':
    (N, MAX_OBJECTS) int32 (−1 padding), 'digit_indices_padded': (N, MAX_OBJECTS) int32 (indices
    into the split's digits of `digits_split()`, −1 padding), 'num_boxes': (N,) int32}.
    """
    if split not in _SPLIT_CODE:
        raise ValueError(f"digit_scenes: split={split!r} is unknown; allowed: {sorted(_SPLIT_CODE)}")
    h, w = (image_size, image_size) if isinstance(image_size, (int, np.integer)) else tuple(image_size)
    h, w = int(h), int(w)
    if channels not in (1, 3):
        raise ValueError(f"digit_scenes: channels={channels} must be 1 or 3")
    lo, hi = (int(v) for v in digit_size)
    if not 1 <= lo <= hi:
        raise ValueError(f"digit_scenes: digit_size={digit_size} must be (min, max) with 1 <= min <= max")
    if min(h, w) < lo:
        raise ValueError(f"digit_scenes: image_size={image_size} is smaller than the smallest digit ({lo} px)")
    hi = min(hi, h, w)
    images8, classes = digits_split()[split]
    digits = images8[..., 0].astype(np.float64)
    m = len(digits)
    n = 2 * m if num_scenes is None else int(num_scenes)
    if n < 1:
        raise ValueError(f"digit_scenes: num_scenes={num_scenes} must be >= 1")
    code = _SPLIT_CODE[split]
    perm = np.random.default_rng([seed, code, rng_streams.DIGIT_SCENE_ORDER]).permutation(m)
    out = {
        "image": np.zeros((n, h, w, channels), np.uint8),
        "mask": np.zeros((n, h, w), np.uint8),
        "label": np.zeros((n,), np.int32),
        "boxes_padded": np.full((n, MAX_OBJECTS, 4), -1, np.float32),
        "box_labels_padded": np.full((n, MAX_OBJECTS), -1, np.int32),
        "digit_indices_padded": np.full((n, MAX_OBJECTS), -1, np.int32),
        "num_boxes": np.zeros((n,), np.int32),
    }
    for i in range(n):
        rng = np.random.default_rng([seed, code, h, w, i])
        image, mask, boxes, labels, used = _scene(rng, int(perm[i % m]), digits, classes, h, w, channels, (lo, hi))
        k = len(boxes)
        out["image"][i], out["mask"][i], out["label"][i] = image, mask, labels[0]
        out["boxes_padded"][i, :k] = boxes
        out["box_labels_padded"][i, :k] = labels
        out["digit_indices_padded"][i, :k] = used
        out["num_boxes"][i] = k
    for v in out.values():
        v.setflags(write=False)
    return out


class DigitScenesSource:
    """Random-access digit scenes (see the module docstring); deterministic in its arguments.

    `__getitem__(i)` → {'image': uint8 (H, W, C), 'label': int (class of the largest digit),
    'mask': uint8 (H, W) (0 background, 1 + class), 'boxes': float32 (k, 4) [x0, y0, x1, y1],
    'box_labels': int32 (k,), 'boxes_padded': float32 (MAX_OBJECTS, 4) (−1 padding),
    'box_labels_padded': int32 (MAX_OBJECTS,) (−1 padding), 'num_boxes': int k,
    'digit_indices': int32 (k,) (the split's digits used)}; fresh arrays on every call.
    """

    def __init__(self, split: str, **options: Any):
        """`options`: those of `build_digit_scenes` (image_size, channels, seed, num_scenes,
        digit_size), by name; sizes may come as lists (a config's)."""
        for name in ("image_size", "digit_size"):
            if name in options and not isinstance(options[name], (int, np.integer)):
                options[name] = tuple(int(v) for v in options[name])
        if "seed" in options:
            options["seed"] = int(options["seed"])
        self.split = split
        self.arrays = build_digit_scenes(split, **options)

    def __len__(self) -> int:
        return len(self.arrays["label"])

    def __getitem__(self, index: int) -> dict[str, Any]:
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"DigitScenesSource index {index} out of range for {n} scenes")
        a = self.arrays
        k = int(a["num_boxes"][index])
        return {
            "image": a["image"][index].copy(),
            "label": int(a["label"][index]),
            "segmentation": a["mask"][index].copy(),  # per-pixel class ("mask" is the eval padding mask)
            "boxes": a["boxes_padded"][index, :k].copy(),
            "box_labels": a["box_labels_padded"][index, :k].copy(),
            "boxes_padded": a["boxes_padded"][index].copy(),
            "box_labels_padded": a["box_labels_padded"][index].copy(),
            "num_boxes": k,
            "digit_indices": a["digit_indices_padded"][index, :k].copy(),
        }
