"""Layer-wise learning-rate decay for ViT fine-tuning (BEiT / MAE `util/lr_decay.py`), docs/method.md §9.

    layer id:  0 for `cls`, `pos_embedding`, `embedding/*`;  i + 1 for `block_i/*`;
               num_layers + 1 for everything else (`encoder_norm`, `fc_norm`, `head`, ...)
    scale:     decay ** (num_layers + 1 − id)          (MAE: num_layers = len(blocks) + 1 there)

`num_layers` is the ViT's depth. `scale_by_layer(scales)` multiplies each leaf's *final* update by
its scale; chain it after the whole optimizer (learning rate and weight decay included):

    tx = optax.chain(OPTIMIZERS[name](config.optimizer, schedule), layer_decay(0.65, depth))

Why this is torch's per-group `lr = lr_t · lr_scale`:

* AdamW. optax's `adamw` emits u = −lr_t·(m̂/(√v̂ + ε) + wd·p), and torch's AdamW with group lr
  s·lr_t does p ← p·(1 − s·lr_t·wd) − s·lr_t·m̂/(√v̂ + ε) = p + s·u. The moments m, v do not depend
  on the learning rate and the step is linear in it, the decoupled decay term included, so scaling
  the final update by s is exactly scaling the group's learning rate by s.
* SOAP (`optim/soap.py`). The reference steps p ← p − lr·dir, then p ← p − lr·wd·p on the updated
  p; the emitted update is u = −lr·dir − lr·wd·(p − lr·dir). Its moments and eigenbases don't
  depend on lr either, so s·u is the reference with group lr s·lr except for the cross term
  lr²·wd·dir, which gets s instead of s²: a difference of (1 − s)·lr·wd relative to the step
  (≈ 1e-5 at lr 1e-3, wd 0.05), negligible. Exactness would need the per-group lr inside the
  decay transform itself.
* SGD with momentum (`_sgd`): weight decay enters the gradient before momentum and the lr scales
  the momentum buffer's output, so s·u is again exactly the group-lr step.

Scales are Python floats computed from the tree's key paths only (no state, nothing traced).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax

from skipless_jax import sharding
from skipless_jax.models.common import SCANNED_BLOCKS

EMBEDDING_NAMES = ("cls", "pos_embedding", "embedding")  # layer 0 (MAE: cls_token, pos_embed, patch_embed)

_BLOCK = re.compile(r"block_(\d+)")


def vit_layer_id(path: str, num_layers: int) -> int:
    """MAE's `get_layer_id_for_vit` on a '/'-joined parameter path (a leading 'params/' is ignored)."""
    parts = path.strip("/").split("/")
    if parts and parts[0] == "params":
        parts = parts[1:]
    first = parts[0] if parts else ""
    if first in EMBEDDING_NAMES:
        return 0
    match = _BLOCK.fullmatch(first)
    if match:
        return int(match.group(1)) + 1
    return num_layers + 1


def layer_scales(params: Any, decay: float, num_layers: int) -> Any:
    """Pytree like `params` of floats decay ** (num_layers + 1 − vit_layer_id(path)); a scanned
    encoder's stacked leaves (models/vit.py) get the vector of their layers' scales, broadcast
    along the leading layer axis."""

    def scale(path: tuple[Any, ...], x: Any) -> Any:
        name = sharding.path_str(path)
        if SCANNED_BLOCKS in name.split("/"):
            ids = np.arange(1, x.shape[0] + 1)  # layer l of the stack is block_l: id l + 1
            return (float(decay) ** (num_layers + 1 - ids)).reshape((-1,) + (1,) * (x.ndim - 1)).astype(np.float32)
        return float(decay) ** (num_layers + 1 - vit_layer_id(name, num_layers))

    return jax.tree_util.tree_map_with_path(scale, params)


def scale_by_layer(scales: Any | Callable[[Any], Any]) -> optax.GradientTransformation:
    """u ← scale · u per leaf; `scales`: a pytree of floats like the parameters, or tree -> such a pytree.

    Stateless. Chain it after the optimizer (see the module docstring): it then acts as a per-group
    learning-rate multiplier.
    """

    def init_fn(params: optax.Params) -> optax.EmptyState:
        del params
        return optax.EmptyState()

    def update_fn(
        updates: optax.Updates, state: optax.EmptyState, params: optax.Params | None = None
    ) -> tuple[optax.Updates, optax.EmptyState]:
        del params
        tree = scales(updates) if callable(scales) else scales
        scaled = jax.tree.map(lambda u, s: (u * s).astype(u.dtype), updates, tree)
        return scaled, state

    return optax.GradientTransformation(init_fn, update_fn)


def layer_decay(decay: float, num_layers: int) -> optax.GradientTransformation:
    """`scale_by_layer` with the ViT layer-decay scales of whatever tree it is applied to."""
    return scale_by_layer(lambda tree: layer_scales(tree, decay, num_layers))
