"""Parts the ConvMixer, Swin, CaiT and PVTv2 families share (docs/method/families.md §10).

- `resolve_fields`: `config.model` → the family's fields, a named variant filling its sizes
  (an explicit size that contradicts the variant, or a field the family does not have, is a
  one-line ValueError).
- `check_common`: the checks of the fields every family has (switches, rates, init, TG, dtype);
  `check_patch_divides`.
- `FamilyModel`: the module fields every family has (its models subclass it and add their
  sizes), `init_fields` for the blocks, and `classify`, the pooled features → head tail.
- `BatchNorm`: ConvMixer's BatchNorm; it uses running statistics when the `batch_stats`
  collection is present, else the batch's own statistics (a trainer that carries only
  `params` trains and evaluates it with batch statistics).
- `dirac_init`, `skipless_kernel_init`: the initializers of parts the paper has no counterpart for.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from skipless_jax import token_graying
from skipless_jax.checks import DTYPES, GELUS, require
from skipless_jax.models import init as init_lib
from skipless_jax.models.blocks import ModelFields
from skipless_jax.models.common import top_name

# Fields every family has, with their defaults (the switches, the init of docs/method/papers.md §3,
# Token Graying of §4). GELU defaults to the exact form, as timm's models use it.
COMMON_FIELDS: dict[str, Any] = dict(
    name=None,
    variant=None,
    skip_sab=True,
    skip_ffn=True,
    drop_path=0.0,
    init="default",
    init_alpha=1.0,
    init_beta=1.0,
    init_c=1.0,
    init_qk_dist="normal",
    init_vo="polar",
    init_mlp="suo",
    token_graying=None,
    tg_eps=0.95,
    dtype="float32",
    gelu="exact",
    head_zero_init=True,
)


def resolve_fields(
    model_config: Any, family: str, fields: dict[str, Any], variants: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    """The family's fields from `config.model`: defaults < variant < explicit (non-None) values.

    `fields` are the family's own fields with their defaults (COMMON_FIELDS are added). An
    explicit value that differs from the variant's, or a field the family does not have, is a
    one-line ValueError.
    """
    given = dict(model_config)
    allowed = {**COMMON_FIELDS, **fields}
    unknown = sorted(k for k, v in given.items() if k not in allowed and v is not None)
    if unknown:
        raise ValueError(
            f"config.model.{unknown[0]} is not a field of the {family} family; "
            f"allowed: {', '.join(sorted(allowed))}"
        )
    out = dict(allowed)
    variant = given.get("variant")
    if variant:
        if variant not in variants:
            raise ValueError(
                f"config.model.variant={variant!r} is not a {family} variant; allowed: {sorted(variants)}"
            )
        sizes = variants[variant]
        conflicts = [
            f"{k}={given[k]!r} (the variant's: {v!r})"
            for k, v in sizes.items()
            if given.get(k) is not None and _norm(given[k]) != _norm(v)
        ]
        if conflicts:
            raise ValueError(
                f"config.model.variant={variant!r} conflicts with config.model.{', '.join(conflicts)}; "
                "set either the variant or explicit sizes"
            )
        out.update(sizes)
    out.update({k: v for k, v in given.items() if v is not None})
    return out


def _norm(value: Any) -> Any:
    return tuple(value) if isinstance(value, (list, tuple)) else value


def positive_int(name: str, value: Any) -> None:
    require(isinstance(value, int) and not isinstance(value, bool) and value > 0,
             f"config.model.{name}={value!r} must be a positive integer")


def int_tuple(name: str, value: Any, length: int | None = None) -> None:
    """A non-empty tuple of positive integers (of `length` entries when given)."""
    ok = isinstance(value, (tuple, list)) and len(value) > 0 and all(
        isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)
    require(ok, f"config.model.{name}={value!r} must be a tuple of positive integers")
    if length is not None:
        require(len(value) == length,
                 f"config.model.{name}={tuple(value)!r} has {len(value)} entries; allowed: one per stage ({length})")


def check_common(f: dict[str, Any]) -> None:
    """Switches, drop-path, dtype, GELU, init constants and Token Graying of resolved fields `f`."""
    for name in ("skip_sab", "skip_ffn", "head_zero_init"):
        require(isinstance(f[name], bool), f"config.model.{name}={f[name]!r} must be True or False")
    rate = f["drop_path"]
    require(isinstance(rate, (int, float)) and math.isfinite(rate) and 0.0 <= rate < 1.0,
             f"config.model.drop_path={rate!r} must be in [0, 1)")
    require(str(f["dtype"]) in DTYPES, f"config.model.dtype={f['dtype']!r} is unknown; allowed: {list(DTYPES)}")
    require(f["gelu"] in GELUS, f"config.model.gelu={f['gelu']!r} is unknown; allowed: {list(GELUS)}")
    init_lib.validate_init_config({k: f[k] for k in ("init", "init_alpha", "init_beta", "init_c", "init_qk_dist",
                                                     "init_vo", "init_mlp")})
    if f["token_graying"] is not None:
        token_graying.validate_token_graying(f["token_graying"], f["tg_eps"])


def common_kwargs(f: dict[str, Any]) -> dict[str, Any]:
    """Module arguments of the common fields (names as the modules spell them)."""
    return dict(
        skip_sab=f["skip_sab"], skip_ffn=f["skip_ffn"], drop_path=float(f["drop_path"]),
        init_scheme=f["init"], init_alpha=float(f["init_alpha"]), init_beta=float(f["init_beta"]),
        init_c=float(f["init_c"]), init_qk_dist=f["init_qk_dist"], init_vo=f["init_vo"], init_mlp=f["init_mlp"],
        token_graying=f["token_graying"], tg_eps=float(f["tg_eps"]),
        dtype=jnp.dtype(f["dtype"]), gelu_approximate=f["gelu"] == "tanh", head_zero_init=f["head_zero_init"],
    )


def check_patch_divides(patch_size: int, image_size: int) -> None:
    require(image_size % patch_size == 0, f"config.model.patch_size={patch_size} does not divide the image size "
             f"{image_size}; allowed: divisors of {image_size}")


class FamilyModel(ModelFields):
    """The fields every family's model has (`common_kwargs` fills them; the switches, init, Token
    Graying and dtype are `blocks.ModelFields`), on (B, H, W, C) images -> (logits, out);
    num_classes=0: pooled features. Subclasses add their sizes."""

    num_classes: int
    gelu_approximate: bool = False
    head_zero_init: bool = True

    def classify(self, pooled: jax.Array, out: dict[str, Any]) -> tuple[jax.Array, dict[str, Any]]:
        """out['pre_logits'] = pooled; with classes, the zero-initialized `head` → out['logits']."""
        out["pre_logits"] = pooled
        if not self.num_classes:
            return pooled, out
        out["logits"] = head(self, pooled, self.num_classes, self.head_zero_init, self.dtype)
        return out["logits"], out


def drop_path_rates(rate: float, depth: int) -> list[float]:
    """Block ℓ of `depth` gets rate·ℓ/(depth−1) (docs/method/papers.md §1; timm's linspace)."""
    return [rate * i / max(depth - 1, 1) for i in range(depth)]


_STAGED = re.compile(r"stage_(\d+)_(.+)")
_BLOCK = re.compile(r"block_(\d+)")


def staged_layer_id(path: str, depths: Sequence[int], stem: Sequence[str], with_first: Sequence[str] = (),
                    with_last: Sequence[str] = ()) -> int:
    """Layer-decay id of a parameter of a staged model (docs/method/ssl.md §9): 0 for the `stem` names,
    offset_s + j + 1 for `stage_{s}_block_{j}` (offset_s: the blocks of the stages before s), the
    id of stage s's first block for `stage_{s}_<with_first>` (its downsampling), of its last block
    for `stage_{s}_<with_last>` (its norm), sum(depths) + 1 for the rest (final norm, head)."""
    name = top_name(path)
    if name in stem:
        return 0
    match = _STAGED.fullmatch(name)
    if match:
        stage, rest = int(match.group(1)), match.group(2)
        offset = sum(depths[:stage])
        block = _BLOCK.fullmatch(rest)
        if block:
            return offset + int(block.group(1)) + 1
        if rest in with_first:
            return offset + 1
        if rest in with_last:
            return offset + depths[stage]
    return sum(depths) + 1


# ------------------------------------------------------------------ initializers


def dirac_init(key: jax.Array, shape: Sequence[int], dtype: Any = jnp.float32) -> jax.Array:
    """Identity kernel of a depthwise convolution (kh, kw, 1, C): 1 at the centre tap."""
    del key
    kh, kw = shape[0], shape[1]
    return jnp.zeros(shape, dtype).at[kh // 2, kw // 2].set(1.0)


def skipless_kernel_init(scheme: str, default: Any = None) -> Any:
    """Projection kernels that change width or mix channels (patch merging, strided convs):
    scaled uniform orthogonal under `init='skipless'` (docs/method/families.md §10), else `default`
    (Xavier uniform)."""
    if scheme == "skipless":
        return init_lib.scaled_uniform_orthogonal
    return default or nn.initializers.xavier_uniform()


# ------------------------------------------------------------------ normalization


class BatchNorm(nn.Module):
    """BatchNorm over all axes but the last (torch's BatchNorm2d: ε 1e-5, momentum 0.1).

    Parameters `scale`, `bias`; running statistics `mean`, `var` in the `batch_stats` collection.
    With `train` or without running statistics (a model applied with `params` only) it
    normalizes with the batch's statistics; running statistics update when `batch_stats` is
    mutable during training.
    """

    epsilon: float = 1e-5
    momentum: float = 0.9
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, train: bool) -> jax.Array:
        c = x.shape[-1]
        scale = self.param("scale", nn.initializers.ones, (c,), jnp.float32)
        bias = self.param("bias", nn.initializers.zeros, (c,), jnp.float32)
        has_stats = self.is_initializing() or self.has_variable("batch_stats", "mean")
        stats = None
        if has_stats:
            stats = (self.variable("batch_stats", "mean", lambda: jnp.zeros((c,), jnp.float32)),
                     self.variable("batch_stats", "var", lambda: jnp.ones((c,), jnp.float32)))
        xf = x.astype(jnp.float32)
        if stats is not None and not train and not self.is_initializing():
            mean, var = stats[0].value, stats[1].value
        else:
            axes = tuple(range(x.ndim - 1))
            mean = xf.mean(axes)
            var = jnp.square(xf - mean).mean(axes)
            if stats is not None and train and self.is_mutable_collection("batch_stats") and not self.is_initializing():
                n = math.prod(x.shape[:-1])
                stats[0].value = self.momentum * stats[0].value + (1 - self.momentum) * mean
                stats[1].value = self.momentum * stats[1].value + (1 - self.momentum) * var * n / max(n - 1, 1)
        y = (xf - mean) * jax.lax.rsqrt(var + self.epsilon) * scale + bias
        return y.astype(self.dtype)


def layer_norm(eps: float, dtype: Any, name: str | None = None) -> nn.LayerNorm:
    return nn.LayerNorm(epsilon=eps, dtype=dtype, name=name)


def head(module: nn.Module, x: jax.Array, num_classes: int, zero_init: bool, dtype: Any) -> jax.Array:
    """The classifier `head` (zero-initialized by default, as the ViT's), float32 logits."""
    init = nn.initializers.zeros if zero_init else nn.initializers.lecun_normal()
    return nn.Dense(num_classes, kernel_init=init, dtype=dtype, name="head")(x).astype(jnp.float32)
