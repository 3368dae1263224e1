"""Images and labels for the dense evaluations at their own resolution (docs/method/dense.md §7-8).

numpy only, deterministic. The dense evaluators read a dataset's records (`image` uint8
(H, W, C) of any size, `segmentation` uint8 (H, W) with 255 ignored, `boxes` (k, 4)) straight
from its source, not through the classification eval transform, and prepare them here:

* `bilinear_taps` / `resize_bilinear` / `resize_image`: bilinear resizes with half-pixel
  centres and clamped edges, without antialiasing (torch `align_corners=False`, OpenCV
  `INTER_LINEAR`), two taps per output; `resize_nearest` for labels (OpenCV's `INTER_NEAREST`:
  source ⌊i·in/out⌋);
* `rescale_hw`: mmseg's keep-ratio rescale to a (long, short) target: factor
  min(long / max(H, W), short / min(H, W));
* `Protocol` (`PROTOCOLS['lin']`, `['ms']`): the segmentation probe's train crops and test
  windows; `train_example` (resize by a random ratio, random crop with the class-ratio retry,
  flip, photometric distortion, padding) and `windows` (mmseg's sliding-window grid);
* `photometric_distortion`: mmseg's PhotoMetricDistortion (brightness, contrast, saturation,
  hue, each with probability ½, contrast before or after the colour steps).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import numpy as np

# The label of pixels no metric counts (VOC's object borders, ADE20K's "other", unused COCO-Stuff
# ids) in every segmentation record (data/dense_sources.py) and crop padding.
IGNORE_INDEX = 255


@functools.lru_cache(maxsize=4096)
def bilinear_taps(out: int, inp: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(i0, i1, frac) of the bilinear resize inp → out: output i = (1 − frac)·x[i0] + frac·x[i1],
    sampling the input at (i + ½)·inp/out − ½ clamped to [0, inp − 1] (half-pixel centres,
    edges clamped, no antialiasing). O(out) memory: two taps per output."""
    src = np.clip((np.arange(out) + 0.5) * inp / out - 0.5, 0, inp - 1)
    i0 = np.floor(src).astype(np.intp)
    i1 = np.minimum(i0 + 1, inp - 1)
    frac = src - i0
    for a in (i0, i1, frac):
        a.setflags(write=False)
    return i0, i1, frac


@functools.lru_cache(maxsize=1024)
def bilinear_matrix(out: int, inp: int) -> np.ndarray:
    """The (out, inp) float64 matrix of `bilinear_taps` (for small sizes: the digit scenes, tests)."""
    i0, i1, frac = bilinear_taps(out, inp)
    r = np.zeros((out, inp))
    np.add.at(r, (np.arange(out), i0), 1 - frac)
    np.add.at(r, (np.arange(out), i1), frac)
    r.setflags(write=False)
    return r


def _resize_axis(x: np.ndarray, out: int, axis: int, start: int = 0, stop: int | None = None,
                 dtype: np.dtype = np.float64) -> np.ndarray:
    i0, i1, frac = bilinear_taps(out, x.shape[axis])
    i0, i1, frac = i0[start:stop], i1[start:stop], frac[start:stop].astype(dtype)
    shape = [1] * x.ndim
    shape[axis] = len(frac)
    frac = frac.reshape(shape)
    return np.take(x, i0, axis=axis).astype(dtype) * (1 - frac) + np.take(x, i1, axis=axis).astype(dtype) * frac


def resize_bilinear(
    x: np.ndarray, hw: tuple[int, int], window: tuple[int, int, int, int] | None = None,
    dtype: np.dtype = np.float64,
) -> np.ndarray:
    """(H, W, ...) → (h, w, ...) bilinear (`bilinear_taps` along both axes) in `dtype`; `window`
    (y0, y1, x0, x1): only those rows and columns of the result (the same values, computed alone)."""
    y0, y1, x0, x1 = window or (0, hw[0], 0, hw[1])
    x = _resize_axis(np.asarray(x), hw[0], 0, y0, y1, dtype)
    return _resize_axis(x, hw[1], 1, x0, x1, dtype)


def resize_image(
    image: np.ndarray, hw: tuple[int, int], window: tuple[int, int, int, int] | None = None
) -> np.ndarray:
    """uint8 (H, W, C) → uint8 (h, w, C) (or its `window`), bilinear, rounded."""
    if tuple(image.shape[:2]) == tuple(hw):
        image = np.asarray(image)
        return image if window is None else image[window[0] : window[1], window[2] : window[3]]
    return np.clip(np.rint(resize_bilinear(image, hw, window)), 0, 255).astype(np.uint8)


def nearest_index(out: int, inp: int) -> np.ndarray:
    """OpenCV's INTER_NEAREST source indices: ⌊i·inp/out⌋, i < out."""
    return np.minimum((np.arange(out) * inp) // out, inp - 1)


def resize_nearest(label: np.ndarray, hw: tuple[int, int]) -> np.ndarray:
    """(H, W) label → (h, w), nearest (labels are never interpolated)."""
    return np.asarray(label)[nearest_index(hw[0], label.shape[0])[:, None], nearest_index(hw[1], label.shape[1])]


def rescale_hw(hw: tuple[int, int], long: float, short: float) -> tuple[int, int]:
    """Keep-ratio size for the target (long, short): factor min(long/max(H, W), short/min(H, W)),
    sizes rounded (mmcv `rescale_size`: int(x·f + 0.5))."""
    h, w = hw
    f = min(long / max(h, w), short / min(h, w))
    return int(h * f + 0.5), int(w * f + 0.5)


def pad_to(x: np.ndarray, hw: tuple[int, int], value: float) -> np.ndarray:
    """Pad (H, W, ...) at the bottom and right to (h, w) ≥ (H, W) with `value`."""
    pad = [(0, hw[0] - x.shape[0]), (0, hw[1] - x.shape[1])] + [(0, 0)] * (x.ndim - 2)
    if min(p[1] for p in pad) < 0:
        raise ValueError(f"pad_to: {x.shape[:2]} is larger than the target {hw}")
    return np.pad(x, pad, constant_values=value)


def patch_multiple(hw: tuple[int, int], p: int) -> tuple[int, int]:
    return -(-hw[0] // p) * p, -(-hw[1] // p) * p


# ---------------------------------------------------------------------------------------------
# Photometric distortion (mmseg PhotoMetricDistortion).
# ---------------------------------------------------------------------------------------------

BRIGHTNESS_DELTA = 32
CONTRAST_RANGE = (0.5, 1.5)
SATURATION_RANGE = (0.5, 1.5)
HUE_DELTA = 18


def _rgb_to_hsv(rgb: np.ndarray) -> np.ndarray:
    """uint8 RGB → float32 HSV with OpenCV's 8-bit ranges: H in [0, 180), S and V in [0, 255]."""
    x = rgb.astype(np.float32)
    r, g, b = x[..., 0], x[..., 1], x[..., 2]
    v = np.maximum(np.maximum(r, g), b)
    c = v - np.minimum(np.minimum(r, g), b)
    s = np.where(v > 0, c / np.maximum(v, 1e-12), 0.0) * 255.0
    safe = np.maximum(c, 1e-12)
    h = np.where(v == r, (g - b) / safe, np.where(v == g, 2.0 + (b - r) / safe, 4.0 + (r - g) / safe))
    h = np.where(c > 0, (h * 30.0) % 180.0, 0.0)  # 60° per unit, halved for 8 bits
    return np.stack([h, s, v], -1).astype(np.float32)


def _hsv_to_rgb(hsv: np.ndarray) -> np.ndarray:
    """The inverse of `_rgb_to_hsv` (float32 RGB in [0, 255])."""
    h, s, v = hsv[..., 0] / 30.0, hsv[..., 1] / 255.0, hsv[..., 2]
    vs = v * s
    out = []
    for n in (5.0, 3.0, 1.0):
        k = (n + h) % 6.0
        out.append(v - vs * np.clip(np.minimum(k, 4.0 - k), 0.0, 1.0))
    return np.stack(out, -1)


def photometric_distortion(image: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """uint8 (H, W, C) → uint8: mmseg's PhotoMetricDistortion with its defaults.

    In order, each applied with probability ½: brightness + U(−32, 32); (contrast first with
    probability ½) contrast × U(0.5, 1.5); saturation × U(0.5, 1.5) and hue + U{−18..17} (mod 180)
    in 8-bit HSV (3 channels only); contrast here if it was not first. As mmseg, each step
    clips to [0, 255] and truncates to uint8.
    """
    x = np.asarray(image, np.uint8)

    def convert(y: np.ndarray, alpha: float = 1.0, beta: float = 0.0) -> np.ndarray:
        return np.clip(y.astype(np.float32) * np.float32(alpha) + np.float32(beta), 0, 255).astype(np.uint8)

    if rng.integers(2):
        x = convert(x, beta=rng.uniform(-BRIGHTNESS_DELTA, BRIGHTNESS_DELTA))
    contrast_first = bool(rng.integers(2))

    def contrast(y: np.ndarray) -> np.ndarray:
        return convert(y, alpha=rng.uniform(*CONTRAST_RANGE)) if rng.integers(2) else y

    if contrast_first:
        x = contrast(x)
    if x.shape[-1] == 3:
        if rng.integers(2):
            hsv = np.rint(_rgb_to_hsv(x)).astype(np.uint8)
            hsv[..., 1] = convert(hsv[..., 1], alpha=rng.uniform(*SATURATION_RANGE))
            x = np.clip(np.rint(_hsv_to_rgb(hsv.astype(np.float32))), 0, 255).astype(np.uint8)
        if rng.integers(2):
            hsv = np.rint(_rgb_to_hsv(x)).astype(np.int32)
            hsv[..., 0] = (hsv[..., 0] + rng.integers(-HUE_DELTA, HUE_DELTA)) % 180
            x = np.clip(np.rint(_hsv_to_rgb(hsv.astype(np.float32))), 0, 255).astype(np.uint8)
    if not contrast_first:
        x = contrast(x)
    return x


# ---------------------------------------------------------------------------------------------
# The probe's protocols (docs/method/dense.md §8).
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Protocol:
    """One linear-segmentation protocol; sizes in pixels at `crop` (scaled by `scaled`)."""

    blocks: int  # the last `blocks` blocks' patch tokens, each through the final LayerNorm, concatenated
    crop: int  # train crop and test window side
    short: int  # train: short side short·r, r ~ U(ratio); test: short side short·scale
    ratio: tuple[float, float]
    stride: int  # test window stride
    test_scales: tuple[float, ...]
    test_flip: bool
    long_factor: float = 4.0  # long-side cap = long_factor × the short target (mmseg (2048, 512); inf: none)
    cat_max_ratio: float = 0.75
    flip: bool = True
    photometric: bool = True

    def scaled(self, crop: int, **overrides) -> Protocol:
        """The same protocol at another crop side (short side and stride in proportion)."""
        f = crop / self.crop
        fields = dict(crop=crop, short=max(1, round(self.short * f)), stride=max(1, round(self.stride * f)))
        return dataclasses.replace(self, **{**fields, **overrides})


PROTOCOLS = {
    "lin": Protocol(blocks=1, crop=512, short=512, ratio=(0.5, 2.0), stride=341, test_scales=(1.0,), test_flip=False),
    "ms": Protocol(blocks=4, crop=640, short=640, ratio=(1.0, 3.0), stride=320,
                   test_scales=(1.0, 1.32, 1.73, 2.28, 3.0), test_flip=True, long_factor=math.inf),
}


def random_crop_box(
    label: np.ndarray, crop: int, rng: np.random.Generator, cat_max_ratio: float, tries: int = 10,
    hw: tuple[int, int] | None = None,
) -> tuple[int, int, int, int]:
    """(y0, y1, x0, x1) of a crop×crop window (smaller where the image is): up to `tries` draws
    until no class covers ≥ cat_max_ratio of the crop's labelled pixels (and it holds ≥ 2
    classes); else the last draw (mmseg RandomCrop). `hw`: the window is drawn on the label
    resized (nearest) to hw, read through the index maps without building it."""
    h, w = hw or label.shape
    rows, cols = nearest_index(h, label.shape[0]), nearest_index(w, label.shape[1])
    for _ in range(tries):
        y0 = int(rng.integers(0, max(h - crop, 0) + 1))
        x0 = int(rng.integers(0, max(w - crop, 0) + 1))
        box = (y0, min(y0 + crop, h), x0, min(x0 + crop, w))
        if cat_max_ratio >= 1.0:
            break
        values = label[rows[box[0] : box[1], None], cols[box[2] : box[3]]]
        _, counts = np.unique(values[values != IGNORE_INDEX], return_counts=True)
        if len(counts) > 1 and counts.max() / counts.sum() < cat_max_ratio:
            break
    return box


def train_example(
    image: np.ndarray, label: np.ndarray, protocol: Protocol, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One train crop: (uint8 (crop, crop, C), uint8 (crop, crop) label, bool (crop, crop) valid).

    Resize to the short side `short·r` (r ~ U(ratio), long side capped at long_factor×), image
    bilinear / label nearest; random crop (`random_crop_box`); horizontal flip with probability
    ½ (if `flip`); photometric distortion (if `photometric`); then bottom/right padding to
    crop×crop (image 0 — zero after normalization: the caller pads the normalized image where
    `valid` is False — label 255).
    """
    r = rng.uniform(*protocol.ratio)
    hw = rescale_hw(image.shape[:2], protocol.long_factor * protocol.short * r, protocol.short * r)
    y0, y1, x0, x1 = random_crop_box(label, protocol.crop, rng, protocol.cat_max_ratio, hw=hw)
    # Only the crop's pixels are resized (the same values as resizing all, then cropping).
    image = resize_image(image, hw, (y0, y1, x0, x1))
    label = label[nearest_index(hw[0], label.shape[0])[y0:y1, None], nearest_index(hw[1], label.shape[1])[x0:x1]]
    if protocol.flip and rng.random() < 0.5:
        image, label = image[:, ::-1], label[:, ::-1]
    if protocol.photometric:
        image = photometric_distortion(image, rng)
    size = (protocol.crop, protocol.crop)
    valid = pad_to(np.ones(label.shape, bool), size, False)
    return pad_to(np.ascontiguousarray(image), size, 0), pad_to(np.ascontiguousarray(label), size, IGNORE_INDEX), valid


def windows(hw: tuple[int, int], crop: int, stride: int) -> list[tuple[int, int, int, int]]:
    """mmseg's sliding-window grid over an (H, W) image: (y0, y1, x0, x1) per window, row-major.

    ⌈(H − crop)/stride⌉ + 1 rows (1 when H ≤ crop), window i starting at i·stride and shifted
    back to end inside the image; windows are crop×crop where the image allows, else its size.
    """
    h, w = hw
    rows = max(h - crop + stride - 1, 0) // stride + 1
    cols = max(w - crop + stride - 1, 0) // stride + 1
    out = []
    for i in range(rows):
        for j in range(cols):
            y1, x1 = min(i * stride + crop, h), min(j * stride + crop, w)
            out.append((max(y1 - crop, 0), y1, max(x1 - crop, 0), x1))
    return out


def test_views(
    image: np.ndarray, protocol: Protocol
) -> list[tuple[float, bool, np.ndarray]]:
    """(scale, flipped, resized uint8 image) of every test view: each scale of `test_scales`
    (short side short·scale, long side capped), each also flipped when `test_flip`."""
    return [view for scale in protocol.test_scales for view in scale_views(image, protocol, scale)]


def scale_views(image: np.ndarray, protocol: Protocol, scale: float) -> list[tuple[float, bool, np.ndarray]]:
    """The test views of one scale (`test_views`' entries for it, in order): one resize, and its
    mirror image when `test_flip`."""
    s = protocol.short * scale
    resized = resize_image(image, rescale_hw(image.shape[:2], protocol.long_factor * s, s))
    out = [(scale, False, resized)]
    if protocol.test_flip:
        out.append((scale, True, np.ascontiguousarray(resized[:, ::-1])))
    return out


def softmax(logits: np.ndarray, axis: int = -1) -> np.ndarray:
    z = logits - logits.max(axis=axis, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=axis, keepdims=True)


def view_sizes(image_hw: Sequence[int], protocol: Protocol) -> list[tuple[int, int]]:
    """The resized (h, w) of each test scale (for cost estimates without the pixels)."""
    return [rescale_hw(tuple(image_hw), protocol.long_factor * protocol.short * s, protocol.short * s)
            for s in protocol.test_scales]
