"""Parts every model family shares: patchify, position-embedding utilities, DropPath, MLP.

Math lives in small functions (patchify, posemb_sincos_2d, resize_posemb); the modules only
wire them. Dense kernels are (in, out): y = x W (docs/method/papers.md §3).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from skipless_jax.models import init as init_lib


def patchify(images: jax.Array, patch_size: int) -> jax.Array:
    """(B, H, W, C) -> (B, n, p·p·C) raw patch matrix, row-major over the patch grid.

    The feature order (row, col, channel) matches a (p, p, C, d) conv kernel flattened, so
    `patchify(x, p) @ w.reshape(-1, d)` equals the stride-p convolution with kernel w.
    """
    b, h, w, c = images.shape
    p = patch_size
    x = images.reshape(b, h // p, p, w // p, p, c)
    x = x.transpose(0, 1, 3, 2, 4, 5)
    return x.reshape(b, (h // p) * (w // p), p * p * c)


def unpatchify(patches: jax.Array, grid_hw: tuple[int, int], patch_size: int, channels: int) -> jax.Array:
    """Inverse of `patchify`: (B, n, p·p·C) -> (B, H, W, C) for a (grid_h, grid_w) patch grid."""
    b = patches.shape[0]
    gh, gw = grid_hw
    p = patch_size
    x = patches.reshape(b, gh, gw, p, p, channels).transpose(0, 1, 3, 2, 4, 5)
    return x.reshape(b, gh * p, gw * p, channels)


def posemb_sincos_2d(grid_h: int, grid_w: int, width: int, temperature: float = 10_000.0) -> jax.Array:
    """Fixed 2-D sine-cosine position embedding, (1, grid_h·grid_w, width)."""
    if width % 4:
        raise ValueError(f"config.model.width={width} must be divisible by 4 for sincos2d")
    y, x = jnp.mgrid[:grid_h, :grid_w]
    omega = 1.0 / temperature ** (jnp.arange(width // 4) / (width // 4 - 1 or 1))
    y = y.reshape(-1)[:, None] * omega[None, :]
    x = x.reshape(-1)[:, None] * omega[None, :]
    pe = jnp.concatenate([jnp.sin(x), jnp.cos(x), jnp.sin(y), jnp.cos(y)], axis=1)
    return pe[None].astype(jnp.float32)


def posemb_sincos_2d_cls(grid_h: int, grid_w: int, width: int) -> jax.Array:
    """(1, 1 + grid_h·grid_w, width): a zero row for the class token, then `posemb_sincos_2d` (the
    MAE encoder's and decoder's fixed tables, and init='mae''s start of a learned one)."""
    return jnp.concatenate([jnp.zeros((1, 1, width)), posemb_sincos_2d(grid_h, grid_w, width)], axis=1)


def resize_posemb(posemb: jax.Array, grid_h: int, grid_w: int, antialias: bool = True, extra: int = 0) -> jax.Array:
    """(1, extra + g·g, d) position table -> (1, extra + grid_h·grid_w, d): the `extra` leading rows
    (a class token's) kept, the square grid part resized bicubically. The one position-table
    resizer: the ViT's other resolutions, MAE's encoder table and `init_from` (docs/method/ssl.md §9).

    `antialias=False` is DINO's `interpolate_pos_encoding` (torch bicubic without antialiasing,
    docs/method/ssl.md §6); with it, downsampling low-pass filters first (jax.image's default).
    """
    n, d = posemb.shape[1:]
    g = int(round((n - extra) ** 0.5))
    if (g, g) == (grid_h, grid_w):
        return posemb
    grid = jnp.asarray(posemb)[:, extra:].reshape(1, g, g, d)
    grid = jax.image.resize(grid, (1, grid_h, grid_w, d), method="bicubic", antialias=antialias)
    return jnp.concatenate([jnp.asarray(posemb)[:, :extra], grid.reshape(1, grid_h * grid_w, d)], axis=1)


def top_name(path: str) -> str:
    """The first name of a '/'-joined parameter path, a leading 'params/' skipped (the module a
    family's `layer_id` reads: 'block_3/MlpBlock_0/Dense_0/kernel' -> 'block_3')."""
    parts = path.strip("/").split("/")
    if parts and parts[0] == "params":
        parts = parts[1:]
    return parts[0] if parts else ""


# The scanned encoder's parameters (models/vit.py, `config.model.scan`): every leaf under this name
# carries a leading layer axis.
SCANNED_BLOCKS = "encoder_layers"


def layer_ndim(path: str, x: Any) -> int:
    """A parameter's rank per layer: its ndim, less the stacked layer axis under SCANNED_BLOCKS."""
    return x.ndim - int(SCANNED_BLOCKS in path.split("/"))


class DropPath(nn.Module):
    """Stochastic depth: drops the residual branch per example with probability `rate`."""

    rate: float

    @nn.compact
    def __call__(self, x: jax.Array, train: bool) -> jax.Array:
        # `rate` may be traced (a scanned layer's rate, models/vit.py); a Python 0 is skipped.
        if not train or (isinstance(self.rate, (int, float)) and self.rate == 0.0):
            return x
        keep = 1.0 - self.rate
        mask = jax.random.bernoulli(self.make_rng("dropout"), keep, (x.shape[0],) + (1,) * (x.ndim - 1))
        return jnp.where(mask, x / keep, 0.0).astype(x.dtype)


class MlpBlock(nn.Module):
    """Dense(d→mlp_dim) – GELU – Dense(mlp_dim→d); `gelu_approximate`: tanh form or exact erf.
    Under `init_scheme='skipless'` the biases are zero and the kernels scaled uniform orthogonal
    (`init_mlp='suo'`) or Xavier uniform (`'default'`, the authors' fork: docs/method/authors_init.md)."""

    mlp_dim: int
    init_scheme: str = "default"
    dropout: float = 0.0
    gelu_approximate: bool = True
    dtype: Any = jnp.float32
    init_mlp: str = "suo"

    @nn.compact
    def __call__(self, x: jax.Array, train: bool) -> jax.Array:
        if self.init_scheme == "skipless" and self.init_mlp == "default":
            kernel_init, bias_init = nn.initializers.xavier_uniform(), nn.initializers.zeros
        elif self.init_scheme in ("skipless", "orthogonal"):  # scaled uniform orthogonal, zero biases
            # (docs/method/papers.md §3)
            kernel_init, bias_init = init_lib.scaled_uniform_orthogonal, nn.initializers.zeros
        else:
            kernel_init = nn.initializers.xavier_uniform()
            bias_init = nn.initializers.normal(stddev=1e-6)
        d = x.shape[-1]
        dense = dict(kernel_init=kernel_init, bias_init=bias_init, dtype=self.dtype)
        x = nn.Dense(self.mlp_dim, **dense)(x)
        x = nn.gelu(x, approximate=self.gelu_approximate)
        x = nn.Dropout(self.dropout)(x, deterministic=not train)
        return nn.Dense(d, **dense)(x)
