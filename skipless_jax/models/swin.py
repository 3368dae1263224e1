"""Swin Transformer (Liu et al. 2021; timm's `swin_transformer.py`), docs/method/families.md §10.

    stem:    patch projection of stride p (the ViT's `PatchStem`) → LayerNorm      (B, H/p·W/p, C)
    stage s: [patch merging for s > 0: 2×2 neighbours concatenated (4C) → LayerNorm → Dense(2C), no bias]
             blocks j = 0 … depth_s − 1, pre-LN with the ViT's two residuals:
               y = W-MSA(LN1(x));  x = x + y  if skip_sab else y            # ①, ②
               z = MLP(LN2(x));    x = x + z  if skip_ffn else z            # ③, ④
    head:    LayerNorm → mean over tokens → Dense

W-MSA is attention inside non-overlapping ws×ws windows with a learned relative position bias
(a ((2ws−1)², h) table indexed by the offset between two tokens); odd blocks shift the windows
by ⌊ws/2⌋ (cyclic roll by −shift, attention masked so that tokens from different regions of the
rolled map do not attend each other (additive −100, as timm), roll back). When a stage's grid is
not larger than the window, the window is the whole grid and nothing shifts (timm's rule).
Patch merging has no residual. LayerNorm ε = 1e-5 (torch's default, as timm's Swin).

`out['blocks']` lists every block of every stage (its token matrices are (B, n_s, C_s), n_s and
C_s per stage). Token Graying acts on the stem's raw 4×4×3 patch matrix (the stem is a plain
patch projection). `init='skipless'`: each block's attention as the ViT's (docs/method/papers.md §3),
MLPs scaled uniform orthogonal, the patch-merging projections scaled uniform orthogonal; the
relative position tables keep their default init (truncated normal, σ 0.02).
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from skipless_jax.models import ModelDescription, roles
from skipless_jax.models import family_parts as parts
from skipless_jax.models.attention import InitFields, MultiHeadAttention
from skipless_jax.models.blocks import SwitchFields, residual
from skipless_jax.models.common import MlpBlock
from skipless_jax.models.stem import STEM_ROLES, PatchStem

FAMILY = "swin"
LN_EPS = 1e-5
# The roles of the names this module spells (models/roles.py).
ROLES = ((r"/relative_position_bias$", roles.RELATIVE_POSITION_TABLE), (r"(^|/)stage_\d+_merge/kernel$", roles.KERNEL),
         *STEM_ROLES)
MASK_VALUE = -100.0
FIELDS: dict[str, Any] = dict(width=None, depths=None, num_heads=None, window_size=7, patch_size=4, mlp_ratio=4)
# timm's swin_{tiny,small,base}_patch4_window7_224.
VARIANTS: dict[str, dict[str, Any]] = {
    "T": dict(width=96, depths=(2, 2, 6, 2), num_heads=(3, 6, 12, 24), window_size=7, patch_size=4),
    "S": dict(width=96, depths=(2, 2, 18, 2), num_heads=(3, 6, 12, 24), window_size=7, patch_size=4),
    "B": dict(width=128, depths=(2, 2, 18, 2), num_heads=(4, 8, 16, 32), window_size=7, patch_size=4),
}


def relative_position_index(ws: int) -> np.ndarray:
    """(ws², ws²) index into the ((2ws−1)², h) table: (Δrow + ws − 1)·(2ws − 1) + Δcol + ws − 1."""
    coords = np.stack(np.meshgrid(np.arange(ws), np.arange(ws), indexing="ij")).reshape(2, -1)
    rel = coords[:, :, None] - coords[:, None, :] + ws - 1  # (2, N, N)
    return rel[0] * (2 * ws - 1) + rel[1]


def shift_mask(h: int, w: int, ws: int, shift: int) -> np.ndarray:
    """(num_windows, 1, ws², ws²) additive mask of the shifted windows: 0 within a region, −100 across."""
    regions = np.zeros((h, w), np.int32)
    cuts = (slice(0, -ws), slice(-ws, -shift), slice(-shift, None))
    label = 0
    for rows in cuts:
        for cols in cuts:
            regions[rows, cols] = label
            label += 1
    windows = regions.reshape(h // ws, ws, w // ws, ws).transpose(0, 2, 1, 3).reshape(-1, ws * ws)
    different = windows[:, None, :] != windows[:, :, None]
    return np.where(different, MASK_VALUE, 0.0).astype(np.float32)[:, None]


def window_size_and_shift(grid: tuple[int, int], ws: int, block: int) -> tuple[int, int]:
    """timm's rule: a grid not larger than the window is one window, unshifted; odd blocks shift ⌊ws/2⌋."""
    if min(grid) <= ws:
        return min(grid), 0
    return ws, (ws // 2 if block % 2 else 0)


class WindowAttention(InitFields):
    """(B, H, W, C) -> (B, H, W, C): (shifted) window attention with relative position bias."""

    num_heads: int
    window_size: int
    shift: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        b, h, w, c = x.shape
        ws, shift = self.window_size, self.shift
        table = self.param("relative_position_bias", nn.initializers.truncated_normal(0.02),
                           ((2 * ws - 1) ** 2, self.num_heads), jnp.float32)
        bias = table[relative_position_index(ws).reshape(-1)].reshape(ws * ws, ws * ws, -1).transpose(2, 0, 1)
        if shift:
            x = jnp.roll(x, (-shift, -shift), axis=(1, 2))
            bias = bias[None] + jnp.asarray(shift_mask(h, w, ws, shift))  # (nW, h, N, N)
        windows = x.reshape(b, h // ws, ws, w // ws, ws, c).transpose(0, 1, 3, 2, 4, 5)
        windows = windows.reshape(b, (h // ws) * (w // ws), ws * ws, c)
        y, _ = MultiHeadAttention(self.num_heads, dtype=self.dtype, name="attention", **self.init_fields)(
            windows, bias=bias)
        y = y.reshape(b, h // ws, w // ws, ws, ws, c).transpose(0, 1, 3, 2, 4, 5).reshape(b, h, w, c)
        return jnp.roll(y, (shift, shift), axis=(1, 2)) if shift else y


class SwinBlock(SwitchFields):
    """Pre-LN Swin block on (B, H·W, C) tokens of an (H, W) grid; the skips are lines ② and ④."""

    grid: tuple[int, int]
    num_heads: int
    window_size: int
    shift: int
    mlp_dim: int
    gelu_approximate: bool = False

    @nn.compact
    def __call__(self, x: jax.Array, train: bool) -> tuple[jax.Array, dict[str, Any]]:
        out: dict[str, Any] = {}
        b, n, c = x.shape
        y = parts.layer_norm(LN_EPS, self.dtype, "norm1")(x).reshape(b, *self.grid, c)
        y = WindowAttention(self.num_heads, self.window_size, self.shift, dtype=self.dtype, name="window_attention",
                            **self.init_fields)(y)
        x = residual(x, y.reshape(b, n, c), self.skip_sab, self.drop_path, train, out, "sab")  # ②
        z = parts.layer_norm(LN_EPS, self.dtype, "norm2")(x)
        z = MlpBlock(self.mlp_dim, self.init_scheme, 0.0, self.gelu_approximate, self.dtype, self.init_mlp,
                     name="mlp")(z, train)
        x = residual(x, z, self.skip_ffn, self.drop_path, train, out, "ffn")  # ④
        return x, out


def patch_merge_inputs(x: jax.Array, grid: tuple[int, int]) -> jax.Array:
    """(B, H·W, C) -> (B, H/2·W/2, 4C): [x(2i, 2j), x(2i+1, 2j), x(2i, 2j+1), x(2i+1, 2j+1)] (timm's order)."""
    b, _, c = x.shape
    h, w = grid
    g = x.reshape(b, h // 2, 2, w // 2, 2, c)  # (b, i, row offset, j, col offset, c)
    g = g.transpose(0, 1, 3, 4, 2, 5)  # (b, i, j, col offset, row offset, c)
    return g.reshape(b, (h // 2) * (w // 2), 4 * c)


class Swin(parts.FamilyModel):
    """Swin on (B, H, W, C) images -> (logits, out); num_classes=0: pooled features."""

    width: int = 96
    depths: tuple[int, ...] = (2, 2, 6, 2)
    num_heads: tuple[int, ...] = (3, 6, 12, 24)
    window_size: int = 7
    patch_size: int = 4
    mlp_ratio: int = 4

    @nn.compact
    def __call__(self, images: jax.Array, train: bool = False) -> tuple[jax.Array, dict[str, Any]]:
        out: dict[str, Any] = {}
        p = self.patch_size
        grid = (images.shape[1] // p, images.shape[2] // p)
        patch_stem = PatchStem(self.width, p, self.token_graying, self.tg_eps, self.dtype, name="embedding")
        x, out["patches"] = patch_stem(images)
        x = parts.layer_norm(LN_EPS, self.dtype, "embedding_norm")(x)
        out["embedding"] = x
        rates = parts.drop_path_rates(self.drop_path, sum(self.depths))
        blocks, index = [], 0
        init = self.init_fields
        for stage, (depth, heads) in enumerate(zip(self.depths, self.num_heads)):
            if stage:
                x = patch_merge_inputs(x, grid)
                grid = (grid[0] // 2, grid[1] // 2)
                x = parts.layer_norm(LN_EPS, self.dtype, f"stage_{stage}_merge_norm")(x)
                x = nn.Dense(2 * x.shape[-1] // 4, use_bias=False, dtype=self.dtype, name=f"stage_{stage}_merge",
                             kernel_init=parts.skipless_kernel_init(self.init_scheme))(x)
            for j in range(depth):
                ws, shift = window_size_and_shift(grid, self.window_size, j)
                x, block = SwinBlock(
                    grid, heads, ws, shift, self.mlp_ratio * x.shape[-1], skip_sab=self.skip_sab,
                    skip_ffn=self.skip_ffn, drop_path=rates[index], gelu_approximate=self.gelu_approximate,
                    dtype=self.dtype,
                    name=f"stage_{stage}_block_{j}", **init,
                )(x, train)
                blocks.append(block)
                index += 1
        out["blocks"] = blocks
        x = parts.layer_norm(LN_EPS, self.dtype, "encoder_norm")(x)
        out["encoded"] = x
        x = x.mean(axis=1)
        return self.classify(x, out)


def resolve(model_config: Any) -> dict[str, Any]:
    return parts.resolve_fields(model_config, FAMILY, FIELDS, VARIANTS)


def build(model_config: Any, num_classes: int, image_size: int | None = None) -> Swin:
    del image_size  # relative position bias: nothing depends on the image size
    f = resolve(model_config)
    return Swin(num_classes=num_classes, width=f["width"], depths=tuple(f["depths"]), num_heads=tuple(f["num_heads"]),
                window_size=f["window_size"], patch_size=f["patch_size"], mlp_ratio=f["mlp_ratio"],
                **parts.common_kwargs(f))


def check_config(model_config: Any, image_size: int) -> None:
    """Sizes, heads per stage, the stage grids vs patch and window, and the common fields."""
    f = resolve(model_config)
    for name in ("width", "window_size", "patch_size", "mlp_ratio"):
        parts.positive_int(name, f[name])
    parts.int_tuple("depths", f["depths"])
    stages = len(f["depths"])
    parts.int_tuple("num_heads", f["num_heads"], stages)
    parts.check_common(f)
    p = f["patch_size"]
    if image_size % (p * 2 ** (stages - 1)):
        raise ValueError(f"config.model.patch_size={p} with {stages} stages needs the image size {image_size} "
                         f"divisible by {p * 2 ** (stages - 1)} (patch × 2^(stages−1))")
    for stage, heads in enumerate(f["num_heads"]):
        width = f["width"] * 2**stage
        if width % heads:
            raise ValueError(f"config.model.num_heads[{stage}]={heads} does not divide the stage width {width}")
        grid = image_size // p // 2**stage
        ws, _ = window_size_and_shift((grid, grid), f["window_size"], 0)
        if grid % ws:
            raise ValueError(f"config.model.window_size={f['window_size']} does not divide the {grid}×{grid} grid "
                             f"of stage {stage}; allowed: a divisor of every stage grid")


def describe(model_config: Any) -> ModelDescription:
    """No class token; the last stage's grid has stride patch · 2^(stages−1); windowed attention
    keys are not on that grid (no `keys`)."""
    f = resolve(model_config)
    depths, scale = tuple(f["depths"]), 2 ** (len(f["depths"]) - 1)
    return ModelDescription(
        family=FAMILY, patch_size=f["patch_size"], token_stride=f["patch_size"] * scale, width=f["width"] * scale,
        depth=sum(depths), prefix_tokens=0, grid_tokens=True, final_norm=True, normed_blocks=False, block_keys=False,
        num_layers=sum(depths),
        layer_id=functools.partial(parts.staged_layer_id, depths=depths, stem=("embedding", "embedding_norm"),
                                   with_first=("merge", "merge_norm")))
