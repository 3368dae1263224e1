"""The device end of the input pipeline: uint8 images from the host become the model's inputs.

The host pipeline (data/pipeline.py) ships images as uint8, a quarter of the float32 bytes,
and the per-example random erasing as its box alone; inside the jitted step, over the global
batch:

    x = (u / 255 − mean) / std                 per channel, float32 (docs/method/papers.md §1 recipe)
    x[top:top+h, left:left+w] = z,  z ~ N(0, 1) per pixel and channel   (timm 'pixel' erasing;
                                    box (top, left, h, w) from the host, h = w = 0: none)

The noise comes from `key` (the trainer's fold_in(run key, step, rng_streams.ERASE)) over the whole
global batch, so it is the same whatever the number of processes, devices or workers.
`augment.TrainTransform` (uint8=False) is the host reference of the same chain.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp


def normalize(images: jax.Array, mean: Sequence[float], std: Sequence[float]) -> jax.Array:
    """uint8 (..., C) -> float32 (u/255 − mean)/std; float input is taken as already normalized."""
    if jnp.issubdtype(images.dtype, jnp.floating):
        return images
    x = images.astype(jnp.float32) / 255.0
    return (x - jnp.asarray(mean, jnp.float32)) / jnp.asarray(std, jnp.float32)


def erase(images: jax.Array, boxes: jax.Array, key: jax.Array) -> jax.Array:
    """(B, H, W, C) float with (B, 4) int boxes (top, left, h, w): each box replaced by N(0, 1) noise."""
    _, height, width, _ = images.shape
    top, left, h, w = (boxes[:, i, None] for i in range(4))
    rows = (jnp.arange(height) >= top) & (jnp.arange(height) < top + h)  # (B, H)
    cols = (jnp.arange(width) >= left) & (jnp.arange(width) < left + w)  # (B, W)
    inside = rows[:, :, None, None] & cols[:, None, :, None]
    noise = jax.random.normal(key, images.shape, images.dtype)
    return jnp.where(inside, noise, images)


def prepare(batch: Mapping[str, Any], mean: Sequence[float], std: Sequence[float], key: jax.Array | None = None,
            fields: Sequence[str] = ("image",)) -> dict[str, Any]:
    """The batch with its image `fields` normalized and, where it carries `erase` boxes, erased
    (noise from `key`); the `erase` entry is dropped."""
    out = {k: v for k, v in batch.items() if k != "erase"}
    for name in fields:
        if name in out:
            out[name] = normalize(out[name], mean, std)
    if "erase" in batch:
        if key is None:
            raise ValueError("a batch with random-erasing boxes needs a key for the noise")
        out["image"] = erase(out["image"], batch["erase"], key)
    return out


def dataset_stats(config: Any) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(mean, std) of `config.dataset.name`, on the [0, 1] scale."""
    from skipless_jax.data import sources

    info = sources.dataset_info(config.dataset.name)
    return info.mean, info.std
