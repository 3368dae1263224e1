"""CaiT (Touvron et al., "Going deeper with Image Transformers"; timm's `cait.py`), docs/method/families.md §10.

    stem:  patch projection (the ViT's `PatchStem`) + learned position table (no class token yet)
    self-attention blocks ℓ = 0 … depth − 1 (talking-heads attention, LayerScale γ):
        y = γ₁ ⊙ TH-SA(LN1(x));  x = x + y  if skip_sab else y             # ①, ②
        z = γ₂ ⊙ MLP(LN2(x));    x = x + z  if skip_ffn else z             # ③, ④
    class-attention blocks k = 0 … depth_token_only − 1 (update only the class token c):
        y = γ₁ ⊙ CA(LN1([c; x]));  c = c + y  if skip_class_sab else y    # queries from c only
        z = γ₂ ⊙ MLP(LN2(c));      c = c + z  if skip_class_ffn else z
    head:  LayerNorm([c; x]) → c → Dense

LayerScale: γ is a learned per-channel vector initialized at `layerscale_init` (1e-5 for the
XXS/S-24 models) on a branch beside its skip, and at 1 on a branch whose skip is off
(docs/method/families.md §10: without the identity beside it, γ = 1e-5 would scale the block's whole
output, and every gradient into the layers below it, by 1e-5 per block). Talking heads: (h, h)
mixings of the attention logits before the softmax (`proj_l`) and of the probabilities after it
(`proj_w`), each with a bias; under `init='skipless'` (and 'mimetic') both start as the identity
with zero bias, so the layer starts as plain attention with the ViT's skipless init.

`out['blocks']` holds the self-attention blocks ((B, n, d) token matrices, the κ analysis),
`out['class_blocks']` the class-attention blocks ((B, 1, d): the class token only). LayerNorm
ε = 1e-6 (timm's CaiT). Token Graying acts on the stem's raw patch matrix.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from skipless_jax.models import ModelDescription, roles
from skipless_jax.models import family_parts as parts
from skipless_jax.models.attention import MultiHeadAttention
from skipless_jax.models.blocks import SwitchFields, residual
from skipless_jax.models.common import MlpBlock, resize_posemb, top_name
from skipless_jax.models.stem import STEM_ROLES, PatchStem

FAMILY = "cait"
LN_EPS = 1e-6
FIELDS: dict[str, Any] = dict(
    width=None, depth=None, num_heads=None, mlp_dim=None, patch_size=16, depth_token_only=2,
    layerscale_init=1e-5, skip_class_sab=True, skip_class_ffn=True,
)
# The roles of the names this module spells (models/roles.py).
ROLES = ((r"(^|/)cls$", roles.CLASS_TOKEN), (r"(^|/)pos_embedding$", roles.POSITION_TABLE),
         (r"/gamma_[12]$", roles.LAYER_SCALE), *STEM_ROLES)
# timm's cait_xxs24_224 and cait_s24_224.
VARIANTS: dict[str, dict[str, Any]] = {
    "XXS24": dict(width=192, depth=24, num_heads=4, mlp_dim=768, patch_size=16),
    "S24": dict(width=384, depth=24, num_heads=8, mlp_dim=1536, patch_size=16),
}


def layerscale_value(skip: bool, init_value: float) -> float:
    """γ's initial value: `init_value` beside a skip, 1 on a branch without its skip."""
    return init_value if skip else 1.0


class LayerScaleBlock(SwitchFields):
    """A CaiT block. `class_attention`: queries from the class token only (inputs (c, x))."""

    num_heads: int
    mlp_dim: int
    class_attention: bool = False
    layerscale_init: float = 1e-5
    gelu_approximate: bool = False

    @nn.compact
    def __call__(self, x: jax.Array, tokens: jax.Array | None, train: bool) -> tuple[jax.Array, dict[str, Any]]:
        out: dict[str, Any] = {}
        d = x.shape[-1]
        attention = MultiHeadAttention(self.num_heads, talking_heads=not self.class_attention, dtype=self.dtype,
                                       name="attention", **self.init_fields)
        gamma_1 = self.param("gamma_1", nn.initializers.constant(layerscale_value(self.skip_sab, self.layerscale_init)),
                             (d,), jnp.float32)
        gamma_2 = self.param("gamma_2", nn.initializers.constant(layerscale_value(self.skip_ffn, self.layerscale_init)),
                             (d,), jnp.float32)
        if self.class_attention:
            u = parts.layer_norm(LN_EPS, self.dtype, "norm1")(jnp.concatenate([x, tokens], axis=1))
            y, _ = attention(u[:, :1], kv=u)
        else:
            y, details = attention(parts.layer_norm(LN_EPS, self.dtype, "norm1")(x))
            out["keys"] = details["keys"]
        x = residual(x, gamma_1.astype(self.dtype) * y, self.skip_sab, self.drop_path, train, out, "sab")  # ②
        z = MlpBlock(self.mlp_dim, self.init_scheme, 0.0, self.gelu_approximate, self.dtype, self.init_mlp, name="mlp")(
            parts.layer_norm(LN_EPS, self.dtype, "norm2")(x), train)
        x = residual(x, gamma_2.astype(self.dtype) * z, self.skip_ffn, self.drop_path, train, out, "ffn")  # ④
        return x, out


class CaiT(parts.FamilyModel):
    """CaiT on (B, H, W, C) images -> (logits, out); num_classes=0: pooled (class token) features."""

    width: int = 384
    depth: int = 24
    num_heads: int = 8
    mlp_dim: int = 1536
    patch_size: int = 16
    depth_token_only: int = 2
    layerscale_init: float = 1e-5
    skip_class_sab: bool = True
    skip_class_ffn: bool = True
    image_size: int | None = None

    @nn.compact
    def __call__(self, images: jax.Array, train: bool = False) -> tuple[jax.Array, dict[str, Any]]:
        out: dict[str, Any] = {}
        p, d = self.patch_size, self.width
        grid = (images.shape[1] // p, images.shape[2] // p)
        x, out["patches"] = PatchStem(d, p, self.token_graying, self.tg_eps, self.dtype, name="embedding")(images)
        out["embedding"] = x
        native = (self.image_size // p,) * 2 if self.image_size else grid
        pe = self.param("pos_embedding", nn.initializers.truncated_normal(0.02), (1, native[0] * native[1], d),
                        jnp.float32)
        if native != grid:
            pe = resize_posemb(pe, *grid)
        x = x + pe.astype(x.dtype)
        init = dict(self.init_fields, gelu_approximate=self.gelu_approximate, dtype=self.dtype)
        rates = [self.drop_path] * self.depth  # timm's CaiT: the same rate in every block
        blocks = []
        for layer in range(self.depth):
            x, block = LayerScaleBlock(self.num_heads, self.mlp_dim, False, self.layerscale_init,
                                       skip_sab=self.skip_sab, skip_ffn=self.skip_ffn, drop_path=rates[layer],
                                       name=f"block_{layer}", **init)(
                x, None, train)
            blocks.append(block)
        out["blocks"] = blocks
        cls = self.param("cls", nn.initializers.truncated_normal(0.02), (1, 1, d), jnp.float32)
        c = jnp.broadcast_to(cls.astype(x.dtype), (x.shape[0], 1, d))
        class_blocks = []
        for k in range(self.depth_token_only):
            c, block = LayerScaleBlock(self.num_heads, self.mlp_dim, True, self.layerscale_init,
                                       skip_sab=self.skip_class_sab, skip_ffn=self.skip_class_ffn,
                                       name=f"class_block_{k}", **init)(c, x, train)
            class_blocks.append(block)
        out["class_blocks"] = class_blocks
        x = parts.layer_norm(LN_EPS, self.dtype, "encoder_norm")(jnp.concatenate([c, x], axis=1))
        out["encoded"] = x
        x = x[:, 0]
        return self.classify(x, out)


def resolve(model_config: Any) -> dict[str, Any]:
    return parts.resolve_fields(model_config, FAMILY, FIELDS, VARIANTS)


def build(model_config: Any, num_classes: int, image_size: int | None = None) -> CaiT:
    f = resolve(model_config)
    return CaiT(num_classes=num_classes, width=f["width"], depth=f["depth"], num_heads=f["num_heads"],
                mlp_dim=f["mlp_dim"], patch_size=f["patch_size"], depth_token_only=f["depth_token_only"],
                layerscale_init=float(f["layerscale_init"]), skip_class_sab=f["skip_class_sab"],
                skip_class_ffn=f["skip_class_ffn"], image_size=image_size, **parts.common_kwargs(f))


def check_config(model_config: Any, image_size: int) -> None:
    """Sizes, heads, patch vs image size, LayerScale, the four switches and the common fields."""
    f = resolve(model_config)
    for name in ("width", "depth", "num_heads", "mlp_dim", "patch_size", "depth_token_only"):
        parts.positive_int(name, f[name])
    parts.check_common(f)
    for name in ("skip_class_sab", "skip_class_ffn"):
        if not isinstance(f[name], bool):
            raise ValueError(f"config.model.{name}={f[name]!r} must be True or False")
    value = f["layerscale_init"]
    if not (isinstance(value, (int, float)) and 0 < value <= 1):
        raise ValueError(f"config.model.layerscale_init={value!r} must be in (0, 1]")
    if f["width"] % f["num_heads"]:
        raise ValueError(f"config.model.num_heads={f['num_heads']} does not divide config.model.width={f['width']}")
    parts.check_patch_divides(f["patch_size"], image_size)


def layer_id(path: str, depth: int, depth_token_only: int) -> int:
    """Layer-decay id (docs/method/ssl.md §9): i + 1 for `block_i`; depth + k + 1 for `class_block_k`;
    0 the embedding (`roles.EMBEDDING_ROLES`: the stem, position table and class token);
    depth + depth_token_only + 1 the rest."""
    name = top_name(path)
    for prefix, offset in (("block_", 0), ("class_block_", depth)):
        if name.startswith(prefix) and name[len(prefix):].isdigit():
            return offset + int(name[len(prefix):]) + 1
    return 0 if roles.role_of(path, ROLES) in roles.EMBEDDING_ROLES else depth + depth_token_only + 1


def describe(model_config: Any) -> ModelDescription:
    """Patch grid with the class token first in `encoded`; the self-attention blocks record keys."""
    f = resolve(model_config)
    layers = f["depth"] + f["depth_token_only"]
    return ModelDescription(
        family=FAMILY, patch_size=f["patch_size"], token_stride=f["patch_size"], width=f["width"], depth=f["depth"],
        prefix_tokens=1, grid_tokens=True, final_norm=True, normed_blocks=False, block_keys=True, num_layers=layers,
        layer_id=functools.partial(layer_id, depth=f["depth"], depth_token_only=f["depth_token_only"]))
