"""Vision Transformer whose attention and MLP residuals are switches (METHOD.md §1).

    y = SA(LN1(x));   x = x + y  if skip_sab else y        # ① SAB output, ② identity
    z = MLP(LN2(x));  x = x + z  if skip_ffn else z        # ③ FFN output, ④ identity

`ViT(...)(images, train=...)` returns `(logits, out)`; `out` holds every intermediate the
analysis code needs (①, ①+②, ③, ③+④ per layer), so there is no second model to keep in sync.
"""

from __future__ import annotations

import re
from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from skipless_jax import token_graying as tg_lib
from skipless_jax.models import init as init_lib

# (width, depth, mlp_dim, num_heads) of the standard ViT sizes.
VARIANTS: dict[str, tuple[int, int, int, int]] = {
    "Ti": (192, 12, 768, 3),
    "S": (384, 12, 1536, 6),
    "M": (512, 12, 2048, 8),
    "B": (768, 12, 3072, 12),
    "L": (1024, 24, 4096, 16),
    "H": (1280, 32, 5120, 16),
}
ATTENTION_KERNELS = ("query", "key", "value", "out")
POOLS = ("tok", "gap")
POSEMBS = ("learn", "sincos2d")


def decode_variant(variant: str) -> dict[str, int]:
    """'B/16' -> dict(width=768, depth=12, mlp_dim=3072, num_heads=12, patch_size=16)."""
    match = re.fullmatch(r"(\w+)/(\d+)", variant or "")
    if match is None or match.group(1) not in VARIANTS:
        raise ValueError(
            f"config.model.variant={variant!r} is not a ViT variant; allowed: "
            f"'<size>/<patch>' with size in {sorted(VARIANTS)}, e.g. 'B/16'"
        )
    width, depth, mlp_dim, num_heads = VARIANTS[match.group(1)]
    return dict(
        width=width,
        depth=depth,
        mlp_dim=mlp_dim,
        num_heads=num_heads,
        patch_size=int(match.group(2)),
    )


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


def posemb_sincos_2d(
    grid_h: int, grid_w: int, width: int, temperature: float = 10_000.0
) -> jax.Array:
    """Fixed 2-D sine-cosine position embedding, (1, grid_h·grid_w, width)."""
    if width % 4:
        raise ValueError(f"config.model.width={width} must be divisible by 4 for sincos2d")
    y, x = jnp.mgrid[:grid_h, :grid_w]
    omega = 1.0 / temperature ** (jnp.arange(width // 4) / (width // 4 - 1 or 1))
    y = y.reshape(-1)[:, None] * omega[None, :]
    x = x.reshape(-1)[:, None] * omega[None, :]
    pe = jnp.concatenate([jnp.sin(x), jnp.cos(x), jnp.sin(y), jnp.cos(y)], axis=1)
    return pe[None].astype(jnp.float32)


def resize_posemb(posemb: jax.Array, grid_h: int, grid_w: int) -> jax.Array:
    """Bicubic resize of a square (1, g·g, d) grid embedding to (1, grid_h·grid_w, d)."""
    n, d = posemb.shape[1:]
    g = int(round(n**0.5))
    if (g, g) == (grid_h, grid_w):
        return posemb
    grid = posemb.reshape(1, g, g, d)
    grid = jax.image.resize(grid, (1, grid_h, grid_w, d), method="bicubic")
    return grid.reshape(1, grid_h * grid_w, d)


class MultiHeadAttention(nn.Module):
    """SA(X) = softmax(Q Kᵀ/√d_h) V Wᴼ, Q = X Wᵠ, K = X Wᴷ, V = X Wⱽ (heads = column groups).

    The four kernels are (d, d) params `query`, `key`, `value`, `out`, so that the skipless
    initialization (models/init.py) can set the full WⱽWᴼ product of the layer at once.
    """

    num_heads: int
    init_scheme: str = "default"
    init_alpha: float = 1.0
    init_beta: float = 1.0
    init_c: float = 1.0
    dtype: Any = jnp.float32

    def _kernels(self, d: int) -> dict[str, jax.Array]:
        if self.init_scheme == "default":
            xavier = nn.initializers.xavier_uniform()
            return {n: self.param(n, xavier, (d, d), jnp.float32) for n in ATTENTION_KERNELS}
        # The skipless and mimetic inits draw the four kernels jointly from one key.
        joint = None
        if self.is_initializing():
            joint = init_lib.attention_kernels(
                self.make_rng("params"), self.init_scheme, d, self.num_heads,
                self.init_alpha, self.init_beta, self.init_c,
            )
        # Flax evaluates an initializer's shape on apply too; outside init it is a placeholder.
        return {
            n: self.param(
                n,
                lambda _, n=n: jnp.zeros((d, d), jnp.float32) if joint is None else jnp.asarray(joint[n], jnp.float32),
            )
            for n in ATTENTION_KERNELS
        }

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        b, n, d = x.shape
        h = self.num_heads
        kernels = self._kernels(d)
        biases = {
            name: self.param(f"{name}_bias", nn.initializers.zeros, (d,), jnp.float32)
            for name in ATTENTION_KERNELS
        }

        def project(inputs: jax.Array, name: str) -> jax.Array:
            k = kernels[name].astype(self.dtype)
            return inputs.astype(self.dtype) @ k + biases[name].astype(self.dtype)

        q, k, v = (project(x, name).reshape(b, n, h, d // h) for name in ("query", "key", "value"))
        heads = jax.nn.dot_product_attention(q, k, v)  # scale 1/√d_h, as in the standard block
        return project(heads.reshape(b, n, d), "out")


class MlpBlock(nn.Module):
    """Dense(d→mlp_dim) – GELU – Dense(mlp_dim→d)."""

    mlp_dim: int
    init_scheme: str = "default"
    dropout: float = 0.0
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, train: bool) -> jax.Array:
        if self.init_scheme == "skipless":  # scaled uniform orthogonal, zero biases (METHOD.md §3)
            kernel_init, bias_init = init_lib.scaled_uniform_orthogonal, nn.initializers.zeros
        else:
            kernel_init = nn.initializers.xavier_uniform()
            bias_init = nn.initializers.normal(stddev=1e-6)
        d = x.shape[-1]
        dense = dict(kernel_init=kernel_init, bias_init=bias_init, dtype=self.dtype)
        x = nn.Dense(self.mlp_dim, **dense)(x)
        x = nn.gelu(x)
        x = nn.Dropout(self.dropout)(x, deterministic=not train)
        return nn.Dense(d, **dense)(x)


class DropPath(nn.Module):
    """Stochastic depth: drops the residual branch per example with probability `rate`."""

    rate: float

    @nn.compact
    def __call__(self, x: jax.Array, train: bool) -> jax.Array:
        if not train or self.rate == 0.0:
            return x
        keep = 1.0 - self.rate
        mask = jax.random.bernoulli(self.make_rng("dropout"), keep, (x.shape[0],) + (1,) * (x.ndim - 1))
        return jnp.where(mask, x / keep, 0.0).astype(x.dtype)


class EncoderBlock(nn.Module):
    """Pre-LN block; each residual is the one line marked ② or ④."""

    mlp_dim: int
    num_heads: int
    skip_sab: bool = True
    skip_ffn: bool = True
    drop_path: float = 0.0
    dropout: float = 0.0
    init_scheme: str = "default"
    init_alpha: float = 1.0
    init_beta: float = 1.0
    init_c: float = 1.0
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, train: bool) -> tuple[jax.Array, dict[str, jax.Array]]:
        out = {}
        y = nn.LayerNorm(dtype=self.dtype)(x)
        y = MultiHeadAttention(
            self.num_heads, self.init_scheme, self.init_alpha, self.init_beta, self.init_c, self.dtype
        )(y)
        y = nn.Dropout(self.dropout)(y, deterministic=not train)
        out["sab"], out["sab_skip"] = y, x + y
        # Drop-path only ever drops a branch beside a skip; without the skip it is off.
        y_dropped = DropPath(self.drop_path if self.skip_sab else 0.0)(y, train)
        x = x + y_dropped if self.skip_sab else y  # ② the attention skip

        z = nn.LayerNorm(dtype=self.dtype)(x)
        z = MlpBlock(self.mlp_dim, self.init_scheme, self.dropout, self.dtype)(z, train)
        z = nn.Dropout(self.dropout)(z, deterministic=not train)
        out["ffn"], out["ffn_skip"] = z, x + z
        z_dropped = DropPath(self.drop_path if self.skip_ffn else 0.0)(z, train)
        x = x + z_dropped if self.skip_ffn else z  # ④ the MLP skip
        return x, out


class ViT(nn.Module):
    """ViT on (B, H, W, C) images -> (logits (B, num_classes) float32, intermediates dict).

    num_classes=0 builds a backbone without a classifier: it returns the pooled features
    (B, width) in place of the logits (DINO's student and teacher).

    Patch embedding is `patchify` + Dense, the same function as the stride-p convolution,
    so that Token Graying (METHOD.md §4) acts on the raw (B, n, p²C) patch matrix.
    """

    num_classes: int
    patch_size: int = 16
    width: int = 768
    depth: int = 12
    mlp_dim: int = 3072
    num_heads: int = 12
    skip_sab: bool = True
    skip_ffn: bool = True
    pool: str = "tok"
    posemb: str = "learn"
    dropout: float = 0.0
    drop_path: float = 0.0
    init_scheme: str = "default"
    init_alpha: float = 1.0
    init_beta: float = 1.0
    init_c: float = 1.0
    token_graying: Optional[str] = None
    tg_eps: float = 0.95
    head_zero_init: bool = True
    image_size: Optional[int] = None
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, images: jax.Array, train: bool = False) -> tuple[jax.Array, dict[str, Any]]:
        out: dict[str, Any] = {}
        p = self.patch_size
        grid_h, grid_w = images.shape[1] // p, images.shape[2] // p
        x = patchify(images.astype(jnp.float32), p)
        if self.token_graying is not None:  # Token Graying, before the patch projection
            x = tg_lib.TOKEN_GRAYING[self.token_graying](x, self.tg_eps)
        out["patches"] = x
        x = nn.Dense(self.width, dtype=self.dtype, name="embedding")(x)
        out["embedding"] = x

        b, n, d = x.shape
        if self.pool == "tok":
            cls = self.param("cls", nn.initializers.zeros, (1, 1, d), jnp.float32)
            x = jnp.concatenate([jnp.broadcast_to(cls.astype(x.dtype), (b, 1, d)), x], axis=1)
        if self.posemb == "learn":
            # The table is sized for `image_size` and resized for other resolutions (local crops).
            native = (self.image_size // p,) * 2 if self.image_size else (grid_h, grid_w)
            extra = int(self.pool == "tok")
            pe = self.param(
                "pos_embedding",
                nn.initializers.normal(stddev=d**-0.5),
                (1, extra + native[0] * native[1], d),
                jnp.float32,
            )
            if native != (grid_h, grid_w):
                pe = jnp.concatenate([pe[:, :extra], resize_posemb(pe[:, extra:], grid_h, grid_w)], 1)
        else:
            pe = posemb_sincos_2d(grid_h, grid_w, d)
            if self.pool == "tok":
                pe = jnp.concatenate([jnp.zeros((1, 1, d)), pe], axis=1)
        x = x + pe.astype(x.dtype)
        x = nn.Dropout(self.dropout)(x, deterministic=not train)

        out["blocks"] = []
        for layer in range(self.depth):
            x, block_out = EncoderBlock(
                mlp_dim=self.mlp_dim,
                num_heads=self.num_heads,
                skip_sab=self.skip_sab,
                skip_ffn=self.skip_ffn,
                drop_path=self.drop_path * layer / max(self.depth - 1, 1),
                dropout=self.dropout,
                init_scheme=self.init_scheme,
                init_alpha=self.init_alpha,
                init_beta=self.init_beta,
                init_c=self.init_c,
                dtype=self.dtype,
                name=f"block_{layer}",
            )(x, train)
            out["blocks"].append(block_out)
        x = nn.LayerNorm(dtype=self.dtype, name="encoder_norm")(x)
        out["encoded"] = x
        x = x[:, 0] if self.pool == "tok" else x.mean(axis=1)
        out["pre_logits"] = x
        if not self.num_classes:
            return x, out
        head_init = nn.initializers.zeros if self.head_zero_init else nn.initializers.lecun_normal()
        logits = nn.Dense(self.num_classes, kernel_init=head_init, dtype=self.dtype, name="head")(x)
        out["logits"] = logits.astype(jnp.float32)
        return out["logits"], out


def model_kwargs(model_config: Any, num_classes: int) -> dict[str, Any]:
    """ViT constructor arguments from `config.model` (a variant name fills the size fields)."""
    cfg = dict(model_config)
    variant = cfg.pop("variant", None)
    kwargs = dict(cfg)
    if variant:
        sizes = decode_variant(variant)
        # An explicit patch_size in the config wins over the variant's.
        kwargs.update({k: v for k, v in sizes.items() if k != "patch_size" or not cfg.get("patch_size")})
    kwargs["dtype"] = jnp.dtype(kwargs.get("dtype", "float32"))
    kwargs["init_scheme"] = kwargs.pop("init", "default")  # `init` would shadow Module.init
    return dict(num_classes=num_classes, **kwargs)


def build_model(model_config: Any, num_classes: int) -> ViT:
    return ViT(**model_kwargs(model_config, num_classes))
