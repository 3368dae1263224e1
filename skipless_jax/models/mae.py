"""Masked autoencoder (He et al., CVPR 2022; facebookresearch/mae `models_mae.py`), docs/method/ssl.md §9.

The three pieces of MAE's math are plain functions with the reference's semantics (the loss in
skipless_jax/losses.py, with the other trainers' losses):

    random_masking       per sample: ids_shuffle = argsort(noise) (small noise is kept),
                         ids_restore = argsort(ids_shuffle), keep the first K = int(L·(1 − ratio))
                         of the shuffle; mask = 1 on removed patches, in the original order.
    restore_tokens       the decoder's un-shuffle: [kept, mask tokens] gathered with ids_restore.
    reconstruction_loss  MSE per patch (mean over its p²C values), averaged over removed patches;
                         `norm_pix_loss`: target per patch (t − mean)/√(var + 1e-6), var unbiased
                         (torch's `.var` default).

Patch order. MAE's `patchify` is `imgs.reshape(N, C, h, p, w, p)` + einsum 'nchpwq->nhwpqc', i.e.
the patches row-major over the grid and each patch flattened as (row p, col q, channel c).
`common.patchify` reshapes NHWC to (B, h, p, w, p, C) and transposes to (B, h, w, p, p, C): the same
(row, col, channel) order, so the prediction's layout is MAE's (and `common.unpatchify` inverts it).

The encoder is the ViT's parts under the ViT's names ('embedding', 'cls', 'block_{i}',
'encoder_norm'), so a `vit.ViT(posemb='sincos2d', pool='tok')` classifier loads its parameters by
name (the classifier only adds 'head'). As in MAE, the fixed sin-cos embedding is added to the patch
tokens before masking and the CLS token (position embedding zero) is prepended after masking. Token
Graying, when set, acts in the stem on the full patch matrix, before masking; the reconstruction
target is the raw image's patches (`target='raw'`) or the grayed patch matrix (`target='grayed'`).

The decoder's position table is the repository's fixed 2-D sin-cos (`common.posemb_sincos_2d`, the
ViT's `sincos2d`) with a zero row for CLS; MAE's numpy table has the same block order but other
frequencies (docs/method/families.md §20), which for a fixed, non-learned embedding changes nothing of substance.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from skipless_jax import losses
from skipless_jax.models import roles, vit
from skipless_jax.models.blocks import EncoderBlock, ModelFields
from skipless_jax.models.common import posemb_sincos_2d, posemb_sincos_2d_cls, resize_posemb
from skipless_jax.models.stem import PatchStem

# The roles of the names this module spells (models/roles.py), after the encoder's (the ViT's).
ROLES = (*vit.ROLES, (r"(^|/)decoder/mask_token$", roles.MASK_TOKEN),
         (r"(^|/)decoder/decoder_(embed|pred)/kernel$", roles.KERNEL),
         (r"(^|/)decoder/decoder_(embed|pred)/bias$", roles.BIAS))


def num_kept(length: int, mask_ratio: float) -> int:
    """MAE's `len_keep = int(L * (1 - mask_ratio))` (floor)."""
    return int(length * (1 - mask_ratio))


def random_masking(
    tokens: jax.Array, mask_ratio: float, noise: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(B, L, D) tokens, (B, L) noise -> (kept (B, K, D), mask (B, L) float 1 = removed, ids_restore (B, L))."""
    length = tokens.shape[1]
    keep = num_kept(length, mask_ratio)
    ids_shuffle = jnp.argsort(noise, axis=1, stable=True)  # ascending: small noise is kept
    ids_restore = jnp.argsort(ids_shuffle, axis=1, stable=True)
    ids_keep = ids_shuffle[:, :keep]
    kept = jnp.take_along_axis(tokens, ids_keep[:, :, None], axis=1)
    mask = jnp.ones(noise.shape, tokens.dtype).at[:, :keep].set(0)  # in shuffled order ...
    mask = jnp.take_along_axis(mask, ids_restore, axis=1)  # ... back to the original order
    return kept, mask, ids_restore


def restore_tokens(x_kept: jax.Array, mask_token: jax.Array, ids_restore: jax.Array) -> jax.Array:
    """(B, K, D) kept tokens -> (B, L, D): each back at its original index, mask tokens elsewhere."""
    b, k, d = x_kept.shape
    length = ids_restore.shape[1]
    fill = jnp.broadcast_to(mask_token.astype(x_kept.dtype), (b, length - k, d))
    shuffled = jnp.concatenate([x_kept, fill], axis=1)  # the shuffled order, as in random_masking
    return jnp.take_along_axis(shuffled, ids_restore[:, :, None], axis=1)


def encoder_position_table(grid: int, width: int, shape: tuple[int, ...]) -> jax.Array:
    """The MAE encoder's fixed table as a classifier's learned `pos_embedding` of `shape`
    (1, 1 + g², width): [0; sincos2d(grid, grid)] at the pre-training grid, resized to g × g
    bicubically if g differs (MAE's `interpolate_pos_embed`, docs/method/ssl.md §9)."""
    table = posemb_sincos_2d_cls(grid, grid, width)
    if tuple(shape) == tuple(table.shape):
        return table
    g = int(round((shape[1] - 1) ** 0.5))
    if shape[0] != 1 or shape[2] != width or g * g != shape[1] - 1:
        raise ValueError(f"a position table of shape {tuple(shape)} is not (1, 1 + g², {width})")
    return resize_posemb(table, g, g, extra=1)


_XAVIER = dict(kernel_init=nn.initializers.xavier_uniform(), bias_init=nn.initializers.zeros)


class MAEDecoder(nn.Module):
    """(latent (B, 1+K, d) with CLS first, ids_restore (B, L)) -> per-patch prediction (B, L, p²C).

    `grid_hw` is the patch grid (grid_h·grid_w = L); the skips of its blocks are switches too.
    """

    grid_hw: tuple[int, int]
    patch_dim: int  # p²·C
    width: int = 512
    depth: int = 8
    num_heads: int = 16
    mlp_ratio: int = 4
    skip_sab: bool = True
    skip_ffn: bool = True
    gelu_approximate: bool = True
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, latent: jax.Array, ids_restore: jax.Array, train: bool = False) -> jax.Array:
        x = nn.Dense(self.width, dtype=self.dtype, name="decoder_embed", **_XAVIER)(latent)
        mask_token = self.param("mask_token", nn.initializers.normal(stddev=0.02), (self.width,), jnp.float32)
        x = jnp.concatenate([x[:, :1], restore_tokens(x[:, 1:], mask_token, ids_restore)], axis=1)
        x = x + posemb_sincos_2d_cls(*self.grid_hw, self.width).astype(x.dtype)
        for layer in range(self.depth):
            x, _ = EncoderBlock(
                mlp_dim=self.mlp_ratio * self.width,
                num_heads=self.num_heads,
                skip_sab=self.skip_sab,
                skip_ffn=self.skip_ffn,
                gelu_approximate=self.gelu_approximate,
                dtype=self.dtype,
                name=f"decoder_block_{layer}",
            )(x, train)
        x = nn.LayerNorm(dtype=self.dtype, name="decoder_norm")(x)
        x = nn.Dense(self.patch_dim, dtype=self.dtype, name="decoder_pred", **_XAVIER)(x)
        return x[:, 1:].astype(jnp.float32)  # CLS dropped


class MAE(ModelFields):
    """MAE pre-training: `(images (B, H, W, C), train, noise=None) -> (loss, prediction (B, L, p²C), mask (B, L))`.

    The encoder fields are the ViT's (`vit.ViT`); `noise` (B, L) defaults to uniform noise from the
    'masking' rng stream. The encoder's output and ids_restore are sown as
    intermediates 'latent' and 'ids_restore'.
    """

    patch_size: int = 16
    width: int = 768
    depth: int = 12
    mlp_dim: int = 3072
    num_heads: int = 12
    gelu_approximate: bool = True
    attention_impl: str | None = None  # the encoder's (vit.encoder_blocks reads these three)
    remat: str | None = None
    scan: bool = False
    # MAE specifics
    mask_ratio: float = 0.75
    norm_pix_loss: bool = False
    decoder_width: int = 512
    decoder_depth: int = 8
    decoder_num_heads: int = 16
    decoder_mlp_ratio: int = 4
    decoder_skip_sab: bool = True
    decoder_skip_ffn: bool = True
    target: str = "raw"  # 'raw': the input image's patches; 'grayed': the patch matrix after TG

    def _encode(
        self, images: jax.Array, noise: jax.Array, train: bool
    ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        """MAE's `forward_encoder`: (latent (B, 1+K, width), mask (B, L), ids_restore (B, L),
        the stem's patch matrix after TG (B, L, p²C)).

        Called from `__call__` only (its submodules are defined inline there).
        """
        p = self.patch_size
        grid_h, grid_w = images.shape[1] // p, images.shape[2] // p
        stem = PatchStem(self.width, p, self.token_graying, self.tg_eps, self.dtype, name="embedding")
        x, grayed = stem(images)
        x = x + posemb_sincos_2d(grid_h, grid_w, x.shape[-1]).astype(x.dtype)  # before masking
        x, mask, ids_restore = random_masking(x, self.mask_ratio, noise)
        x = vit.prepend_cls(self, x)  # the class token's position embedding is 0
        x, _ = vit.encoder_blocks(self, x, train)
        return x, mask, ids_restore, grayed

    @nn.compact
    def __call__(
        self, images: jax.Array, train: bool = False, noise: jax.Array | None = None
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        p = self.patch_size
        grid_hw = (images.shape[1] // p, images.shape[2] // p)
        if noise is None:
            noise = jax.random.uniform(self.make_rng("masking"), (images.shape[0], grid_hw[0] * grid_hw[1]))
        latent, mask, ids_restore, grayed = self._encode(images, noise, train)
        self.sow("intermediates", "latent", latent)  # apply(..., mutable=["intermediates"]) reads them
        self.sow("intermediates", "ids_restore", ids_restore)
        prediction = MAEDecoder(
            grid_hw=grid_hw,
            patch_dim=p * p * images.shape[-1],
            width=self.decoder_width,
            depth=self.decoder_depth,
            num_heads=self.decoder_num_heads,
            mlp_ratio=self.decoder_mlp_ratio,
            skip_sab=self.decoder_skip_sab,
            skip_ffn=self.decoder_skip_ffn,
            gelu_approximate=self.gelu_approximate,
            dtype=self.dtype,
            name="decoder",
        )(latent, ids_restore, train)
        if self.target == "grayed":
            loss = losses.patch_loss(grayed, prediction, mask, self.norm_pix_loss)
        else:
            loss = losses.reconstruction_loss(images, prediction, mask, p, self.norm_pix_loss)
        return loss, prediction, mask
