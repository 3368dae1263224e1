"""Layer-wise learning-rate decay for fine-tuning (BEiT / MAE `util/lr_decay.py`), docs/method/ssl.md §9.

    layer id:  the family's `layer_id(path)` (`models.describe(config.model)`), 0 … num_layers + 1;
               the ViT's: 0 for `cls`, `pos_embedding`, `embedding/*`;  i + 1 for `block_i/*`;
               num_layers + 1 for everything else (`encoder_norm`, `fc_norm`, `head`, ...)
    scale:     decay ** (num_layers + 1 − id)          (MAE: num_layers = len(blocks) + 1 there)

`scale_by_layer(scales)` multiplies each leaf's *final* update by its scale; chain it after the
whole optimizer (learning rate and weight decay included):

    d = models.describe(config.model)
    tx = optax.chain(OPTIMIZERS[name](config.optimizer, schedule), layer_decay(0.65, d.num_layers, d.layer_id))

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

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax

from skipless_jax import sharding
from skipless_jax.models.common import SCANNED_BLOCKS


def layer_scales(params: Any, decay: float, num_layers: int, layer_id: Callable[[str], int]) -> Any:
    """Pytree like `params` of floats decay ** (num_layers + 1 − layer_id(path)); a scanned
    encoder's stacked leaves (models/vit.py) get the vector of their layers' scales, broadcast
    along the leading layer axis."""

    def scale(path: tuple[Any, ...], x: Any) -> Any:
        name = sharding.path_str(path)
        if SCANNED_BLOCKS in name.split("/"):
            ids = np.arange(1, x.shape[0] + 1)  # layer l of the stack is block_l: id l + 1
            return (float(decay) ** (num_layers + 1 - ids)).reshape((-1,) + (1,) * (x.ndim - 1)).astype(np.float32)
        return float(decay) ** (num_layers + 1 - layer_id(name))

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


def layer_decay(decay: float, num_layers: int, layer_id: Callable[[str], int]) -> optax.GradientTransformation:
    """`scale_by_layer` with the layer-decay scales of whatever tree it is applied to."""
    return scale_by_layer(lambda tree: layer_scales(tree, decay, num_layers, layer_id))
