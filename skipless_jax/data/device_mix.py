"""Mixup / CutMix per data shard inside the jitted train step (docs/method/recipes.md §23, docs/data.md,
"Augmentation"), the project's one mixup.

timm's Mixup in 'batch' mode applied to each device's slice of the global batch, as DeiT and MAE
run it on each GPU's local batch. Shard s of S (S = the devices of the mesh's data axes, 1
outside a mesh) draws from fold_in(key, s), `key` = fold_in(run key, step), MIX:

    with probability `prob`: CutMix with probability `switch_prob` when both are on (λ ~
    Beta(cutmix_alpha), timm's box: side ⌊H·√(1−λ)⌋ × ⌊W·√(1−λ)⌋ centred at a uniform pixel,
    clipped, λ ← 1 − box area / image area), else mixup (λ ~ Beta(mixup_alpha), x ← λx + (1−λ)x_rev);
    labels λ·y + (1 − λ)·y_rev, x_rev / y_rev the shard reversed.

The global batch is viewed as (S, B/S, ...) with the shard axis split over the data axes, so the
mix is local to each device (no collective over the images). The mixed batch depends on S
(docs/design.md, "1 vs 8 devices"), not on the process or worker count.

Label smoothing stays in the loss (smoothing and mixing commute).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from skipless_jax import sharding


def draws(
    key: jax.Array, height: int, width: int, mixup_alpha: float, cutmix_alpha: float, switch_prob: float,
    prob: float,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(λ, use_cutmix, box (top, left, h, w) int32) from `key`; λ = 1 when the batch is not mixed."""
    k_apply, k_switch, k_mix, k_cut, k_y, k_x = jax.random.split(key, 6)
    on = (mixup_alpha > 0 or cutmix_alpha > 0) & (jax.random.uniform(k_apply) < prob)
    if mixup_alpha > 0 and cutmix_alpha > 0:
        use_cutmix = jax.random.uniform(k_switch) < switch_prob
    else:
        use_cutmix = jnp.asarray(cutmix_alpha > 0)
    lam_mix = jax.random.beta(k_mix, mixup_alpha, mixup_alpha) if mixup_alpha > 0 else jnp.float32(1.0)
    lam_cut = jax.random.beta(k_cut, cutmix_alpha, cutmix_alpha) if cutmix_alpha > 0 else jnp.float32(1.0)
    lam = jnp.where(on, jnp.where(use_cutmix, lam_cut, lam_mix), 1.0).astype(jnp.float32)
    cut = jnp.sqrt(1.0 - lam)
    cut_h, cut_w = (height * cut).astype(jnp.int32), (width * cut).astype(jnp.int32)
    cy = jax.random.randint(k_y, (), 0, height)
    cx = jax.random.randint(k_x, (), 0, width)
    top, bottom = jnp.clip(cy - cut_h // 2, 0, height), jnp.clip(cy + cut_h // 2, 0, height)
    left, right = jnp.clip(cx - cut_w // 2, 0, width), jnp.clip(cx + cut_w // 2, 0, width)
    box = jnp.stack([top, left, bottom - top, right - left]).astype(jnp.int32)
    return lam, on & use_cutmix, box


def apply(
    images: jax.Array, labels: jax.Array, lam: jax.Array, use_cutmix: jax.Array, box: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """The mix for given draws: (images (B, H, W, C), soft labels (B, K) float32)."""
    reverse, labels_reverse = images[::-1], labels[::-1]
    height, width = images.shape[1:3]
    rows = jnp.arange(height)[:, None]
    cols = jnp.arange(width)[None, :]
    inside = (rows >= box[0]) & (rows < box[0] + box[2]) & (cols >= box[1]) & (cols < box[1] + box[3])
    cut_images = jnp.where(inside[None, :, :, None], reverse, images)
    cut_lam = 1.0 - (box[2] * box[3]).astype(jnp.float32) / (height * width)
    mix_images = (images * lam + reverse * (1.0 - lam)).astype(images.dtype)
    out = jnp.where(use_cutmix, cut_images, mix_images)
    lam = jnp.where(use_cutmix, cut_lam, lam)
    mixed = lam * labels.astype(jnp.float32) + (1.0 - lam) * labels_reverse.astype(jnp.float32)
    return out, mixed


def num_shards() -> int:
    """S: the devices of the data axes of the mesh being traced under (`jax.set_mesh`); 1 outside one."""
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if mesh.empty else sharding.num_data_shards(mesh)


def shard_draws(
    key: jax.Array, shards: int, height: int, width: int, aug: Any
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Shard s's `draws(fold_in(key, s), ...)` with the settings of `config.input.aug` (mixup,
    cutmix, mixup_switch_prob, mixup_prob): (λ (S,), use_cutmix (S,), box (S, 4))."""
    settings = (float(aug.get("mixup", 0.0) or 0.0), float(aug.get("cutmix", 0.0) or 0.0),
                float(aug.get("mixup_switch_prob", 0.5)),
                float(aug.get("mixup_prob", 1.0) if aug.get("mixup_prob") is not None else 1.0))
    keys = jax.vmap(lambda s: jax.random.fold_in(key, s))(jnp.arange(shards))
    return jax.vmap(lambda k: draws(k, height, width, *settings))(keys)


def apply_per_shard(
    images: jax.Array, labels: jax.Array, lam: jax.Array, use_cutmix: jax.Array, box: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """`apply` on each of the S = len(lam) consecutive equal slices of the batch with its own
    draws: (images (B, H, W, C), soft labels (B, K) float32), B divisible by S."""
    shards, batch = lam.shape[0], images.shape[0]
    if batch % shards:
        raise ValueError(f"a batch of {batch} images does not split into {shards} equal mixing shards")

    def per_shard(x):  # (B, ...) -> (S, B/S, ...), shard s on the devices of data shard s
        return sharding.constrain_batch(x.reshape(shards, batch // shards, *x.shape[1:]))

    out, mixed = jax.vmap(apply)(per_shard(images), per_shard(labels), lam, use_cutmix, box)
    return (sharding.constrain_batch(out.reshape(images.shape)),
            sharding.constrain_batch(mixed.reshape(labels.shape)))


def mixup_cutmix(
    key: jax.Array, images: jax.Array, labels: jax.Array, aug: Any, shards: int | None = None
) -> tuple[jax.Array, jax.Array]:
    """`apply_per_shard(shard_draws(key, S, ...))`, S = `shards` or `num_shards()`."""
    lam, use_cutmix, box = shard_draws(key, shards or num_shards(), images.shape[1], images.shape[2], aug)
    return apply_per_shard(images, labels, lam, use_cutmix, box)


def enabled(config: Any) -> bool:
    """Whether the supervised step mixes the batch (`config.input.aug` with mixup or cutmix on)."""
    aug = config.input.get("aug")
    return aug is not None and bool(aug.get("mixup", 0) or aug.get("cutmix", 0))
