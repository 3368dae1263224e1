"""The stem: patchify → Token Graying → patch projection (docs/method/papers.md §4).

`PatchStem` is the ViT's patch embedding written as `patchify` + a (p²C, d) matrix, the same
function as the stride-p convolution, so that Token Graying acts on the raw (B, n, p²C) patch
matrix. `token_gray_images` is Token Graying as an image-to-image transform at a given token
size, for families whose stem is not a plain patch projection (e.g. overlapping or
convolutional stems): TG on the stride-p patch matrix, mapped back to the image, then the
model's own stem.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from skipless_jax import token_graying as tg_lib
from skipless_jax.models import roles
from skipless_jax.models.common import patchify, unpatchify

# The roles of a `PatchStem`'s parameters under the name every family gives it, `embedding`.
STEM_ROLES = ((r"(^|/)embedding/kernel$", roles.PATCH_KERNEL), (r"(^|/)embedding/bias$", roles.PATCH_BIAS))


def token_gray_patches(patches: jax.Array, method: str | None, eps: float) -> jax.Array:
    """Token Graying of a (B, n, p²C) patch matrix per image; `method=None` is the identity."""
    if method is None:
        return patches
    return tg_lib.TOKEN_GRAYING[method](patches, eps)


def token_gray_images(images: jax.Array, patch_size: int, method: str | None, eps: float) -> jax.Array:
    """(B, H, W, C) -> (B, H, W, C): TG on the stride-`patch_size` patch matrix, mapped back."""
    if method is None:
        return images
    b, h, w, c = images.shape
    grayed = token_gray_patches(patchify(images, patch_size), method, eps)
    return unpatchify(grayed, (h // patch_size, w // patch_size), patch_size, c)


class PatchStem(nn.Module):
    """(B, H, W, C) images -> ((B, n, width) tokens, (B, n, p²C) patch matrix after TG).

    Its parameters are `kernel` (p²C, width) and `bias` (width), as an `nn.Dense` named like
    this module would have.
    """

    width: int
    patch_size: int
    token_graying: str | None = None
    tg_eps: float = 0.95
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, images: jax.Array) -> tuple[jax.Array, jax.Array]:
        x = patchify(images.astype(jnp.float32), self.patch_size)
        x = token_gray_patches(x, self.token_graying, self.tg_eps)  # TG before the projection
        kernel = self.param("kernel", nn.initializers.lecun_normal(), (x.shape[-1], self.width), jnp.float32)
        bias = self.param("bias", nn.initializers.zeros, (self.width,), jnp.float32)
        tokens = x.astype(self.dtype) @ kernel.astype(self.dtype) + bias.astype(self.dtype)
        return tokens, x
