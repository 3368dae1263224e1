"""A causal decoder (GPT) whose attention and MLP residuals are switches (docs/method/papers.md §1,
docs/method/gpt.md §26).

    x = E[tokens] + P[:T]                          # token and position embeddings
    x = block_l(x), l = 0 … depth-1                # `blocks.EncoderBlock`, causal: ② and ④ are switches
    logits = LN(x) Eᵀ   (tied)   or   LN(x) W     # the final norm, then the output head

The blocks are the ViT's (`vit.encoder_blocks`: the same switches `skip_sab`, `skip_ffn`, the
same init fields `init='skipless' | 'default' | 'mimetic'` with α, β, c, scan, remat and
`attention_impl`), made causal through the attention's mask; `init='default'` is GPT-2's
(N(0, 0.02²), the residual output projections N(0, (0.02/√(2L))²), zero biases; drawn by role,
models/init_schemes.py, docs/method/lm.md §4): the logits at position t depend on
tokens 0 … t only. The skipless init's W^Q W^Kᵀ = αZ + βI favours attending to the token itself,
which the causal mask allows. Token Graying does not apply (it pre-conditions image patches).

`decode=True` builds the same parameters with each attention's KV cache (collection `cache`),
for generation one token at a time (skipless_jax/generate.py). `GPT(...)(tokens, train)`
returns `(logits (B, T, vocab) float32, out)`, `out['blocks']` the per-layer dicts that
`blocks.residual` fills, so the κ analysis of docs/method/papers.md §2 reads a language model too.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from skipless_jax.checks import DTYPES, GELUS, is_positive_int, require
from skipless_jax.models import ModelDescription, roles
from skipless_jax.models import init as init_lib
from skipless_jax.models.attention import ATTENTION_SHAPES
from skipless_jax.models.blocks import SwitchFields
from skipless_jax.models.vit import ATTENTION_IMPLS, REMAT_POLICIES, encoder_blocks
from skipless_jax.models.vit import layer_id as vit_layer_id

FAMILY = "gpt"
SIZE_FIELDS = ("width", "depth", "mlp_dim", "num_heads", "seq_len")
# The roles of the names this module spells (models/roles.py).
ROLES = ((r"(^|/)token_embedding/embedding$", roles.TOKEN_TABLE), (r"(^|/)pos_embedding$", roles.POSITION_TABLE))
EMBEDDING_STD = 0.02  # GPT-2's init of both tables


class GPT(SwitchFields):
    """(B, T) int tokens -> (logits (B, T, vocab_size) float32, intermediates dict); T ≤ seq_len."""

    vocab_size: int
    seq_len: int = 1024  # rows of the position table: the longest context
    width: int = 768
    depth: int = 12
    mlp_dim: int = 3072
    num_heads: int = 12
    tied_head: bool = True  # logits = LN(x) Eᵀ with the token table E; else a Dense `head`
    dropout: float = 0.0
    gelu_approximate: bool = True
    attention_impl: str | None = None  # None | 'xla' | 'cudnn' (jax.nn.dot_product_attention)
    remat: str | None = None
    scan: bool = False
    decode: bool = False  # with the attention's KV cache (generation); scan and remat off
    causal: bool = True  # read by the blocks (vit.encoder_blocks): the decoder is causal, always
    attention_shape: str = "softmax"  # attention.ATTENTION_SHAPES (docs/method/skipless_lm.md §1-§3)
    mlp_branch_gain: float = 0.1  # SAS / SAS-P: the MLP branch's initial gain (skipless.yaml)

    @nn.compact
    def __call__(self, tokens: jax.Array, train: bool = False, segments: jax.Array | None = None,
                 positions: jax.Array | None = None) -> tuple[jax.Array, dict[str, Any]]:
        """`segments`, `positions` (B, T) int (packed documents, docs/method/lm.md §5): query t
        attends to the keys of its own segment only; its position embedding is P[positions_t]."""
        out: dict[str, Any] = {}
        embed = nn.Embed(self.vocab_size, self.width, embedding_init=nn.initializers.normal(EMBEDDING_STD),
                         dtype=self.dtype, name="token_embedding")
        table = self.param("pos_embedding", nn.initializers.normal(EMBEDDING_STD), (self.seq_len, self.width),
                           jnp.float32)
        n = tokens.shape[1]
        if self.decode:  # the positions the cache has seen so far
            created = not self.has_variable("cache", "position")
            position = self.variable("cache", "position", lambda: jnp.zeros((), jnp.int32))
            start = jnp.zeros((), jnp.int32) if created else position.value
            if not created:
                position.value = start + n
            position_rows = jax.lax.dynamic_slice_in_dim(table, start, n)[None]
        else:
            position_rows = table[:n][None] if positions is None else table[positions]
        x = embed(tokens) + position_rows.astype(self.dtype)
        out["embedding"] = x
        x = nn.Dropout(self.dropout)(x, deterministic=not train)
        same = None if segments is None else (segments[:, :, None] == segments[:, None, :])[:, None]  # (B, 1, T, T)
        x, out["blocks"] = encoder_blocks(self, x, train, key_mask=same)  # + `encoder_norm`, the final norm
        out["encoded"] = x
        if self.tied_head:
            logits = embed.attend(x)
        else:
            logits = nn.Dense(self.vocab_size, kernel_init=nn.initializers.normal(EMBEDDING_STD), dtype=self.dtype,
                              name="head")(x)
        out["logits"] = logits.astype(jnp.float32)
        return out["logits"], out


def model_kwargs(model_config: Any, vocab_size: int) -> dict[str, Any]:
    """GPT constructor arguments from `config.model` (`init` becomes `init_scheme`, `gelu` the flag)."""
    kwargs = dict(model_config)
    kwargs.pop("name", None)
    kwargs["dtype"] = jnp.dtype(kwargs.get("dtype", "float32"))
    kwargs["init_scheme"] = kwargs.pop("init", "default")
    kwargs["gelu_approximate"] = kwargs.pop("gelu", "tanh") == "tanh"
    return dict(vocab_size=vocab_size, **kwargs)


def build(model_config: Any, num_classes: int, image_size: int | None = None) -> GPT:
    """The registry's constructor: `num_classes` is the vocabulary (the head's classes); there is no image."""
    del image_size
    return GPT(**model_kwargs(model_config, num_classes))


def layer_id(path: str, num_layers: int) -> int:
    """0 for the embedding tables, i + 1 for `block_i/*`, num_layers + 1 the rest (final norm, head)."""
    return vit_layer_id(path, num_layers, ROLES)


def describe(model_config: Any) -> ModelDescription:
    """No image stem (patch_size 0) and no grid: a sequence of tokens; every block records its keys
    and its output through the final norm."""
    depth = model_config["depth"]
    return ModelDescription(
        family=FAMILY, patch_size=0, token_stride=1, width=model_config["width"], depth=depth, prefix_tokens=0,
        grid_tokens=False, final_norm=True, normed_blocks=True, block_keys=True, num_layers=depth,
        layer_id=functools.partial(layer_id, num_layers=depth))


def check_config(model: Any, image_size: int | None = None) -> None:
    """Sizes, heads, head tying, dropout, dtype, GELU, remat, scan, attention implementation, init;
    Token Graying is refused (it acts on image patches)."""
    del image_size
    for field in SIZE_FIELDS:
        value = model.get(field)
        require(is_positive_int(value), f"config.model.{field}={value!r} must be a positive integer")
    width, heads = model["width"], model["num_heads"]
    require(width % heads == 0, f"config.model.num_heads={heads} does not divide config.model.width={width}")
    require(model.get("causal", True) is True,
             f"config.model.causal={model.get('causal')!r}: the decoder is causal; allowed: True")
    for field in ("skip_sab", "skip_ffn", "tied_head", "scan"):
        value = model.get(field, field != "scan")
        require(isinstance(value, bool), f"config.model.{field}={value!r} must be True or False")
    for field in ("dropout", "drop_path"):
        value = model.get(field, 0.0)
        require(isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < 1,
                 f"config.model.{field}={value!r} must be in [0, 1)")
    dtype = model.get("dtype", "float32")
    require(dtype in DTYPES, f"config.model.dtype={dtype!r} is unknown; allowed: {list(DTYPES)}")
    gelu = model.get("gelu", "tanh")
    require(gelu in GELUS, f"config.model.gelu={gelu!r} is unknown; allowed: {list(GELUS)}")
    remat = model.get("remat")
    require(remat is None or remat in REMAT_POLICIES,
             f"config.model.remat={remat!r} is unknown; allowed: None, {', '.join(map(repr, REMAT_POLICIES))}")
    impl = model.get("attention_impl")
    require(impl in ATTENTION_IMPLS,
             f"config.model.attention_impl={impl!r} is unknown; allowed: {list(ATTENTION_IMPLS)}")
    require(not model.get("decode", False), "config.model.decode=True is for generation only; allowed: False")
    require(model.get("token_graying") is None,
             f"config.model.token_graying={model.get('token_graying')!r}: Token Graying pre-conditions image "
             "patches and does not apply to the gpt family; allowed: None")
    init = model.get("init", "default")
    require(init in ("default", "skipless", "mimetic", "orthogonal"),
             f"config.model.init={init!r} is not defined for the 'gpt' family; allowed: 'default', 'skipless', "
             "'mimetic', 'orthogonal'")
    init_lib.validate_init_config(model)
    check_attention_shape(model)


# The skips each shaped block has (docs/method/skipless_lm.md §2-§3): (skip_sab, skip_ffn).
SHAPED_SKIPS = {"sas": (False, True), "sas_p": (False, False)}


def check_attention_shape(model: Any) -> None:
    """`attention_shape` one of ATTENTION_SHAPES; SAS and SAS-P with the skips they have and a finite
    `mlp_branch_gain` > 0."""
    shape = model.get("attention_shape", "softmax")
    require(shape in ATTENTION_SHAPES,
             f"config.model.attention_shape={shape!r} is unknown; allowed: {', '.join(map(repr, ATTENTION_SHAPES))}")
    if shape in SHAPED_SKIPS:
        skips = (model.get("skip_sab", True), model.get("skip_ffn", True))
        require(skips == SHAPED_SKIPS[shape],
                 f"config.model.attention_shape={shape!r} has skip_sab={SHAPED_SKIPS[shape][0]}, "
                 f"skip_ffn={SHAPED_SKIPS[shape][1]}; got skip_sab={skips[0]!r}, skip_ffn={skips[1]!r}")
    gain = model.get("mlp_branch_gain", 0.1)
    require(isinstance(gain, (int, float)) and not isinstance(gain, bool) and math.isfinite(gain) and gain > 0,
             f"config.model.mlp_branch_gain={gain!r} must be a finite number > 0")
