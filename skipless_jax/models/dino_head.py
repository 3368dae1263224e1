"""The DINO projection head and the backbone + head pair that DINO trains (docs/method/ssl.md §6).

    head(x) = WN-Linear(256→K, no bias)( l2_normalize( MLP(x) ) ),
    MLP = Linear(d→2048) – GELU – Linear(2048→2048) – GELU – Linear(2048→256),

where WN-Linear is the weight-normalized layer w_k = g_k · v_k / ‖v_k‖ per output unit k, with
g = 1 frozen when `norm_last_layer` (DINO's default). `DINO` runs the ViT backbone once per
crop resolution (its learned position table is resized for local crops, models/vit.py) and the
head once on all CLS features, like DINO's multi-crop wrapper.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from skipless_jax.models import roles

LAST_LAYER = "last_layer"  # the module name that last-layer freezing matches
# The roles of the names this module spells (models/roles.py): the MLP's Dense layers `mlp_i` and
# the weight-normalized last layer's direction v are kernels, g its per-output scale.
ROLES = ((r"(^|/)mlp_\d+/kernel$", roles.KERNEL), (r"(^|/)mlp_\d+/bias$", roles.BIAS),
         (rf"(^|/){LAST_LAYER}_v$", roles.KERNEL), (rf"(^|/){LAST_LAYER}_g$", roles.WEIGHT_NORM_SCALE))


def l2_normalize(x: jax.Array, eps: float = 1e-12) -> jax.Array:
    """x / max(‖x‖₂, eps) along the last axis (torch F.normalize semantics)."""
    norm = jnp.sqrt(jnp.sum(jnp.square(x), axis=-1, keepdims=True))
    return x / jnp.maximum(norm, eps)


def weight_normalize(v: jax.Array, g: jax.Array | float = 1.0) -> jax.Array:
    """(in, out) kernel with each output column rescaled to norm g: w[:, k] = g_k·v[:, k]/‖v[:, k]‖."""
    return v * (g / jnp.sqrt(jnp.sum(jnp.square(v), axis=0, keepdims=True)))


def _torch_linear_init(key: jax.Array, shape: tuple[int, ...], dtype: Any = jnp.float32) -> jax.Array:
    # U(−1/√in, 1/√in): torch's default Linear init, which DINO's last layer keeps.
    bound = shape[0] ** -0.5
    return jax.random.uniform(key, shape, dtype, -bound, bound)


class DINOHead(nn.Module):
    """(B, d) features -> (B, out_dim) float32 head outputs (logits before the temperature)."""

    out_dim: int = 65536
    hidden_dim: int = 2048
    bottleneck_dim: int = 256
    num_layers: int = 3
    norm_last_layer: bool = True
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        dense = dict(
            kernel_init=nn.initializers.truncated_normal(stddev=0.02),
            bias_init=nn.initializers.zeros,
            dtype=self.dtype,
        )
        widths = [self.hidden_dim] * (self.num_layers - 1) + [self.bottleneck_dim]
        for i, width in enumerate(widths):
            x = nn.Dense(width, name=f"mlp_{i}", **dense)(x)
            if i < len(widths) - 1:
                x = nn.gelu(x, approximate=False)
        x = l2_normalize(x.astype(jnp.float32))
        with_scale = not self.norm_last_layer
        v = self.param(f"{LAST_LAYER}_v", _torch_linear_init, (self.bottleneck_dim, self.out_dim), jnp.float32)
        g = self.param(f"{LAST_LAYER}_g", nn.initializers.ones, (self.out_dim,), jnp.float32) if with_scale else 1.0
        return x @ weight_normalize(v, g)


class DINO(nn.Module):
    """ViT backbone + DINO head.

    `__call__(views, train)`: `views` is a sequence of (n_i, H_i, W_i, C) batches, one per
    resolution; returns (head outputs (Σn_i, K) float32, CLS features (Σn_i, d)) in view order.
    `embed(images)`: the backbone features (B, d) alone, for kNN and linear evaluation.
    """

    backbone: nn.Module
    head: DINOHead

    def embed(self, images: jax.Array) -> jax.Array:
        _, out = self.backbone(images, train=False)
        return out["pre_logits"]

    def backbone_outputs(self, images: jax.Array) -> dict:
        """The backbone's intermediates dict (patch tokens, keys, ①..④) at eval, for dense evaluators."""
        return self.backbone(images, train=False)[1]

    def __call__(self, views: Sequence[jax.Array], train: bool = False) -> tuple[jax.Array, jax.Array]:
        feats = jnp.concatenate([self.backbone(v, train=train)[1]["pre_logits"] for v in views], axis=0)
        return self.head(feats), feats
