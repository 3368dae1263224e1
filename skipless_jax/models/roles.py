"""Parameter roles: the one vocabulary of what a leaf of a parameter tree is.

A role says what a parameter is for, whatever module spells its name: the class token, a
position table, the patch embedding's kernel, a norm's scale, a query kernel, ... Each model
module declares the roles of the names it spells, `ROLES`: (regex searched in the '/'-joined
path, role) pairs, the first match deciding, read before `SHARED` (the names of the shared parts:
attention, norms, `common.MlpBlock`, the classifier `head`). Patterns start at a name boundary
`(^|/)`, so a model's tree nested under a prefix (DINO's `backbone/`) reads alike. Every pattern
names a parameter that exists: there is no catch-all for `kernel` or `bias`, so a new Dense or
conv has no role until its module declares one. `role_of(path, table)` raises on a path no
pattern knows, and `models.init_variables` reads the role of every parameter it initializes
(`check`), so a model with an unlabelled parameter fails to build.

Who reads roles (never names): the reference inits (`init_schemes.RULES`: role -> rule), the
weight-decay masks (`optim.decay_mask`, DINO's `dino_decay_mask`), Muon's matrices
(`optim.muon_labels`), layer decay's stem (`vit.layer_id`, `cait.layer_id`, `gpt.layer_id`),
`init_from`'s position-table resize (`pretrained`) and the MAE -> classifier renames
(`trainers/warm_start.classifier_rename`), the official converters' position tables.
`models.describe(config.model).role_of(path)` answers for one family, `models.role_table(model)`
gives a built model's table, `models.role_of(path)` answers for a path of any model here (a
family, MAE's decoder, DINO's head).
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Sequence
from typing import Any

from skipless_jax.nested import flatten

CLASS_TOKEN = "class_token"  # a learned (1, 1, d) token prepended to the grid
MASK_TOKEN = "mask_token"  # MAE's token standing for a removed patch
POSITION_TABLE = "position_table"  # a learned (1, [1 +] n, d) position embedding
TOKEN_TABLE = "token_table"  # a language model's (vocab, d) token embedding
RELATIVE_POSITION_TABLE = "relative_position_table"  # Swin's ((2w − 1)², h) bias table
LAYER_SCALE = "layer_scale"  # CaiT's per-channel γ on a residual branch
PATCH_KERNEL = "patch_kernel"  # the stem's patch projection
PATCH_BIAS = "patch_bias"
NORM_SCALE = "norm_scale"  # LayerNorm / BatchNorm
NORM_BIAS = "norm_bias"
ATTENTION_QKV = "attention_qkv"  # the (d, d) query, key and value kernels
ATTENTION_OUT = "attention_out"  # the (d, d) output kernel
ATTENTION_BIAS = "attention_bias"  # the biases of those four and of the talking-heads mixings
TALKING_HEADS = "talking_heads"  # CaiT's (h, h) mixings before and after the softmax
CONV_KERNEL = "conv_kernel"  # a strided convolution that is not the first stem (PVTv2)
CONV_BIAS = "conv_bias"
DEPTHWISE_KERNEL = "depthwise_kernel"  # a depthwise convolution (ConvMixer, PVTv2's MLP)
DEPTHWISE_BIAS = "depthwise_bias"
HEAD_KERNEL = "head_kernel"  # the classifier
HEAD_BIAS = "head_bias"
WEIGHT_NORM_SCALE = "weight_norm_scale"  # g of a weight-normalized layer (DINO's head)
GAIN = "gain"  # a trainable scalar or per-head gain (Value-SkipInit, SAS: docs/method/skipless_lm.md)
MLP_OUT = "mlp_out"  # the second kernel of a block's MLP, its branch's output (GPT-2 scales it)
# The Dense kernels no role above names, each by an explicit pattern: the MLP's first layer (and
# PVTv2's second), ConvMixer's pointwise conv, Swin's patch merging, MAE's decoder projections, the
# hidden layers of DINO's head and its weight-normalized direction.
KERNEL = "kernel"
BIAS = "bias"  # the biases of those layers

ROLES = (CLASS_TOKEN, MASK_TOKEN, POSITION_TABLE, TOKEN_TABLE, RELATIVE_POSITION_TABLE, LAYER_SCALE, PATCH_KERNEL,
         PATCH_BIAS, NORM_SCALE, NORM_BIAS, ATTENTION_QKV, ATTENTION_OUT, ATTENTION_BIAS, TALKING_HEADS, CONV_KERNEL,
         CONV_BIAS, DEPTHWISE_KERNEL, DEPTHWISE_BIAS, HEAD_KERNEL, HEAD_BIAS, WEIGHT_NORM_SCALE, GAIN, MLP_OUT,
         KERNEL, BIAS)
# Layer 0 of layer-wise lr decay (docs/method/ssl.md §9): the tokens' embedding before the first block.
EMBEDDING_ROLES = frozenset({CLASS_TOKEN, POSITION_TABLE, TOKEN_TABLE, PATCH_KERNEL, PATCH_BIAS})
# Every layer's bias (an additive (out,) vector); DINO's decay groups leave them out.
BIASES = frozenset({PATCH_BIAS, NORM_BIAS, ATTENTION_BIAS, CONV_BIAS, DEPTHWISE_BIAS, HEAD_BIAS, BIAS})

Table = Sequence[tuple[str, str]]

_NORM = r"(^|/)(LayerNorm_\d+|norm\d?|\w*_norm)"
# The shared parts' names: attention.py's kernels and mixings, the norms (flax's LayerNorm_i,
# the families' norm1/norm2/*_norm), the classifier `head`, common.MlpBlock's two Dense layers
# (`MlpBlock_0` in the ViT's blocks, `mlp` in CaiT's and Swin's).
_MLP = r"(^|/)(MlpBlock_0|mlp)/"
SHARED: Table = (
    (r"(^|/)\w+_gain$", GAIN),
    (_NORM + "/scale$", NORM_SCALE),
    (_NORM + "/bias$", NORM_BIAS),
    (r"/(query|key|value)$", ATTENTION_QKV),
    (r"/out$", ATTENTION_OUT),
    (r"/(query|key|value|out|proj_l|proj_w)_bias$", ATTENTION_BIAS),
    (r"/(proj_l|proj_w)$", TALKING_HEADS),
    (r"(^|/)head/kernel$", HEAD_KERNEL),
    (r"(^|/)head/bias$", HEAD_BIAS),
    (_MLP + "Dense_1/kernel$", MLP_OUT),
    (_MLP + "Dense_0/kernel$", KERNEL),
    (_MLP + "Dense_[01]/bias$", BIAS),
)


def find_role(path: str, table: Table) -> str | None:
    """The role of a '/'-joined parameter path (a leading 'params/' skipped): that of the first
    pattern of `table`, then of SHARED, found in it; None if none is."""
    name = path.removeprefix("params/")
    return next((role for pattern, role in (*table, *SHARED) if re.search(pattern, name)), None)


def role_of(path: str, table: Table) -> str:
    """`find_role`, a ValueError naming the path where no pattern knows it."""
    role = find_role(path, table)
    if role is None:
        raise ValueError(f"the parameter {path!r} has no role; declare one in its model's ROLES (models/roles.py)")
    return role


def check(params: Any, table: Table) -> None:
    """A one-line ValueError naming the first leaf of a parameter tree that no pattern of `table`
    (then SHARED) knows."""
    for path in flatten(params):
        role_of(path, table)


def table_of(model: str) -> Table:
    """The `ROLES` of the model module `skipless_jax.models.<model>` (a family's, 'mae', 'dino_head')."""
    return importlib.import_module(f"{__package__}.{model}").ROLES


def roles(params: Any, table: Table) -> dict[str, str]:
    """{path: role} of every leaf of a parameter tree."""
    return {path: role_of(path, table) for path in flatten(params)}
