"""ConvMixer (Trockman & Kolter, "Patches Are All You Need?"; timm's `convmixer.py`), docs/method/families.md §10.

    stem:   x = BN(act(patch projection of stride p))                       (B, H/p, W/p, d)
    block:  y = BN(act(depthwise k×k conv(x)));  x = x + y  if skip_sab else y    # ①, ②
            z = BN(act(pointwise 1×1 conv(x)));  x = z                           # ③ (no residual)
    head:   global average pool → Dense

The one residual is around the depthwise (spatial, token-mixing) part, switched by
`model.skip_sab`; the pointwise (channel-mixing) part has none, so `skip_ffn` must be False.
`out['blocks'][l]` holds ① `sab`, ①+② `sab_skip`, ③ `ffn` and `ffn_skip` = ③ + its input (the
sum a skip there would form; never formed, like a switched-off skip of the ViT), all as
(B, tokens, d) matrices, so the κ analysis reads it as it reads the ViT.

The stem is the ViT's `PatchStem` (patchify → Token Graying → (p²C, d) matrix = the stride-p
convolution), so Token Graying acts on the raw patch matrix as in the ViT. BatchNorm: see
`family_parts.BatchNorm` (running statistics only where the `batch_stats` collection exists).
`init='skipless'`: the pointwise kernels scaled uniform orthogonal with zero biases; the
depthwise convolution (the token mixer, no attention to re-initialize) and the stem keep their
default init.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax

from skipless_jax.models import ModelDescription, roles
from skipless_jax.models import family_parts as parts
from skipless_jax.models import init as init_lib
from skipless_jax.models.blocks import residual
from skipless_jax.models.common import top_name
from skipless_jax.models.stem import STEM_ROLES, PatchStem

FAMILY = "convmixer"
RUNNING_STATS = True  # BatchNorm: `batch_stats` kept and updated by the supervised trainer
ACTIVATIONS = ("gelu", "relu")
# The roles of the names this module spells (models/roles.py).
ROLES = ((r"(^|/)block_\d+_depthwise/kernel$", roles.DEPTHWISE_KERNEL),
         (r"(^|/)block_\d+_depthwise/bias$", roles.DEPTHWISE_BIAS),
         (r"(^|/)block_\d+_pointwise/kernel$", roles.KERNEL), (r"(^|/)block_\d+_pointwise/bias$", roles.BIAS),
         *STEM_ROLES)
FIELDS: dict[str, Any] = dict(width=None, depth=None, kernel_size=9, patch_size=7, activation="gelu")
# timm's convmixer_768_32 / convmixer_1536_20 and the CIFAR-10 reference ConvMixer-256/8.
VARIANTS: dict[str, dict[str, Any]] = {
    "256/8": dict(width=256, depth=8, kernel_size=5, patch_size=2, activation="gelu"),
    "768/32": dict(width=768, depth=32, kernel_size=7, patch_size=7, activation="relu"),
    "1536/20": dict(width=1536, depth=20, kernel_size=9, patch_size=7, activation="gelu"),
}


class ConvMixer(parts.FamilyModel, kw_only=True):
    """ConvMixer on (B, H, W, C) images -> (logits (B, num_classes), out); num_classes=0: pooled features."""

    width: int = 256
    depth: int = 8
    kernel_size: int = 5
    patch_size: int = 2
    activation: str = "gelu"
    skip_ffn: bool = False  # its pointwise conv has no residual

    def _act(self, x: jax.Array) -> jax.Array:
        return nn.relu(x) if self.activation == "relu" else nn.gelu(x, approximate=self.gelu_approximate)

    @nn.compact
    def __call__(self, images: jax.Array, train: bool = False) -> tuple[jax.Array, dict[str, Any]]:
        out: dict[str, Any] = {}
        b, p, d = images.shape[0], self.patch_size, self.width
        gh, gw = images.shape[1] // p, images.shape[2] // p
        tokens, out["patches"] = PatchStem(d, p, self.token_graying, self.tg_eps, self.dtype, name="embedding")(images)
        x = parts.BatchNorm(dtype=self.dtype, name="embedding_norm")(self._act(tokens), train)
        out["embedding"] = x
        x = x.reshape(b, gh, gw, d)
        suo = self.init_scheme == "skipless" and self.init_mlp == "suo"  # docs/method/authors_init.md §2
        pointwise_init = init_lib.scaled_uniform_orthogonal if suo else nn.initializers.lecun_normal()
        blocks = []
        rates = parts.drop_path_rates(self.drop_path, self.depth)
        for layer in range(self.depth):
            block: dict[str, Any] = {}
            k = self.kernel_size
            y = nn.Conv(d, (k, k), padding="SAME", feature_group_count=d, dtype=self.dtype,
                        name=f"block_{layer}_depthwise")(x)
            y = parts.BatchNorm(dtype=self.dtype, name=f"block_{layer}_depthwise_norm")(self._act(y), train)
            flat = x.reshape(b, gh * gw, d)
            x = residual(flat, y.reshape(b, gh * gw, d), self.skip_sab, rates[layer], train, block, "sab")  # ②
            z = nn.Dense(d, kernel_init=pointwise_init, bias_init=nn.initializers.zeros, dtype=self.dtype,
                         name=f"block_{layer}_pointwise")(x)
            z = parts.BatchNorm(dtype=self.dtype, name=f"block_{layer}_pointwise_norm")(self._act(z), train)
            block["ffn"], block["ffn_skip"] = z, x + z  # no residual: ffn_skip is never formed
            block["pre_logits"] = z.mean(axis=1)  # the model cut here (docs/method/per_layer_eval.md §1)
            x = z.reshape(b, gh, gw, d)
            blocks.append(block)
        out["blocks"] = blocks
        x = x.reshape(b, gh * gw, d)
        out["encoded"] = x
        x = x.mean(axis=1)
        return self.classify(x, out)


def resolve(model_config: Any) -> dict[str, Any]:
    """`config.model` → this family's fields (variant sizes filled in)."""
    fields = parts.resolve_fields(model_config, FAMILY, FIELDS, VARIANTS)
    if model_config.get("skip_ffn") is None:
        fields["skip_ffn"] = False
    return fields


def build(model_config: Any, num_classes: int, image_size: int | None = None) -> ConvMixer:
    del image_size  # fully convolutional: any size divisible by the patch
    f = resolve(model_config)
    kwargs = parts.common_kwargs(f)
    return ConvMixer(num_classes=num_classes, width=f["width"], depth=f["depth"], kernel_size=f["kernel_size"],
                     patch_size=f["patch_size"], activation=f["activation"], **kwargs)


def check_config(model_config: Any, image_size: int) -> None:
    """Sizes, activation, the (single) switch, patch vs image size, and the common fields."""
    f = resolve(model_config)
    for name in ("width", "depth", "kernel_size", "patch_size"):
        parts.positive_int(name, f[name])
    parts.check_common(f)
    if f["skip_ffn"]:
        raise ValueError("config.model.skip_ffn=True: ConvMixer has no residual around its pointwise conv; "
                         "allowed: False (its one switch is skip_sab)")
    if f["activation"] not in ACTIVATIONS:
        raise ValueError(f"config.model.activation={f['activation']!r} is unknown; allowed: {list(ACTIVATIONS)}")
    parts.check_patch_divides(f["patch_size"], image_size)


def layer_id(path: str, depth: int) -> int:
    """Layer-decay id (docs/method/ssl.md §9): 0 the stem and its norm, l + 1 for `block_{l}_*`, depth + 1 the head."""
    name = top_name(path)
    if name in ("embedding", "embedding_norm"):
        return 0
    index = name.split("_")[1] if name.startswith("block_") else ""
    return int(index) + 1 if index.isdigit() else depth + 1


def describe(model_config: Any) -> ModelDescription:
    """No class token, no attention (no `keys`), no final norm: `encoded` is the last block's output."""
    f = resolve(model_config)
    return ModelDescription(
        family=FAMILY, patch_size=f["patch_size"], token_stride=f["patch_size"], width=f["width"], depth=f["depth"],
        prefix_tokens=0, grid_tokens=True, final_norm=False, normed_blocks=False, block_keys=False,
        block_pre_logits=True, num_layers=f["depth"], layer_id=functools.partial(layer_id, depth=f["depth"]))
