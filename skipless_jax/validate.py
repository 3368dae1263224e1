"""One check of the whole config before anything compiles.

Every error is one line that names the field, the bad value and what is allowed.
"""

from __future__ import annotations

from typing import Any, Optional

import jax

from skipless_jax import sharding, token_graying
from skipless_jax.data import sources
from skipless_jax.models import init as init_lib
from skipless_jax.models import vit

TRAINERS = ("supervised", "dino")
DTYPES = ("float32", "bfloat16", "float16")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _positive(config: Any, field: str, allow_zero: bool = False, allow_none: bool = False) -> None:
    holder = config
    *parents, name = field.split(".")
    for parent in parents:
        holder = holder[parent]
    value = holder.get(name)
    if value is None and allow_none:
        return
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and (value >= 0 if allow_zero else value > 0)
    _require(ok, f"config.{field}={value!r} must be a {'non-negative' if allow_zero else 'positive'} number")


def model_image_checks(model: Any, image_size: int, patch_size: Optional[int] = None) -> None:
    """Variant, sizes, heads, patch vs image size, pooling, position embedding, dtype, TG, init."""
    sizes = dict(model.to_dict()) if hasattr(model, "to_dict") else dict(model)
    if sizes.get("variant"):
        sizes.update({k: v for k, v in vit.decode_variant(sizes["variant"]).items() if k != "patch_size" or not model.get("patch_size")})
    for field in ("width", "depth", "num_heads", "mlp_dim", "patch_size"):
        value = sizes.get(field)
        _require(isinstance(value, int) and value > 0, f"config.model.{field}={value!r} must be a positive integer")
    p = patch_size or sizes["patch_size"]
    _require(image_size % p == 0, f"config.model.patch_size={p} does not divide the image size {image_size}; allowed: divisors of {image_size}")
    _require(sizes["width"] % sizes["num_heads"] == 0, f"config.model.num_heads={sizes['num_heads']} does not divide config.model.width={sizes['width']}")
    _require(model.get("pool", "tok") in vit.POOLS, f"config.model.pool={model.get('pool')!r} is unknown; allowed: {list(vit.POOLS)}")
    _require(model.get("posemb", "learn") in vit.POSEMBS, f"config.model.posemb={model.get('posemb')!r} is unknown; allowed: {list(vit.POSEMBS)}")
    _require(str(model.get("dtype", "float32")) in DTYPES, f"config.model.dtype={model.get('dtype')!r} is unknown; allowed: {list(DTYPES)}")
    for field in ("dropout", "drop_path"):
        value = model.get(field, 0.0)
        _require(0.0 <= value < 1.0, f"config.model.{field}={value!r} must be in [0, 1)")
    init_lib.validate_init_config(model)
    if model.get("token_graying") is not None:
        token_graying.validate_token_graying(model.token_graying, model.get("tg_eps", 0.95))


def validate_config(config: Any, num_devices: Optional[int] = None) -> None:
    """Raises ValueError (one line) for the first bad field of a training config."""
    num_devices = num_devices or jax.device_count()
    trainer = config.get("trainer", "supervised")
    _require(trainer in TRAINERS, f"config.trainer={trainer!r} is unknown; allowed: {list(TRAINERS)}")
    _require(isinstance(config.get("seed"), int), f"config.seed={config.get('seed')!r} must be an integer")

    # Data.
    name = config.dataset.get("name")
    info = sources.dataset_info(name)
    for field in ("train_split", "eval_split"):
        _require(isinstance(config.dataset.get(field), str) and config.dataset.get(field), f"config.dataset.{field}={config.dataset.get(field)!r} must name a split")
    image_size = config.input.get("image_size") or info.image_shape[0]
    _positive(config, "input.batch_size")
    _positive(config, "input.eval_batch_size", allow_none=True)

    # Mesh: sizes vs devices, batch vs data-parallel shards, processes.
    names, sizes = sharding.mesh_shape(config.mesh, num_devices)
    shards = 1
    for n, s in zip(names, sizes):
        shards *= s if n in sharding.DATA_AXES else 1
    for field in ("batch_size", "eval_batch_size"):
        batch = config.input.get(field)
        if batch:
            _require(batch % shards == 0, f"config.input.{field}={batch} is not divisible by the {shards} data-parallel devices of config.mesh={list(config.mesh)}")
            _require(batch % jax.process_count() == 0, f"config.input.{field}={batch} is not divisible by the {jax.process_count()} processes")
    sharding.validate_rules(config.get("sharding_rules", []))
    if config.get("analysis") is not None:  # live log-κ monitoring on a probe batch
        _positive(config, "analysis.every_steps", allow_zero=True, allow_none=True)
        every = config.analysis.get("every_steps")
        _require(every is None or (isinstance(every, int) and not isinstance(every, bool)), f"config.analysis.every_steps={every!r} must be an integer (0: off)")
        if every:
            probe = config.analysis.get("probe_size", 32)
            split_size = info.splits.get(config.dataset.eval_split)  # None: not known before reading
            _require(
                isinstance(probe, int) and not isinstance(probe, bool) and probe > 0
                and probe % shards == 0 and probe % jax.process_count() == 0 and (split_size is None or probe <= split_size),
                f"config.analysis.probe_size={probe!r} must be a positive integer divisible by the {shards} data-parallel "
                f"devices and by the {jax.process_count()} processes"
                + (f", at most the {split_size} examples of the eval split" if split_size else ""),
            )
    accum = config.get("grad_accum_steps") or 1
    _require(
        isinstance(accum, int) and accum > 0 and config.input.batch_size % (accum * shards) == 0,
        f"config.grad_accum_steps={accum!r} must be a positive integer dividing config.input.batch_size"
        f"={config.input.batch_size} into micro-batches divisible by the {shards} data-parallel devices",
    )

    # Model.
    model_image_checks(config.model, image_size)

    # Optimizer and schedule.
    from skipless_jax.optim import OPTIMIZERS

    opt = config.optimizer
    _require(opt.get("name") in OPTIMIZERS, f"config.optimizer.name={opt.get('name')!r} is unknown; allowed: {sorted(OPTIMIZERS)}")
    _positive(config, "optimizer.lr")
    if opt.name == "soap":
        from skipless_jax.optim.soap import validate_soap_hparams

        try:
            validate_soap_hparams(
                opt.get("b1", 0.95), opt.get("b2", 0.95), opt.get("shampoo_beta"), opt.get("eps", 1e-8),
                opt.get("weight_decay", 0.01), opt.get("precondition_frequency", 10), opt.get("max_precond_dim", 10000),
            )
        except ValueError as err:
            raise ValueError(f"config.optimizer: {err}") from None
    _positive(config, "optimizer.weight_decay", allow_zero=True, allow_none=True)
    for field in ("b1", "b2"):
        value = opt.get(field)
        _require(value is None or 0.0 <= value < 1.0, f"config.optimizer.{field}={value!r} must be in [0, 1)")
    _require(
        config.get("total_steps") is not None or config.get("total_epochs") is not None,
        "config.total_steps or config.total_epochs must be set",
    )
    _positive(config, "total_steps", allow_none=True)
    _positive(config, "total_epochs", allow_none=True)
    _positive(config, "schedule.warmup_steps", allow_zero=True, allow_none=True)
    _positive(config, "schedule.warmup_epochs", allow_zero=True, allow_none=True)
    _positive(config, "grad_clip_norm", allow_none=True)
    smoothing = config.get("label_smoothing", 0.0)
    _require(0.0 <= smoothing < 1.0, f"config.label_smoothing={smoothing!r} must be in [0, 1)")
    for field in ("log_every_steps",):
        _positive(config, field)
    for field in ("eval_every_steps", "checkpoint_every_steps"):
        _positive(config, field, allow_zero=True, allow_none=True)
    aug = config.input.get("aug")
    if aug is not None:
        from skipless_jax.data import augment

        augment.validate_aug_config(aug)
