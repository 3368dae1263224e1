"""Model families by `config.model.name` (default 'vit').

Each family is one module exposing `build(model_config, num_classes, image_size=None)` (a flax
module whose `__call__(images, train)` returns `(logits or pooled features, out)`, with
`out['blocks']` the per-layer dicts of ①, ①+②, ③, ③+④ that the κ analysis reads) and
`check_config(model_config, image_size)` (one-line ValueErrors) and `describe(model_config)` (a
`ModelDescription`: what evaluators, layer decay and trainers may know of the model; nothing
outside a family module reads its own config fields); a family whose model keeps running
statistics (ConvMixer's BatchNorm, collection `batch_stats`) sets `RUNNING_STATS = True`.
Shared parts: `stem.py`
(patchify → Token Graying → projection), `attention.py`, `blocks.py` (the residual switches),
`common.py` (DropPath, MLP, position embeddings), `init.py` (the skipless init). `apply_init_self_share`
sets a config's β from its target self-attention share (docs/method/papers.md §3).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

import flax.linen as nn
import jax

from skipless_jax.models import init as init_lib
from skipless_jax.models import init_schemes, roles

FAMILIES = {
    "vit": "skipless_jax.models.vit",
    "convmixer": "skipless_jax.models.convmixer",
    "swin": "skipless_jax.models.swin",
    "cait": "skipless_jax.models.cait",
    "pvt_v2": "skipless_jax.models.pvt_v2",
    "gpt": "skipless_jax.models.gpt",  # the causal decoder of the lm trainer (tokens, not images)
}


@dataclasses.dataclass(frozen=True)
class ModelDescription:
    """The facts of a model `config.model` describes that code outside its family may read.

    family: the family name; patch_size: the stem's patch (stride) in pixels, whose patch matrix
    Token Graying acts on; token_stride: pixels per token of `out['encoded']`'s grid (the patch
    size, × 2 per later stage of a pyramid); width: channels of `out['encoded']`; depth:
    len(out['blocks']); prefix_tokens: tokens of `out['encoded']` before its grid (a class
    token); grid_tokens: the other tokens are the row-major (H/stride, W/stride) grid;
    final_norm: `out['encoded']` went through a final norm; normed_blocks: every block's out has
    `normed`, its output through that norm on `encoded`'s tokens (multi-block dense probes);
    block_keys: every block's out has `keys` (B, [prefix +] grid tokens, width) of its attention
    on `encoded`'s grid (TokenCut); num_layers and layer_id(path) -> 0 … num_layers + 1: the
    layer of a '/'-joined parameter path for layer-wise lr decay (docs/method/ssl.md §9);
    role_of(path): the role of a parameter path (models/roles.py), from the family's `ROLES`;
    block_pre_logits: every block's out has `pre_logits`, the pooled feature of the model cut
    after that block (docs/method/per_layer_eval.md §1).
    """

    family: str
    patch_size: int
    token_stride: int
    width: int
    depth: int
    prefix_tokens: int
    grid_tokens: bool
    final_norm: bool
    normed_blocks: bool
    block_keys: bool
    num_layers: int
    layer_id: Callable[[str], int]
    block_pre_logits: bool = False

    def role_of(self, path: str) -> str:
        """The role of a '/'-joined parameter path of this family's model (models/roles.py)."""
        return roles.role_of(path, roles.table_of(self.family))


def family(model_config: Any) -> ModuleType:
    """The family module of `config.model` (its `name`, default 'vit')."""
    name = model_config.get("name", "vit") or "vit"
    if name not in FAMILIES:
        raise ValueError(f"config.model.name={name!r} is unknown; allowed: {sorted(FAMILIES)}")
    return importlib.import_module(FAMILIES[name])


# Every model module that declares parameter roles: the families, MAE's pre-training model, DINO's head.
ROLE_MODULES = (*FAMILIES, "mae", "dino_head")


@functools.cache
def _every_role_table() -> roles.Table:
    return tuple(pattern for module in ROLE_MODULES for pattern in roles.table_of(module))


def role_of(path: str) -> str:
    """The role of a parameter path of any model here (the names of every family, of MAE and of
    DINO's head: what family-blind code reads, e.g. the decay mask of whatever tree the optimizer gets)."""
    return roles.role_of(path, _every_role_table())


def find_role(path: str) -> str | None:
    """`role_of`, None for a name no model here spells (a toy tree's)."""
    return roles.find_role(path, _every_role_table())


def role_table(model: nn.Module) -> roles.Table:
    """The role table of a built model: the `ROLES` of the module defining its class (or the
    nearest base class whose module declares one); DINO's: its backbone's, then its head's."""
    if type(model).__name__ == "DINO":
        return (*role_table(model.backbone), *roles.table_of("dino_head"))
    for cls in type(model).__mro__:
        table = getattr(sys.modules.get(cls.__module__), "ROLES", None)
        if table is not None:
            return table
    raise ValueError(f"a {type(model).__name__} model has no role table; its module needs ROLES (models/roles.py)")


def build(model_config: Any, num_classes: int, image_size: int | None = None) -> nn.Module:
    """The model `config.model` describes; num_classes=0: a backbone returning pooled features."""
    return family(model_config).build(model_config, num_classes, image_size)


def init_variables(
    model_config: Any, model: nn.Module, rng: jax.Array, dummy: Any, **rngs: jax.Array
) -> dict[str, Any]:
    """The initial variables of `model` (built from `model_config`, or a module holding it, as
    DINO's backbone + head) on inputs shaped like `dummy`, under every `config.model.init`: the
    module's own init with `rng` as its 'params' stream (`rngs`: other streams its init draws,
    e.g. MAE's 'masking'), then, for a reference scheme ('timm', 'mae'), every parameter redrawn
    by its family's table with the same key (`init_schemes.reinitialize`, docs/method/families.md §24), as
    for the `gpt` family's default, GPT-2's (docs/method/lm.md §4). A parameter without a role in
    the model's table (`role_table`) is a ValueError naming it."""
    variables = model.init({"params": rng, **rngs}, dummy, train=False)
    roles.check(variables["params"], role_table(model))  # every parameter has a role (models/roles.py)
    if init_schemes.redraws(model_config):
        variables = init_schemes.reinitialize(model, variables, rng)
    return variables


def describe(model_config: Any) -> ModelDescription:
    """The `ModelDescription` of `config.model` (its variant resolved)."""
    return family(model_config).describe(model_config)


def num_tokens(model_config: Any, image_size: int) -> int:
    """Tokens the first block attends over on `image_size` inputs: the class tokens, then the grid."""
    description = describe(model_config)
    return description.prefix_tokens + (image_size // description.patch_size) ** 2


def apply_init_self_share(model_config: Any, image_size: int) -> tuple[Any, float | None]:
    """(model config, β): with `config.model.init_self_share` set (docs/method/papers.md §3, this
    project's extension), a copy of `model_config` whose `init_beta` is the β whose self-attention
    share at init is that target for this model's tokens on `image_size` inputs, and that β;
    without, (`model_config`, None). `model_config` itself is never changed."""
    target = model_config.get("init_self_share")
    if target is None:
        return model_config, None
    beta = init_lib.self_share_beta(model_config, num_tokens(model_config, image_size), target)
    derived = copy.deepcopy(model_config.as_configdict() if hasattr(model_config, "as_configdict") else model_config)
    derived.init_beta = beta
    return derived, derived.init_beta


def has_running_stats(model_config: Any) -> bool:
    """Whether the model keeps a `batch_stats` collection (running BatchNorm statistics) that the
    supervised trainer updates during training and evaluates with."""
    return bool(getattr(family(model_config), "RUNNING_STATS", False))


def check_config(model_config: Any, image_size: int) -> None:
    """The family's own config check (one-line ValueError for the first bad field), then
    whether a reference init ('timm', 'mae') is defined for the family."""
    name = model_config.get("name", "vit") or "vit"
    if name != "vit" and model_config.get("init_self_share") is not None:
        raise ValueError(f"config.model.init_self_share is defined for the 'vit' family; config.model.name={name!r}")
    family(model_config).check_config(model_config, image_size)
    init_schemes.check(model_config.get("init", "default"), name)
