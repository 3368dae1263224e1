"""Pictures the trainers and evaluators write as PNGs (matplotlib Figures, saved; no pyplot): a
grid of images with optional boxes, the PCA colouring of patch features (docs/method/dense.md §8), and
the display of normalized images.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

Box = Sequence[float]  # (x0, y0, x1, y1) in pixels, x1/y1 exclusive


def for_display(images: np.ndarray) -> np.ndarray:
    """(n, H, W, C) normalized images → [0, 1], each image min-max scaled over its pixels."""
    x = np.asarray(images, np.float64)
    lo = x.min(axis=(1, 2, 3), keepdims=True)
    hi = x.max(axis=(1, 2, 3), keepdims=True)
    return (x - lo) / np.where(hi > lo, hi - lo, 1.0)


def pca_rgb(tokens: np.ndarray) -> tuple[np.ndarray, float]:
    """(n, h, w, d) patch tokens → ((n, h, w, 3) in [0, 1], explained share of the variance).

    docs/method/dense.md §8: the top 3 principal axes of all n·h·w tokens (float64, centred, each
    axis's largest-magnitude entry positive), projections min-max scaled over all tokens.
    """
    n, h, w, d = tokens.shape
    x = np.asarray(tokens, np.float64).reshape(-1, d)
    x = x - x.mean(axis=0)
    _, s, vt = np.linalg.svd(x, full_matrices=False)
    k = min(3, vt.shape[0])
    axes = vt[:k]
    signs = np.sign(axes[np.arange(k), np.abs(axes).argmax(axis=1)])
    proj = x @ (axes * signs[:, None]).T
    lo, hi = proj.min(axis=0), proj.max(axis=0)
    rgb = (proj - lo) / np.where(hi > lo, hi - lo, 1.0)
    if k < 3:
        rgb = np.concatenate([rgb, np.zeros((rgb.shape[0], 3 - k))], axis=1)
    total = float(np.sum(s**2))
    return rgb.reshape(n, h, w, 3), float(np.sum(s[:k] ** 2) / total) if total > 0 else 0.0


def upsample_nearest(grid_images: np.ndarray, hw: tuple[int, int]) -> np.ndarray:
    """(n, h, w, C) → (n, H, W, C) by repeating each cell (H, W multiples of h, w)."""
    _, h, w, _ = grid_images.shape
    return np.repeat(np.repeat(grid_images, hw[0] // h, axis=1), hw[1] // w, axis=2)


def image_grid(
    path: str,
    rows: Sequence[tuple[str, np.ndarray]],
    title: str,
    boxes: dict[int, Sequence[Sequence[tuple[Box, str]]]] | None = None,
) -> None:
    """A PNG with one column per image and one row per (label, (n, H, W, C) images in [0, 1]);
    NaN pixels are shown as a flat blue-grey. `boxes[r][i]`: (box, colour) pairs drawn on image i
    of row r."""
    import matplotlib
    from matplotlib.figure import Figure  # no pyplot: the caller's backend (a notebook's) is left alone
    from matplotlib.patches import Rectangle

    n = rows[0][1].shape[0]
    fig = Figure(figsize=(1.2 * n, 1.3 * len(rows) + 0.3))
    axes = fig.subplots(len(rows), n, squeeze=False)
    cmap = matplotlib.colormaps["gray"].with_extremes(bad="#7f7fbf")
    for r, (label, images) in enumerate(rows):
        for i in range(n):
            ax = axes[r][i]
            image = images[i][..., 0] if images[i].shape[-1] == 1 else images[i]
            ax.imshow(np.ma.masked_invalid(image), cmap=cmap if image.ndim == 2 else None, vmin=0, vmax=1,
                      interpolation="nearest")
            for (x0, y0, x1, y1), colour in (boxes or {}).get(r, [[]] * n)[i]:
                ax.add_patch(Rectangle((x0 - 0.5, y0 - 0.5), x1 - x0, y1 - y0, fill=False, edgecolor=colour, lw=1.2))
            ax.set_xticks([])
            ax.set_yticks([])
            if i == 0:
                ax.set_ylabel(label, fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
