"""Where the optimizer is built: learning-rate schedule, weight-decay mask, registry by name.

`build_optimizer(config, total_steps, warmup_steps)` reads `config.optimizer` (name + hyperparameters, and
`layer_decay` for layer-wise lr decay, docs/method/ssl.md §9), `config.schedule` and
`config.grad_clip_norm`; a new optimizer is one entry in `OPTIMIZERS`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from skipless_jax.models import roles
from skipless_jax.optim.shampoo_ec import scale_by_shampoo_ec, shampoo_ec
from skipless_jax.optim.soap import scale_by_soap, soap

__all__ = [
    "OPTIMIZERS", "SCHEDULES", "build_optimizer", "build_schedule", "decay_mask", "scale_by_shampoo_ec",
    "scale_by_soap", "shampoo_ec", "soap", "triangular", "warmup_cosine",
]


def warmup_cosine(
    peak_lr: float, total_steps: int, warmup_steps: int, end_lr: float = 0.0, init_lr: float = 0.0
) -> optax.Schedule:
    """Linear warm-up init_lr→peak_lr over `warmup_steps`, cosine peak_lr→end_lr until `total_steps`."""
    return optax.warmup_cosine_decay_schedule(
        init_value=init_lr,
        peak_value=peak_lr,
        warmup_steps=warmup_steps,
        decay_steps=max(total_steps, warmup_steps + 1),
        end_value=end_lr,
    )


SCHEDULES = ("warmup_cosine", "triangular")


def triangular(
    peak_lr: float, total_steps: int, peak_at: float = 0.4, fall_at: float = 0.8, fall_to: float = 0.05
) -> optax.Schedule:
    """The ConvMixer CIFAR-10 reference's piecewise-linear lr (docs/method/recipes.md §14): update t
    (0-based) uses lr = interp(t + 1; [0, peak_at·T, fall_at·T, T] → [0, peak, fall_to·peak, 0])."""
    knots = jnp.array([0.0, peak_at * total_steps, fall_at * total_steps, float(total_steps)])
    values = jnp.array([0.0, peak_lr, fall_to * peak_lr, 0.0])
    return lambda count: jnp.interp(count + 1.0, knots, values)


def build_schedule(config: Any, total_steps: int, warmup_steps: int | None = None) -> optax.Schedule:
    """`config.schedule.name`: 'warmup_cosine' (default; `warmup_steps`, default
    `config.schedule.warmup_steps`; end_lr) or 'triangular' (peak_at, fall_at, fall_to); the peak
    is `config.optimizer.lr`."""
    sched = config.schedule
    if sched.get("name", "warmup_cosine") == "triangular":
        return triangular(config.optimizer.lr, total_steps, sched.get("peak_at", 0.4), sched.get("fall_at", 0.8),
                          sched.get("fall_to", 0.05))
    return warmup_cosine(
        config.optimizer.lr,
        total_steps,
        sched.warmup_steps if warmup_steps is None else warmup_steps,
        sched.get("end_lr", 0.0),
    )


# No weight decay on the roles (models/roles.py): the position table and class token (DeiT / timm
# `no_weight_decay`), Swin's relative-position bias tables (Swin `no_weight_decay_keywords`:
# relative_position_bias_table).
NO_DECAY = (roles.POSITION_TABLE, roles.CLASS_TOKEN, roles.RELATIVE_POSITION_TABLE, roles.GAIN)
# MAE's pre-training decays its (1, 1, d) class and mask tokens (stored (1, 1, d) and (d,) here).
MAE_DECAYED_TOKENS = (roles.CLASS_TOKEN, roles.MASK_TOKEN)
DECAY_RULES = ("deit", "mae_pretrain", "all", "ndim")


def decay_mask(params: Any, rule: str = "deit") -> Any:
    """Which leaves are weight-decayed (docs/method/recipes.md §14). 'deit' (timm's no_weight_decay list,
    MAE fine-tuning alike): kernels (≥ 2 dims per layer); biases, norms, the position table and
    class token are not. 'mae_pretrain' (MAE's main_pretrain: timm add_weight_decay without a
    skip list): the kernels and the class and mask tokens. 'all' (torch AdamW over
    `model.parameters()`, the ConvMixer CIFAR-10 reference): every leaf. 'ndim' (nanoGPT's
    `configure_optimizers`, docs/method/lm.md §4): every leaf of ≥ 2 dims per layer, tables
    included. Leaves are told apart by
    their role (`models.find_role`: the names of every model here); a leaf without one (a name
    no model spells) is decayed by its rank alone."""
    from skipless_jax import models, sharding
    from skipless_jax.models.common import layer_ndim

    if rule not in DECAY_RULES:
        raise ValueError(f"config.optimizer.weight_decay_rule={rule!r} is unknown; allowed: {list(DECAY_RULES)}")

    def leaf(path: tuple[Any, ...], p: Any) -> bool:
        if rule == "all":
            return True
        name = sharding.path_str(path)
        if rule == "ndim":
            return layer_ndim(name, p) >= 2
        role = models.find_role(name)
        if rule == "mae_pretrain" and role in MAE_DECAYED_TOKENS:
            return True
        return layer_ndim(name, p) >= 2 and role not in NO_DECAY

    return jax.tree_util.tree_map_with_path(leaf, params)


def _decay_mask(opt: Any) -> Callable[[Any], Any]:
    rule = opt.get("weight_decay_rule", "deit")
    if rule not in DECAY_RULES:  # here, before anything is traced
        raise ValueError(f"config.optimizer.weight_decay_rule={rule!r} is unknown; allowed: {list(DECAY_RULES)}")
    return functools.partial(decay_mask, rule=rule)


def stacked_mask(params: Any) -> Any:
    """True for the leaves of a scanned encoder (their leading axis stacks the layers)."""
    from skipless_jax import sharding
    from skipless_jax.models.common import SCANNED_BLOCKS

    return jax.tree_util.tree_map_with_path(
        lambda path, _: SCANNED_BLOCKS in sharding.path_str(path).split("/"), params)


def _adamw(opt: Any, lr: optax.Schedule) -> optax.GradientTransformation:
    return optax.adamw(
        lr,
        b1=opt.get("b1", 0.9),
        b2=opt.get("b2", 0.999),
        eps=opt.get("eps", 1e-8),
        weight_decay=opt.get("weight_decay", 0.0),
        mask=_decay_mask(opt),
    )


def _sgd(opt: Any, lr: optax.Schedule) -> optax.GradientTransformation:
    return optax.chain(
        optax.add_decayed_weights(opt.get("weight_decay", 0.0), mask=_decay_mask(opt)),
        optax.sgd(lr, momentum=opt.get("momentum", 0.9)),
    )


def _soap(opt: Any, lr: optax.Schedule) -> optax.GradientTransformation:
    return soap(
        lr,
        b1=opt.get("b1", 0.95),
        b2=opt.get("b2", 0.95),
        shampoo_beta=opt.get("shampoo_beta"),
        eps=opt.get("eps", 1e-8),
        weight_decay=opt.get("weight_decay", 0.01),
        precondition_frequency=opt.get("precondition_frequency", 10),
        max_precond_dim=opt.get("max_precond_dim", 10000),
        merge_dims=opt.get("merge_dims", False),
        precondition_1d=opt.get("precondition_1d", False),
        weight_decay_mask=_decay_mask(opt),
        stacked=stacked_mask,  # a scanned encoder: each layer its own factors (no L×L factor)
    )


def _shampoo_ec(opt: Any, lr: optax.Schedule) -> optax.GradientTransformation:
    """Eigenvalue-corrected Shampoo (docs/method/shampoo_ec.md); defaults: the authors' MAE fork's call."""
    return shampoo_ec(
        lr,
        b1=opt.get("b1", 0.9),
        b2=opt.get("b2", 0.95),
        eps=opt.get("eps", 1e-8),
        weight_decay=opt.get("weight_decay", 0.0),
        precondition_frequency=opt.get("precondition_frequency", 100),
        max_preconditioner_dim=opt.get("max_preconditioner_dim", 8192),
        start_preconditioning_step=opt.get("start_preconditioning_step", -1),
        weight_decay_mask=_decay_mask(opt),
        stacked=stacked_mask,  # a scanned encoder: each layer its own factors
    )


# Muon's hidden matrices (docs/method/skipless_lm.md §6); every other role takes AdamW (the token
# and position tables, the head, norms, biases, gains, the patch embedding).
MUON_ROLES = frozenset({roles.ATTENTION_QKV, roles.ATTENTION_OUT, roles.MLP_OUT, roles.KERNEL})


def muon_labels(params: Any) -> Any:
    """'muon' for a leaf whose role is in MUON_ROLES and that is a matrix per layer, else 'adam'."""
    from skipless_jax import models, sharding
    from skipless_jax.models.common import layer_ndim

    def leaf(path: tuple[Any, ...], p: Any) -> str:
        name = sharding.path_str(path)
        return "muon" if models.find_role(name) in MUON_ROLES and layer_ndim(name, p) == 2 else "adam"

    return jax.tree_util.tree_map_with_path(leaf, params)


def _muon_dimensions(params: Any) -> Any:
    """Each Muon leaf's (in, out) axes: the last two (a scanned encoder's layer axis is a batch axis)."""
    return jax.tree.map(lambda p: optax.contrib.MuonDimensionNumbers(p.ndim - 2, p.ndim - 1), params)


def _muon(opt: Any, lr: optax.Schedule) -> optax.GradientTransformation:
    """optax.contrib.muon on the hidden matrices, AdamW (`_adamw`, lr × adam_lr_ratio) on the rest;
    weight decay on the leaves `decay_mask` decays (docs/method/skipless_lm.md §6)."""
    ratio = opt.get("adam_lr_ratio", 1.0)
    hidden = optax.contrib.muon(
        lr, ns_steps=opt.get("ns_steps", 5), beta=opt.get("momentum", 0.95), weight_decay=opt.get("weight_decay", 0.0),
        weight_decay_mask=_decay_mask(opt), nesterov=opt.get("nesterov", True),
        muon_weight_dimension_numbers=_muon_dimensions)
    return optax.partition({"muon": hidden, "adam": _adamw(opt, lambda count: ratio * lr(count))}, muon_labels)


OPTIMIZERS: dict[str, Callable[[Any, optax.Schedule], optax.GradientTransformation]] = {
    "adamw": _adamw,
    "muon": _muon,
    "sgd": _sgd,
    "soap": _soap,
    "shampoo_ec": _shampoo_ec,
}


def build_optimizer(
    config: Any, total_steps: int, warmup_steps: int | None = None
) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """(gradient transformation incl. clipping and accumulation, lr schedule) from the config;
    `warmup_steps` as the trainer counts them (default `config.schedule.warmup_steps`)."""
    name = config.optimizer.name
    if name not in OPTIMIZERS:
        raise ValueError(f"config.optimizer.name={name!r} is unknown; allowed: {sorted(OPTIMIZERS)}")
    schedule = build_schedule(config, total_steps, warmup_steps)
    tx = OPTIMIZERS[name](config.optimizer, schedule)
    decay = config.optimizer.get("layer_decay")
    if decay is not None and decay != 1.0:  # per-group lr multipliers on the final update
        from skipless_jax import models
        from skipless_jax.optim.layer_decay import layer_decay

        model = models.describe(config.model)
        tx = optax.chain(tx, layer_decay(decay, model.num_layers, model.layer_id))
    if config.get("grad_clip_norm"):
        tx = optax.chain(optax.clip_by_global_norm(config.grad_clip_norm), tx)
    return tx, schedule
