"""One check of the whole config before anything compiles.

Every error is one line that names the field, the bad value and what is allowed.
"""

from __future__ import annotations

import math
from typing import Any

import jax
from absl import logging

from skipless_jax import sharding
from skipless_jax.checks import is_finite, is_int, is_number, require
from skipless_jax.data import sources


def _get(config: Any, field: str) -> Any:
    holder = config
    *parents, name = field.split(".")
    for parent in parents:
        holder = holder[parent]
    return holder.get(name)


def _positive(config: Any, field: str, allow_zero: bool = False, allow_none: bool = False) -> None:
    value = _get(config, field)
    if value is None and allow_none:
        return
    if is_number(value) and not math.isfinite(value):
        raise ValueError(f"config.{field}={value!r} must be a finite number {'>= 0' if allow_zero else '> 0'}")
    ok = is_number(value) and (value >= 0 if allow_zero else value > 0)
    require(ok, f"config.{field}={value!r} must be a {'non-negative' if allow_zero else 'positive'} number")


def _finite(config: Any, field: str, minimum: str = "> 0", allow_none: bool = False, none_means: str = "") -> None:
    """A float field: finite and `> 0` or `>= 0` (None allowed when `allow_none`)."""
    value = _get(config, field)
    if value is None and allow_none:
        return
    ok = is_finite(value) and (value > 0 if minimum == "> 0" else value >= 0)
    require(ok,
             f"config.{field}={value!r} must be a finite number {minimum}" + (f" ({none_means})" if none_means else ""))


def _count(config: Any, field: str, allow_zero: bool = False, allow_none: bool = False, zero_means: str = "") -> None:
    """An integer field (steps, sizes, counts): > 0, or >= 0 when `allow_zero`."""
    value = _get(config, field)
    if value is None and allow_none:
        return
    ok = is_int(value) and (value >= 0 if allow_zero else value > 0)
    what = "non-negative" if allow_zero else "positive"
    require(ok, f"config.{field}={value!r} must be a {what} integer" + (f" ({zero_means})" if zero_means else ""))


def _nonfinite_numbers(tree: Any, prefix: str) -> None:
    """Every number anywhere under `tree` (a ConfigDict or dict) is finite."""
    items = tree.items() if hasattr(tree, "items") else []
    for key, value in items:
        if hasattr(value, "items"):
            _nonfinite_numbers(value, f"{prefix}.{key}")
        elif isinstance(value, (tuple, list)):
            for i, v in enumerate(value):
                require(not is_number(v) or math.isfinite(v), f"{prefix}.{key}[{i}]={v!r} must be a finite number")
        else:
            require(not is_number(value) or math.isfinite(value), f"{prefix}.{key}={value!r} must be a finite number")


def _steps_field(config: Any, name: str) -> str:
    """The field that sets the `name` ('total' or 'warmup') steps, as `config.x=value`."""
    holder, prefix = (config.schedule, "config.schedule.") if name == "warmup" else (config, "config.")
    field = f"{name}_steps" if holder.get(f"{name}_steps") is not None else f"{name}_epochs"
    return f"{prefix}{field}={holder.get(field)!r}"


def _check_schedule_name(sched: Any) -> None:
    from skipless_jax.optim import SCHEDULES

    name = sched.get("name", "warmup_cosine")
    require(name in SCHEDULES, f"config.schedule.name={name!r} is unknown; allowed: {', '.join(SCHEDULES)}")
    if name != "triangular":
        return
    for field in ("warmup_steps", "warmup_epochs", "end_lr"):
        require(not sched.get(field), f"config.schedule.{field}={sched.get(field)!r}: the triangular schedule rises "
                 "from 0 and ends at 0 by itself; allowed: 0 or None")
    a, b, f = sched.get("peak_at", 0.4), sched.get("fall_at", 0.8), sched.get("fall_to", 0.05)
    require(all(is_finite(v) for v in (a, b, f)) and 0 < a < b < 1 and f >= 0,
             f"config.schedule peak_at={a!r}, fall_at={b!r}, fall_to={f!r}: need 0 < peak_at < fall_at < 1 and "
             "fall_to >= 0")


def _check_warmup(config: Any) -> None:
    """The warm-up is not longer than the run, counted in steps as the trainer counts them."""
    uses_epochs = config.get("total_steps") is None or config.schedule.get("warmup_steps") is None
    spe = 1.0
    if uses_epochs:
        from skipless_jax.data import inputs  # repeated augmentation, drop_last (docs/method/recipes.md §21)

        try:  # the split size; reading the data is checked (one line) after the config
            num_train = inputs.num_train_examples(config)
        except Exception:
            return
        from skipless_jax import trainers

        # as the trainer counts (its record's epoch_steps: DINO's whole batches, else the stream's)
        spe = inputs.steps_per_epoch(config, num_train, **trainers.of_config(config).epoch_steps)
    from skipless_jax.trainers.common import steps_of  # the trainers' own count

    total, warmup = steps_of(config, "total", spe), steps_of(config, "warmup", spe)
    require(
        warmup <= total,
        f"{_steps_field(config, 'warmup')} is a warm-up of {warmup} steps, longer than the run's {total} steps "
        f"({_steps_field(config, 'total')}); allowed: at most {total} steps"
        + ("" if config.schedule.get("warmup_steps") is not None else
           f", e.g. add --config.schedule.warmup_epochs={_shorter_warmup(config, total / spe)}"),
    )
    if warmup == total > 0:  # allowed, but the learning rate never reaches its peak nor decays
        _warn_once(f"{_steps_field(config, 'warmup')} is a warm-up of {warmup} steps, the whole run "
                   f"({_steps_field(config, 'total')}): the learning rate never reaches its peak"
                   + ("" if config.schedule.get("warmup_steps") is not None else
                      f"; e.g. add --config.schedule.warmup_epochs={_shorter_warmup(config, total / spe)}") + ".")


_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    """A warning logged once per process: a run checks its config twice (main, then the trainer)."""
    if message not in _WARNED:
        _WARNED.add(message)
        logging.warning(message)


def _shorter_warmup(config: Any, run_epochs: float) -> str:
    """A warm-up of an eighth of the run, in the type the config's field holds (an int field: at
    least 1 epoch, at most the run's whole epochs)."""
    epochs = config.get("total_epochs") or run_epochs
    if isinstance(config.schedule.get("warmup_epochs"), int):
        return f"{min(max(1, int(epochs // 8)), max(int(epochs), 0))} (whole epochs; about an eighth of the run)"
    return f"{epochs / 8:.3g} (an eighth of the run)"


def model_image_checks(model: Any, image_size: int) -> None:
    """The model family's own checks (models registry): sizes, heads, patch vs image, dtype, TG, init."""
    from skipless_jax import models

    models.check_config(model, image_size)


def validate_config(config: Any, num_devices: int | None = None) -> None:
    """Raises ValueError (one line) for the first bad field of a training config."""
    num_devices = num_devices or jax.device_count()
    from skipless_jax import trainers

    trainer = trainers.of_config(config)  # one-line ValueError for an unknown name
    require(isinstance(config.get("seed"), int), f"config.seed={config.get('seed')!r} must be an integer")

    # Data.
    name = config.dataset.get("name")
    info = sources.dataset_info(name)
    for field in ("train_split", "eval_split"):
        split = config.dataset.get(field)
        require(isinstance(split, str) and split, f"config.dataset.{field}={split!r} must name a split")
    size = config.input.get("image_size")
    require(
        size is None or (is_int(size) and size > 0),
        f"config.input.image_size={size!r} must be a positive integer (None: the dataset's own, {info.image_shape[0]})",
    )
    image_size = size or info.image_shape[0]
    _count(config, "input.batch_size")
    _count(config, "input.eval_batch_size", allow_none=True)
    _count(config, "input.num_workers", allow_zero=True, allow_none=True, zero_means="reads in the training process")
    _count(config, "input.device_prefetch", allow_zero=True, allow_none=True, zero_means="no batch ahead")
    cache_eval = config.input.get("cache_eval")
    require(cache_eval is None or isinstance(cache_eval, bool),
             f"config.input.cache_eval={cache_eval!r} must be True or False (keep the eval batches in host memory)")

    # Mesh: sizes vs devices, batch vs data-parallel shards, processes.
    names, sizes = sharding.mesh_shape(config.mesh, num_devices)
    shards = 1
    for n, s in zip(names, sizes):
        shards *= s if n in sharding.DATA_AXES else 1
    for field in ("batch_size", "eval_batch_size"):
        batch = config.input.get(field)
        if batch:
            require(batch % shards == 0,
                     f"config.input.{field}={batch} is not divisible by the {shards} data-parallel devices "
                     f"of the mesh {dict(zip(names, sizes))}")
            require(batch % jax.process_count() == 0,
                     f"config.input.{field}={batch} is not divisible by the {jax.process_count()} processes")
    sharding.validate_rules(config.get("sharding_rules", []))
    if config.get("analysis") is not None:  # live log-κ monitoring on a probe batch
        _positive(config, "analysis.every_steps", allow_zero=True, allow_none=True)
        every = config.analysis.get("every_steps")
        require(every is None or (isinstance(every, int) and not isinstance(every, bool)),
                 f"config.analysis.every_steps={every!r} must be an integer (0: off)")
        if every:
            probe = config.analysis.get("probe_size", 32)
            split_size = info.splits.get(config.dataset.eval_split)  # None: not known before reading
            require(
                isinstance(probe, int) and not isinstance(probe, bool) and probe > 0
                and probe % shards == 0 and probe % jax.process_count() == 0
                and (split_size is None or probe <= split_size),
                f"config.analysis.probe_size={probe!r} must be a positive integer divisible by the {shards} "
                f"data-parallel devices and by the {jax.process_count()} processes"
                + (f", at most the {split_size} examples of the eval split" if split_size else ""),
            )
    accum = config.get("grad_accum_steps") or 1
    require(
        isinstance(accum, int) and accum > 0 and config.input.batch_size % (accum * shards) == 0,
        f"config.grad_accum_steps={accum!r} must be a positive integer dividing config.input.batch_size"
        f"={config.input.batch_size} into micro-batches divisible by the {shards} data-parallel devices",
    )

    aug = config.input.get("aug")
    if aug is not None and (aug.get("mixup") or aug.get("cutmix")):  # data/device_mix.py: pairs within a device
        rows = config.input.batch_size // shards
        require(rows >= 2 and rows % 2 == 0,
                 f"config.input.aug mixup/cutmix pair each device's rows with their reverse, and "
                 f"config.input.batch_size={config.input.batch_size} gives {rows} rows on each of the {shards} "
                 f"data-parallel devices (an odd count mixes the middle row with itself, 1 row not at all); "
                 f"allowed batch sizes: multiples of {2 * shards} ({2 * shards}, {4 * shards}, {6 * shards}, ...)")

    # Model.
    model_image_checks(config.model, image_size)
    require(config.model.get("init_self_share") is None or trainer.classifier,
             f"config.model.init_self_share is applied by the supervised trainer only; config.trainer={trainer.name!r} "
             "(set init_beta instead)")
    aug = config.input.get("aug")
    if aug is not None:
        from skipless_jax.data import augment

        augment.validate_aug_config(aug)
    validate_training(config)


def validate_training(config: Any) -> None:
    """The fields every trainer reads alike: optimizer, schedule, steps, clipping, label smoothing,
    logging, evaluation and checkpoint periods (one-line ValueError for the first bad one)."""
    # Optimizer and schedule.
    from skipless_jax.optim import OPTIMIZERS

    opt = config.optimizer
    require(opt.get("name") in OPTIMIZERS,
             f"config.optimizer.name={opt.get('name')!r} is unknown; allowed: {sorted(OPTIMIZERS)}")
    _finite(config, "optimizer.lr")
    _finite(config, "optimizer.weight_decay", ">= 0", allow_none=True)
    for field in ("b1", "b2"):
        value = opt.get(field)
        require(value is None or (is_finite(value) and 0.0 <= value < 1.0),
                 f"config.optimizer.{field}={value!r} must be in [0, 1)")
    decay = opt.get("layer_decay")
    require(decay is None or (is_finite(decay) and 0.0 < decay <= 1.0),
             f"config.optimizer.layer_decay={decay!r} must be in (0, 1] (None or 1: off)")
    require(config.get("schedule") is not None, "config.schedule must be set (warmup_steps or warmup_epochs, end_lr)")
    _finite(config, "schedule.end_lr", ">= 0", allow_none=True)
    _nonfinite_numbers(opt, "config.optimizer")
    if opt.name == "soap":
        from skipless_jax.optim.soap import validate_soap_hparams

        try:
            validate_soap_hparams(
                opt.get("b1", 0.95), opt.get("b2", 0.95), opt.get("shampoo_beta"), opt.get("eps", 1e-8),
                opt.get("weight_decay", 0.01), opt.get("precondition_frequency", 10), opt.get("max_precond_dim", 10000),
            )
        except ValueError as err:
            raise ValueError(f"config.optimizer: {err}") from None
    if opt.name == "shampoo_ec":
        from skipless_jax.optim.shampoo_ec import validate_shampoo_ec_hparams

        try:
            validate_shampoo_ec_hparams(
                opt.get("b1", 0.9), opt.get("b2", 0.95), opt.get("eps", 1e-8), opt.get("weight_decay", 0.0),
                opt.get("precondition_frequency", 100), opt.get("max_preconditioner_dim", 8192),
                opt.get("start_preconditioning_step", -1),
            )
        except ValueError as err:
            raise ValueError(f"config.optimizer: {err}") from None
    require(
        config.get("total_steps") is not None or config.get("total_epochs") is not None,
        "config.total_steps or config.total_epochs must be set",
    )
    _count(config, "total_steps", allow_none=True)
    _finite(config, "total_epochs", allow_none=True)
    _count(config, "schedule.warmup_steps", allow_zero=True, allow_none=True)
    _finite(config, "schedule.warmup_epochs", ">= 0", allow_none=True)
    _nonfinite_numbers(config.schedule, "config.schedule")
    _check_schedule_name(config.schedule)
    _check_warmup(config)
    _finite(config, "grad_clip_norm", allow_none=True, none_means="None: no clipping")
    smoothing = config.get("label_smoothing", 0.0)
    require(is_finite(smoothing) and 0.0 <= smoothing < 1.0,
             f"config.label_smoothing={smoothing!r} must be in [0, 1)")
    _count(config, "log_every_steps")
    from skipless_jax.trainers import wandb_writer  # the optional extra: missing it is a config error

    wandb_writer.check_config(config)
    for field in ("eval_every_steps", "checkpoint_every_steps"):
        _count(config, field, allow_zero=True, allow_none=True, zero_means="0 or None: only at the end")
    keep = config.get("keep_checkpoints", 3)
    require(
        is_int(keep) and keep > 0,
        f"config.keep_checkpoints={keep!r} must be a positive integer "
        "(the newest checkpoints kept; 0 would end a run with none)",
    )
