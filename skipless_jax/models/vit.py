"""Vision Transformer whose attention and MLP residuals are switches (docs/method/papers.md §1).

Built from the shared parts: the stem (`stem.PatchStem`: patchify → Token Graying → patch
projection), the residual block (`blocks.EncoderBlock`, the skips are its lines ② and ④) and
the position-embedding utilities (`common`). `ViT(...)(images, train=...)` returns
`(logits, out)`; `out` holds every intermediate the analysis code needs (the patch matrix, the
embedding, ①, ①+②, ③, ③+④ and the keys of every block), so there is no second model to keep
in sync.

The family's registry entry (models/__init__.py) is this module's `build` and `check_config`.
"""

from __future__ import annotations

import functools
import math
import re
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from skipless_jax import sharding, token_graying
from skipless_jax.checks import DTYPES, GELUS, require
from skipless_jax.models import ModelDescription, roles
from skipless_jax.models import init as init_lib
from skipless_jax.models.attention import ATTENTION_KERNELS, MultiHeadAttention  # noqa: F401 (re-exported)
from skipless_jax.models.blocks import EncoderBlock, ModelFields
from skipless_jax.models.common import (  # noqa: F401
    SCANNED_BLOCKS,
    DropPath,
    MlpBlock,
    patchify,
    posemb_sincos_2d,
    resize_posemb,
    top_name,
)
from skipless_jax.models.stem import STEM_ROLES, PatchStem
from skipless_jax.models.variants import VARIANTS, decode_variant, resolve_sizes  # noqa: F401 (re-exported)

FAMILY = "vit"
# (width, depth, mlp_dim, num_heads) of the standard ViT sizes.
SIZE_FIELDS = ("width", "depth", "mlp_dim", "num_heads", "patch_size")
POOLS = ("tok", "gap", "gap_fc_norm")  # gap_fc_norm: MAE fine-tuning (docs/method/ssl.md §9)
POSEMBS = ("learn", "sincos2d")
# The roles of the names this module spells (models/roles.py); MAE's encoder has the same names.
ROLES = ((r"(^|/)cls$", roles.CLASS_TOKEN), (r"(^|/)pos_embedding$", roles.POSITION_TABLE), *STEM_ROLES)


class ViT(ModelFields):
    """ViT on (B, H, W, C) images -> (logits (B, num_classes) float32, intermediates dict).

    num_classes=0 builds a backbone without a classifier: it returns the pooled features
    (B, width) in place of the logits (DINO's student and teacher).
    """

    num_classes: int
    patch_size: int = 16
    width: int = 768
    depth: int = 12
    mlp_dim: int = 3072
    num_heads: int = 12
    pool: str = "tok"
    posemb: str = "learn"
    dropout: float = 0.0
    head_zero_init: bool = True
    # Normal head kernel of this std (MAE fine-tuning: 2e-5; torch's trunc_normal_ cuts at ±2 absolute,
    # i.e. never at this std); None or 0: `head_zero_init` decides.
    head_init_std: float | None = None
    image_size: int | None = None
    gelu_approximate: bool = True  # tanh GELU (flax's default); DINO and timm use the exact one
    posemb_antialias: bool = True  # resize of the position table for other resolutions
    capture_attention: bool = False
    attention_impl: str | None = None  # None | 'xla' | 'cudnn' (jax.nn.dot_product_attention)
    remat: str | None = None  # a key of REMAT_POLICIES: recompute each block's activations
    scan: bool = False  # the blocks stacked under SCANNED_BLOCKS and run by one scanned layer
    attention_shape: str = "softmax"  # or 'value_skip' (docs/method/skipless_lm.md §1)

    def _position_embedding(self, grid_h: int, grid_w: int, d: int) -> jax.Array:
        extra = int(self.pool != "gap")
        if self.posemb == "sincos2d":
            pe = posemb_sincos_2d(grid_h, grid_w, d)
            return jnp.concatenate([jnp.zeros((1, 1, d)), pe], axis=1) if extra else pe
        # The table is sized for `image_size` and resized for other resolutions (local crops).
        native = (self.image_size // self.patch_size,) * 2 if self.image_size else (grid_h, grid_w)
        pe = self.param(
            "pos_embedding", nn.initializers.normal(stddev=d**-0.5), (1, extra + native[0] * native[1], d), jnp.float32
        )
        if native != (grid_h, grid_w):
            pe = resize_posemb(pe, grid_h, grid_w, antialias=self.posemb_antialias, extra=extra)
        return pe

    @nn.compact
    def __call__(self, images: jax.Array, train: bool = False) -> tuple[jax.Array, dict[str, Any]]:
        out: dict[str, Any] = {}
        p = self.patch_size
        grid_h, grid_w = images.shape[1] // p, images.shape[2] // p
        stem = PatchStem(self.width, p, self.token_graying, self.tg_eps, self.dtype, name="embedding")
        x, out["patches"] = stem(images)
        out["embedding"] = x

        if self.pool != "gap":
            x = prepend_cls(self, x)
        x = x + self._position_embedding(grid_h, grid_w, x.shape[-1]).astype(x.dtype)
        x = nn.Dropout(self.dropout)(x, deterministic=not train)
        x, out["blocks"] = encoder_blocks(self, x, train, final_norm=self.pool != "gap_fc_norm")
        out["encoded"] = x
        fc_norm = nn.LayerNorm(dtype=self.dtype, name="fc_norm") if self.pool == "gap_fc_norm" else None

        def pool(tokens: jax.Array) -> jax.Array:
            if self.pool == "tok":
                return tokens[:, 0]
            if self.pool == "gap":
                return tokens.mean(axis=1)
            return fc_norm(tokens[:, 1:].mean(axis=1))  # MAE's global pool: the patch tokens' mean, then fc_norm

        for block in out["blocks"]:  # the model cut after this block (docs/method/per_layer_eval.md §1)
            block["pre_logits"] = pool(block.get("normed", block["output"]))
        x = pool(x)
        out["pre_logits"] = x
        if not self.num_classes:
            return x, out
        if self.head_init_std:
            head_init = nn.initializers.normal(self.head_init_std)
        else:
            head_init = nn.initializers.zeros if self.head_zero_init else nn.initializers.lecun_normal()
        logits = nn.Dense(self.num_classes, kernel_init=head_init, dtype=self.dtype, name="head")(x)
        out["logits"] = logits.astype(jnp.float32)
        return out["logits"], out


def prepend_cls(module: nn.Module, x: jax.Array) -> jax.Array:
    """(B, n, d) -> (B, 1 + n, d) with the module's learned class token `cls` (zero init) first."""
    b, _, d = x.shape
    cls = module.param("cls", nn.initializers.zeros, (1, 1, d), jnp.float32)
    return jnp.concatenate([jnp.broadcast_to(cls.astype(x.dtype), (b, 1, d)), x], axis=1)


# config.model.remat -> the jax.checkpoint policy of each block (None: no rematerialisation).
REMAT_POLICIES = {
    "full": None,  # save nothing inside a block: recompute it all on the backward pass
    "dots": jax.checkpoint_policies.checkpoint_dots,  # keep matmul outputs
    "dots_no_batch": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
}
ATTENTION_IMPLS = (None, "xla", "cudnn")


def _block_kwargs(module: nn.Module) -> dict[str, Any]:
    return dict(
        mlp_dim=module.mlp_dim,
        num_heads=module.num_heads,
        skip_sab=module.skip_sab,
        skip_ffn=module.skip_ffn,
        dropout=getattr(module, "dropout", 0.0),
        init_scheme=module.init_scheme,
        init_alpha=module.init_alpha,
        init_beta=module.init_beta,
        init_c=module.init_c,
        init_qk_dist=module.init_qk_dist,
        init_vo=module.init_vo,
        init_mlp=module.init_mlp,
        gelu_approximate=module.gelu_approximate,
        capture_attention=getattr(module, "capture_attention", False),
        dtype=module.dtype,
        attention_impl=getattr(module, "attention_impl", None),
        causal=getattr(module, "causal", False),
        decode=getattr(module, "decode", False),
        attention_shape=getattr(module, "attention_shape", "softmax"),
        mlp_branch_gain=getattr(module, "mlp_branch_gain", 0.1),
    )


class _ScannedBlock(nn.Module):
    """One `EncoderBlock` as nn.scan's body: (x, (drop-path rate, index) of this layer) -> (x, its out dict)."""

    block: dict[str, Any]
    train: bool

    @nn.compact
    def __call__(self, x: jax.Array, layer_inputs: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, dict[str, Any]]:
        rate, layer = layer_inputs
        x, out = EncoderBlock(**self.block, drop_path=rate, name="block")(x, self.train, layer)
        return sharding.constrain_batch(x), out


def encoder_blocks(
    module: nn.Module, x: jax.Array, train: bool, final_norm: bool = True, key_mask: jax.Array | None = None
) -> tuple[jax.Array, list[dict[str, Any]]]:
    """The encoder stack `block_0 … block_{depth-1}` + `encoder_norm` (if `final_norm`) of a module
    with the ViT's fields (called inside its compact method, so the parameter names are the ViT's;
    MAE's encoder shares them). Drop-path rises linearly with depth. Returns (encoded, per-block outs);
    each block's out holds its `output` and, with `final_norm`, `normed` = that output through
    `encoder_norm` (the multi-layer features of the dense probes; the last block's is `encoded`).

    `module.remat` wraps each block in jax.checkpoint (REMAT_POLICIES); `module.scan` runs one
    scanned block whose parameters carry a leading layer axis under SCANNED_BLOCKS (the same
    function: `stack_blocks` / `unstack_blocks` convert the parameters; each layer draws its own
    init key, its drop-path rate and dropout key). `key_mask` (B, 1, n, n) bool, unrolled blocks
    only: the keys each query attends to (the gpt family's packed documents, docs/method/lm.md §5).
    """
    depth = module.depth
    rates = [module.drop_path * layer / max(depth - 1, 1) for layer in range(depth)]
    # The batch axis stays split over the data axes between blocks (a no-op outside a mesh), so a
    # reshape in a block cannot silently gather the batch onto every device.
    x = sharding.constrain_batch(x)
    policy = getattr(module, "remat", None)
    kwargs = _block_kwargs(module)
    if getattr(module, "scan", False):
        if key_mask is not None:
            raise ValueError("a scanned encoder takes no key mask (packed documents need config.model.scan=False)")
        body = _ScannedBlock
        if policy:
            body = nn.remat(body, policy=REMAT_POLICIES[policy], prevent_cse=False)
        scanned = nn.scan(
            body, variable_axes={"params": 0}, split_rngs={"params": True, "dropout": True},
            in_axes=0, length=depth,
        )(kwargs, train, name=SCANNED_BLOCKS)
        x, stacked = scanned(x, (jnp.asarray(rates, jnp.float32), jnp.arange(depth)))
        blocks = [jax.tree.map(lambda a, i=i: a[i], stacked) for i in range(depth)]
    else:
        block_cls = EncoderBlock
        if policy:
            block_cls = nn.remat(EncoderBlock, policy=REMAT_POLICIES[policy], static_argnums=(2,))
        blocks = []
        for layer in range(depth):
            x, block_out = block_cls(**kwargs, drop_path=rates[layer], name=f"block_{layer}")(x, train, layer, key_mask)
            x = sharding.constrain_batch(x)
            blocks.append(block_out)
    if final_norm:
        norm = nn.LayerNorm(dtype=module.dtype, name="encoder_norm")
        x = norm(x)
        for block in blocks:  # each block's output through the final norm (dense probes; dead code otherwise)
            block["normed"] = norm(block["output"])
    return x, blocks


_BLOCK_NAME = re.compile(r"block_(\d+)")


def stack_blocks(params: dict[str, Any]) -> dict[str, Any]:
    """Unrolled parameters (block_0 … block_{L-1}) -> the scanned layout (SCANNED_BLOCKS/block, axis 0 = layer)."""
    names = sorted((k for k in params if _BLOCK_NAME.fullmatch(k)), key=lambda k: int(k.split("_")[1]))
    if not names:
        return params
    out = {k: v for k, v in params.items() if k not in names}
    out[SCANNED_BLOCKS] = {"block": jax.tree.map(lambda *layers: jnp.stack(layers), *[params[n] for n in names])}
    return out


def unstack_blocks(params: dict[str, Any]) -> dict[str, Any]:
    """The scanned layout -> unrolled parameters block_0 … block_{L-1}."""
    if SCANNED_BLOCKS not in params:
        return params
    stacked = params[SCANNED_BLOCKS]["block"]
    depth = jax.tree.leaves(stacked)[0].shape[0]
    out = {k: v for k, v in params.items() if k != SCANNED_BLOCKS}
    for i in range(depth):
        out[f"block_{i}"] = jax.tree.map(lambda a, i=i: a[i], stacked)
    return out


def model_kwargs(model_config: Any, num_classes: int) -> dict[str, Any]:
    """ViT constructor arguments from `config.model` (a variant name fills the size fields)."""
    kwargs = resolve_sizes(model_config)
    kwargs.pop("name", None)  # the registry's family name
    kwargs["dtype"] = jnp.dtype(kwargs.get("dtype", "float32"))
    kwargs["init_scheme"] = kwargs.pop("init", "default")  # `init` would shadow Module.init
    kwargs.pop("init_self_share", None)  # a target for init_beta, set from it (models.apply_init_self_share)
    gelu = kwargs.pop("gelu", None) or "tanh"  # None (a config's placeholder): flax's tanh form
    kwargs["gelu_approximate"] = gelu == "tanh"
    return dict(num_classes=num_classes, **kwargs)


def build(model_config: Any, num_classes: int, image_size: int | None = None) -> ViT:
    """The registry's constructor: `image_size` sizes a learned position table for other inputs."""
    kwargs = model_kwargs(model_config, num_classes)
    if image_size is not None:
        kwargs["image_size"] = image_size
    return ViT(**kwargs)


def layer_id(path: str, num_layers: int, table: roles.Table = ROLES) -> int:
    """MAE's `get_layer_id_for_vit` on a '/'-joined parameter path (docs/method/ssl.md §9): i + 1 for
    `block_i/*`; 0 for the embedding (`roles.EMBEDDING_ROLES` in `table`: the class token, the
    position table, the patch embedding; MAE: cls_token, pos_embed, patch_embed); num_layers + 1
    the rest."""
    match = _BLOCK_NAME.fullmatch(top_name(path))
    if match:
        return int(match.group(1)) + 1
    return 0 if roles.role_of(path, table) in roles.EMBEDDING_ROLES else num_layers + 1


def describe(model_config: Any) -> ModelDescription:
    """Class token first unless pool='gap'; every block records its keys and, with the final
    `encoder_norm` (not with 'gap_fc_norm'), its output through that norm."""
    sizes = resolve_sizes(model_config)
    pool, depth, p = sizes.get("pool", "tok"), sizes["depth"], sizes["patch_size"]
    final = pool != "gap_fc_norm"
    return ModelDescription(
        family=FAMILY, patch_size=p, token_stride=p, width=sizes["width"], depth=depth,
        prefix_tokens=int(pool != "gap"), grid_tokens=True, final_norm=final, normed_blocks=final, block_keys=True,
        block_pre_logits=True, num_layers=depth, layer_id=functools.partial(layer_id, num_layers=depth))

def check_config(model: Any, image_size: int) -> None:
    """Variant, sizes, heads, patch vs image size, pooling, position embedding, dtype, GELU, TG, init."""
    sizes = resolve_sizes(model)
    for field in SIZE_FIELDS:
        value = sizes.get(field)
        require(isinstance(value, int) and not isinstance(value, bool) and value > 0,
                 f"config.model.{field}={value!r} must be a positive integer")
    p = sizes["patch_size"]
    require(image_size % p == 0,
             f"config.model.patch_size={p} does not divide the image size {image_size}; "
             f"allowed: divisors of {image_size}")
    require(sizes["width"] % sizes["num_heads"] == 0,
             f"config.model.num_heads={sizes['num_heads']} does not divide config.model.width={sizes['width']}")
    require(model.get("pool", "tok") in POOLS,
             f"config.model.pool={model.get('pool')!r} is unknown; allowed: {list(POOLS)}")
    require(model.get("posemb", "learn") in POSEMBS,
             f"config.model.posemb={model.get('posemb')!r} is unknown; allowed: {list(POSEMBS)}")
    require(str(model.get("dtype", "float32")) in DTYPES,
             f"config.model.dtype={model.get('dtype')!r} is unknown; allowed: {list(DTYPES)}")
    require((model.get("gelu") or "tanh") in GELUS,
             f"config.model.gelu={model.get('gelu')!r} is unknown; allowed: {list(GELUS)}")
    std = model.get("head_init_std")
    require(std is None or (isinstance(std, (int, float)) and math.isfinite(std) and std >= 0),
             f"config.model.head_init_std={std!r} must be a number >= 0 (None or 0: zero init)")
    for field in ("dropout", "drop_path"):
        value = model.get(field, 0.0)
        require(isinstance(value, (int, float)) and math.isfinite(value) and 0.0 <= value < 1.0,
                 f"config.model.{field}={value!r} must be in [0, 1)")
    remat = model.get("remat")
    require(remat is None or remat in REMAT_POLICIES,
             f"config.model.remat={remat!r} is unknown; allowed: None, {', '.join(map(repr, REMAT_POLICIES))}")
    require(isinstance(model.get("scan", False), bool),
             f"config.model.scan={model.get('scan')!r} must be True or False")
    impl = model.get("attention_impl")
    require(impl in ATTENTION_IMPLS,
             f"config.model.attention_impl={impl!r} is unknown; allowed: {list(ATTENTION_IMPLS)}")
    init_lib.validate_init_config(sizes)
    shape = model.get("attention_shape", "softmax")
    require(shape in ("softmax", "value_skip"),
             f"config.model.attention_shape={shape!r} is not defined for the 'vit' family (SAS centres by the "
             "causal mask); allowed: 'softmax', 'value_skip'")
    require(shape == "softmax" or model.get("init", "default") not in init_lib.REFERENCE_SCHEMES,
             f"config.model.attention_shape={shape!r}: the reference inits have no rule for its gains; "
             f"config.model.init={model.get('init')!r}, allowed: 'default', 'skipless', 'mimetic', 'orthogonal'")
    if model.get("token_graying") is not None:
        token_graying.validate_token_graying(model.token_graying, model.get("tg_eps", 0.95))


def block_params(params: Any) -> list[Any]:
    """Per-layer parameter dicts of `EncoderBlock`s (for the Jacobian analysis), either layout."""
    params = unstack_blocks(params)
    return [params[f"block_{i}"] for i in range(len([k for k in params if re.fullmatch(r"block_\d+", k)]))]
