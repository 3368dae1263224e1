"""Model families by `config.model.name` (default 'vit').

Each family is one module exposing `build(model_config, num_classes, image_size=None)` (a flax
module whose `__call__(images, train)` returns `(logits or pooled features, out)`, with
`out['blocks']` the per-layer dicts of ①, ①+②, ③, ③+④ that the κ analysis reads) and
`check_config(model_config, image_size)` (one-line ValueErrors); a family whose model keeps
running statistics (ConvMixer's BatchNorm, collection `batch_stats`) sets `RUNNING_STATS = True`.
Shared parts: `stem.py`
(patchify → Token Graying → projection), `attention.py`, `blocks.py` (the residual switches),
`common.py` (DropPath, MLP, position embeddings), `init.py` (the skipless init).
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

import flax.linen as nn

FAMILIES = {
    "vit": "skipless_jax.models.vit",
    "convmixer": "skipless_jax.models.convmixer",
    "swin": "skipless_jax.models.swin",
    "cait": "skipless_jax.models.cait",
    "pvt_v2": "skipless_jax.models.pvt_v2",
}


def family(model_config: Any) -> ModuleType:
    """The family module of `config.model` (its `name`, default 'vit')."""
    name = model_config.get("name", "vit") or "vit"
    if name not in FAMILIES:
        raise ValueError(f"config.model.name={name!r} is unknown; allowed: {sorted(FAMILIES)}")
    return importlib.import_module(FAMILIES[name])


def build(model_config: Any, num_classes: int, image_size: int | None = None) -> nn.Module:
    """The model `config.model` describes; num_classes=0: a backbone returning pooled features."""
    return family(model_config).build(model_config, num_classes, image_size)


def has_running_stats(model_config: Any) -> bool:
    """Whether the model keeps a `batch_stats` collection (running BatchNorm statistics) that the
    supervised trainer updates during training and evaluates with."""
    return bool(getattr(family(model_config), "RUNNING_STATS", False))


def check_config(model_config: Any, image_size: int) -> None:
    """The family's own config check (one-line ValueError for the first bad field)."""
    family(model_config).check_config(model_config, image_size)
