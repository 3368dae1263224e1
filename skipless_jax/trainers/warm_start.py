"""Starting a run from another run's parameters (`config.init_from`): the loader every trainer
hands to `pretrained.restore_or_init`, and the classifier's renames of a source's names."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections

from skipless_jax import checkpoint, models, pretrained
from skipless_jax.data import sources
from skipless_jax.models import roles
from skipless_jax.trainers import common, model_ema


def loader(
    config: ml_collections.ConfigDict,
    tx: Any,
    shardings: Any,
    rename: Callable[[str], Any] | None = None,
) -> Callable[[Any], Any]:
    """`pretrained.restore_or_init`'s `load_init_from` for every trainer: the parameters of
    `config.init_from` under `config.init_from_key` (default 'params'; `rename(key)` gives the
    trainer's renames, if any), a fresh optimizer state for them, and each entry of the state that
    starts from the model: the source's running statistics where both keep them, the model EMA,
    DINO's teacher (= the student)."""

    def load(state: Any) -> Any:  # a new state; `state` is not changed
        key = config.get("init_from_key") or "params"
        names = None if rename is None else rename(key)
        params = pretrained.init_from(config.init_from, state.params, shardings.params, key, names)
        state = state.replace(params=params,
                              opt_state=jax.jit(tx.init, out_shardings=shardings.opt_state)(params))
        if common.present(state, "batch_stats") and "batch_stats" in checkpoint.state_entries(config.init_from):
            # running statistics: the source's (a converted timm ConvMixer, another run), else fresh
            state = state.replace(batch_stats=pretrained.init_from(
                config.init_from, state.batch_stats, shardings.batch_stats, "batch_stats"))
        if common.present(state, "ema"):  # the EMA starts from the loaded model
            state = state.replace(ema=jax.jit(model_ema.init, out_shardings=shardings.ema)(state))
        if common.present(state, "teacher"):  # DINO: teacher = student at the start
            state = state.replace(teacher=jax.tree.map(jnp.copy, state.params))
        return state

    return load


HEAD_ROLES = (roles.HEAD_KERNEL, roles.HEAD_BIAS)  # a classifier's own: never read from another run


def classifier_rename(key: str, source_config: dict[str, Any] | None = None) -> Any:
    """Target parameter path -> its source in the checkpoint's `state[key]` (see `pretrained.init_from`).

    'params' of a classifier run: the same names. 'teacher' (a DINO run): the backbone's
    parameters under 'backbone/'; the classifier head is new. 'params' of an MAE run (the
    source's saved `trainer`): the encoder's parameters by name, the decoder unused, `fc_norm` and
    the head new, the position table the encoder's fixed table at its grid (docs/method/ssl.md §9).
    The head and the position table are found by their roles (models/roles.py)."""
    if key == "teacher":
        return lambda name: None if models.role_of(name) in HEAD_ROLES else f"backbone/{name}"
    if (source_config or {}).get("trainer") == "mae":
        from skipless_jax.models import mae

        source_model = source_config["model"]
        source = models.describe(ml_collections.ConfigDict(source_model))
        image_size = (source_config.get("input") or {}).get("image_size") or sources.dataset_info(
            source_config["dataset"]["name"]).image_shape[0]
        grid = image_size // source.patch_size

        def rename(name: str) -> Any:
            role = models.role_of(name)
            if role in HEAD_ROLES or name.startswith("fc_norm/"):
                return None
            if role == roles.POSITION_TABLE:
                return lambda shape: mae.encoder_position_table(grid, source.width, shape)
            return name

        return rename
    return lambda name: name
