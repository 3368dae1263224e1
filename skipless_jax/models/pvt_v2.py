"""PVTv2 (Wang et al., "PVT v2: Improved Baselines with Pyramid Vision Transformer"; timm's
`pvt_v2.py`), docs/method/families.md §10.

    stage s: overlapping patch embedding: conv k×k of stride t (k = 2t − 1, padding ⌊k/2⌋;
             stage 0: t = patch_size (4: the 7×7/4 stem), later stages t = 2) → LayerNorm
             blocks, pre-LN with the ViT's two residuals:
               y = SRA(LN1(x));    x = x + y  if skip_sab else y             # ①, ②
               z = DWMLP(LN2(x));  x = x + z  if skip_ffn else z             # ③, ④
             LayerNorm
    head:    mean over the last stage's tokens → Dense

SRA (spatial-reduction attention): queries from every token; keys and values from the grid
reduced by a conv of kernel = stride = sr_s (then LayerNorm), or from every token when sr_s = 1.
DWMLP: Dense(d → r·d) → depthwise 3×3 conv (with bias) on the token grid → GELU → Dense(r·d → d).
LayerNorm ε: 1e-6 in the blocks and after each stage, 1e-5 in the patch embeddings and the SR
branch (torch's default, as timm builds them).

Token Graying: the stem is an overlapping convolution, not a plain patch projection, so TG acts
on the stem-stride (4×4×3) patch matrix of the image, mapped back to the image
(`stem.token_gray_images`), before the model's own 7×7/4 stem; `out['patches']` is that grayed
patch matrix. `init='skipless'`: attention as the ViT's (docs/method/papers.md §3), the MLP's dense
kernels scaled uniform orthogonal with zero biases, its depthwise conv the identity (Dirac, zero
bias: the MLP starts as the plain MLP), the SR convs and the downsampling patch embeddings of
later stages scaled uniform orthogonal (flattened (k·k·C_in, C_out)); the stem keeps its default.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from skipless_jax.models import ModelDescription, roles
from skipless_jax.models import family_parts as parts
from skipless_jax.models import init as init_lib
from skipless_jax.models.attention import InitFields, MultiHeadAttention
from skipless_jax.models.blocks import SwitchFields, residual
from skipless_jax.models.common import patchify
from skipless_jax.models.stem import token_gray_images

FAMILY = "pvt_v2"
BLOCK_EPS, EMBED_EPS = 1e-6, 1e-5
# The roles of the names this module spells (models/roles.py): the stem's conv is the patch
# embedding, the downsampling and spatial-reduction convs are convolutions.
ROLES = ((r"(^|/)embedding/proj/kernel$", roles.PATCH_KERNEL), (r"(^|/)embedding/proj/bias$", roles.PATCH_BIAS),
         (r"/dwconv/kernel$", roles.DEPTHWISE_KERNEL), (r"/dwconv/bias$", roles.DEPTHWISE_BIAS),
         (r"/(proj|sr)/kernel$", roles.CONV_KERNEL), (r"/(proj|sr)/bias$", roles.CONV_BIAS),
         (r"/mlp/fc[12]/kernel$", roles.KERNEL), (r"/mlp/fc[12]/bias$", roles.BIAS))
FIELDS: dict[str, Any] = dict(
    widths=None, depths=None, num_heads=None, sr_ratios=(8, 4, 2, 1), mlp_ratios=(8, 8, 4, 4), patch_size=4,
)
_B = dict(widths=(64, 128, 320, 512), num_heads=(1, 2, 5, 8), sr_ratios=(8, 4, 2, 1), mlp_ratios=(8, 8, 4, 4))
# timm's pvt_v2_b0 … pvt_v2_b3.
VARIANTS: dict[str, dict[str, Any]] = {
    "b0": dict(_B, widths=(32, 64, 160, 256), depths=(2, 2, 2, 2)),
    "b1": dict(_B, depths=(2, 2, 2, 2)),
    "b2": dict(_B, depths=(3, 4, 6, 3)),
    "b3": dict(_B, depths=(3, 4, 18, 3)),
}


def conv_output(size: int, kernel: int, stride: int) -> int:
    """Output length of a conv with padding ⌊kernel/2⌋ on both sides."""
    return (size + 2 * (kernel // 2) - kernel) // stride + 1


class OverlapPatchEmbed(nn.Module):
    """(B, H, W, C) -> (B, H', W', d): conv (2t−1)×(2t−1) of stride t, padding t−1, then LayerNorm."""

    width: int
    stride: int
    kernel_init: Any = None
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        k = 2 * self.stride - 1
        x = nn.Conv(self.width, (k, k), strides=self.stride, padding=[(k // 2, k // 2)] * 2, dtype=self.dtype,
                    kernel_init=self.kernel_init or nn.initializers.lecun_normal(), name="proj")(x)
        return parts.layer_norm(EMBED_EPS, self.dtype, "norm")(x)


class SRAttention(InitFields):
    """(B, H·W, d) tokens of an (H, W) grid -> (B, H·W, d); keys/values from the sr-reduced grid."""

    grid: tuple[int, int]
    num_heads: int
    sr_ratio: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        b, n, d = x.shape
        kv = x
        if self.sr_ratio > 1:
            r = self.sr_ratio
            kv = nn.Conv(d, (r, r), strides=r, padding="VALID", dtype=self.dtype, name="sr",
                         kernel_init=parts.skipless_kernel_init(self.init_scheme, nn.initializers.lecun_normal()))(
                x.reshape(b, *self.grid, d))
            kv = parts.layer_norm(EMBED_EPS, self.dtype, "sr_norm")(kv.reshape(b, -1, d))
        y, _ = MultiHeadAttention(self.num_heads, dtype=self.dtype, name="attention", **self.init_fields)(x, kv=kv)
        return y


class DWMlp(nn.Module):
    """Dense(d→hidden) → depthwise 3×3 conv on the grid → GELU → Dense(hidden→d)."""

    grid: tuple[int, int]
    hidden: int
    init_scheme: str = "default"
    gelu_approximate: bool = False
    dtype: Any = jnp.float32
    init_mlp: str = "suo"  # 'default': Xavier uniform kernels under the skipless init (docs/method/authors_init.md)

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        b, n, d = x.shape
        if self.init_scheme == "skipless":
            kernel_init, bias_init = init_lib.scaled_uniform_orthogonal, nn.initializers.zeros
            if self.init_mlp == "default":
                kernel_init = nn.initializers.xavier_uniform()
            dw_init = parts.dirac_init
        else:
            kernel_init, bias_init = nn.initializers.xavier_uniform(), nn.initializers.normal(stddev=1e-6)
            dw_init = nn.initializers.lecun_normal()
        x = nn.Dense(self.hidden, kernel_init=kernel_init, bias_init=bias_init, dtype=self.dtype, name="fc1")(x)
        x = nn.Conv(self.hidden, (3, 3), padding=[(1, 1), (1, 1)], feature_group_count=self.hidden,
                    kernel_init=dw_init, dtype=self.dtype, name="dwconv")(x.reshape(b, *self.grid, self.hidden))
        x = nn.gelu(x.reshape(b, n, self.hidden), approximate=self.gelu_approximate)
        return nn.Dense(d, kernel_init=kernel_init, bias_init=bias_init, dtype=self.dtype, name="fc2")(x)


class PVTBlock(SwitchFields):
    """Pre-LN PVTv2 block; the skips are lines ② and ④."""

    grid: tuple[int, int]
    num_heads: int
    sr_ratio: int
    mlp_dim: int
    gelu_approximate: bool = False

    @nn.compact
    def __call__(self, x: jax.Array, train: bool) -> tuple[jax.Array, dict[str, Any]]:
        out: dict[str, Any] = {}
        y = SRAttention(self.grid, self.num_heads, self.sr_ratio, dtype=self.dtype, name="sra", **self.init_fields)(
            parts.layer_norm(BLOCK_EPS, self.dtype, "norm1")(x))
        x = residual(x, y, self.skip_sab, self.drop_path, train, out, "sab")  # ②
        z = DWMlp(self.grid, self.mlp_dim, self.init_scheme, self.gelu_approximate, self.dtype, self.init_mlp,
                  name="mlp")(
            parts.layer_norm(BLOCK_EPS, self.dtype, "norm2")(x))
        x = residual(x, z, self.skip_ffn, self.drop_path, train, out, "ffn")  # ④
        return x, out


class PVTv2(parts.FamilyModel):
    """PVTv2 on (B, H, W, C) images -> (logits, out); num_classes=0: pooled features."""

    widths: tuple[int, ...] = (64, 128, 320, 512)
    depths: tuple[int, ...] = (3, 4, 18, 3)
    num_heads: tuple[int, ...] = (1, 2, 5, 8)
    sr_ratios: tuple[int, ...] = (8, 4, 2, 1)
    mlp_ratios: tuple[int, ...] = (8, 8, 4, 4)
    patch_size: int = 4

    @nn.compact
    def __call__(self, images: jax.Array, train: bool = False) -> tuple[jax.Array, dict[str, Any]]:
        out: dict[str, Any] = {}
        t = self.patch_size
        images = token_gray_images(images.astype(jnp.float32), t, self.token_graying, self.tg_eps)
        out["patches"] = patchify(images, t)  # the (grayed) stem-stride patch matrix
        x = images
        rates = parts.drop_path_rates(self.drop_path, sum(self.depths))
        init = self.init_fields
        blocks, index = [], 0
        for stage, depth in enumerate(self.depths):
            if stage == 0:
                x = OverlapPatchEmbed(self.widths[0], t, dtype=self.dtype, name="embedding")(x)
            else:
                x = OverlapPatchEmbed(self.widths[stage], 2, parts.skipless_kernel_init(self.init_scheme,
                                      nn.initializers.lecun_normal()), self.dtype, name=f"stage_{stage}_downsample")(x)
            b, gh, gw, d = x.shape
            x = x.reshape(b, gh * gw, d)
            if stage == 0:
                out["embedding"] = x
            for j in range(depth):
                x, block = PVTBlock((gh, gw), self.num_heads[stage], self.sr_ratios[stage], self.mlp_ratios[stage] * d,
                                    skip_sab=self.skip_sab, skip_ffn=self.skip_ffn, drop_path=rates[index],
                                    gelu_approximate=self.gelu_approximate,
                                    dtype=self.dtype, name=f"stage_{stage}_block_{j}", **init)(x, train)
                blocks.append(block)
                index += 1
            x = parts.layer_norm(BLOCK_EPS, self.dtype, f"stage_{stage}_norm")(x)
            x = x.reshape(b, gh, gw, d)
        out["blocks"] = blocks
        x = x.reshape(x.shape[0], -1, x.shape[-1])
        out["encoded"] = x
        x = x.mean(axis=1)
        return self.classify(x, out)


def resolve(model_config: Any) -> dict[str, Any]:
    return parts.resolve_fields(model_config, FAMILY, FIELDS, VARIANTS)


def build(model_config: Any, num_classes: int, image_size: int | None = None) -> PVTv2:
    del image_size  # no position table: any size
    f = resolve(model_config)
    return PVTv2(num_classes=num_classes, widths=tuple(f["widths"]), depths=tuple(f["depths"]),
                 num_heads=tuple(f["num_heads"]), sr_ratios=tuple(f["sr_ratios"]), mlp_ratios=tuple(f["mlp_ratios"]),
                 patch_size=f["patch_size"], **parts.common_kwargs(f))


def check_config(model_config: Any, image_size: int) -> None:
    """Per-stage sizes (one entry per stage), heads, the stage grids vs the SR ratios, the common fields."""
    f = resolve(model_config)
    parts.int_tuple("depths", f["depths"])
    stages = len(f["depths"])
    for name in ("widths", "num_heads", "sr_ratios", "mlp_ratios"):
        parts.int_tuple(name, f[name], stages)
    parts.positive_int("patch_size", f["patch_size"])
    if f["patch_size"] < 2:
        raise ValueError(f"config.model.patch_size={f['patch_size']} must be >= 2 "
                         "(the stem's stride; kernel 2·stride−1)")
    parts.check_common(f)
    if image_size % f["patch_size"]:
        raise ValueError(f"config.model.patch_size={f['patch_size']} does not divide the image size {image_size}; "
                         f"allowed: divisors of {image_size} (the stem-stride patch matrix, Token Graying's input)")
    grid = conv_output(image_size, 2 * f["patch_size"] - 1, f["patch_size"])
    for stage in range(stages):
        if stage:
            grid = conv_output(grid, 3, 2)
        width, heads, sr = f["widths"][stage], f["num_heads"][stage], f["sr_ratios"][stage]
        if width % heads:
            raise ValueError(f"config.model.num_heads[{stage}]={heads} does not divide "
                             f"config.model.widths[{stage}]={width}")
        if sr > grid:
            raise ValueError(f"config.model.sr_ratios[{stage}]={sr} exceeds the {grid}×{grid} grid of stage {stage}; "
                             f"allowed: <= {grid}")


def describe(model_config: Any) -> ModelDescription:
    """No class token; the last stage's grid has stride patch · 2^(stages−1) (on images divisible
    by it); spatial-reduction keys are not on that grid (no `keys`)."""
    f = resolve(model_config)
    depths = tuple(f["depths"])
    return ModelDescription(
        family=FAMILY, patch_size=f["patch_size"], token_stride=f["patch_size"] * 2 ** (len(depths) - 1),
        width=f["widths"][-1], depth=sum(depths), prefix_tokens=0, grid_tokens=True, final_norm=True,
        normed_blocks=False, block_keys=False, num_layers=sum(depths),
        layer_id=functools.partial(parts.staged_layer_id, depths=depths, stem=("embedding",),
                                   with_first=("downsample",), with_last=("norm",)))
