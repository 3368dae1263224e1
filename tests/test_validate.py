"""Malformed configs: each raises a one-line error naming the field, before anything compiles."""

import re

import pytest

from skipless_jax import validate
from skipless_jax.data import inputs, multicrop

from util import tiny_config

CASES = [
    ({"model.variant": "Huge/16"}, "config.model.variant"),
    ({"optimizer.name": "lion"}, "config.optimizer.name"),
    ({"dataset.name": "mnist"}, "config.dataset.name"),
    ({"mesh.model": 1}, "config.mesh.model=1 is an unknown mesh axis"),
    ({"model.init": "xavier"}, "init"),
    ({"model.token_graying": "fft"}, "token_graying"),
    ({"mesh.data": 3}, "config.mesh.data=3 × config.mesh.fsdp=1 is 3 devices but 8 are available"),
    ({"mesh.fsdp": 3}, "config.mesh.fsdp=3 does not divide the 8 devices"),
    ({"mesh.fsdp": 0}, "config.mesh.fsdp=0 must be a positive integer, or -1"),
    (
        {"mesh.data": 4, "mesh.fsdp": -1, "input.batch_size": 30},
        "config.input.batch_size=30 is not divisible by the 8 data-parallel devices",
    ),
    ({"input.batch_size": 20}, "config.input.batch_size"),
    ({"input.eval_batch_size": 12}, "config.input.eval_batch_size"),
    ({"optimizer.lr": -1e-3}, "config.optimizer.lr"),
    ({"optimizer.lr": 0.0}, "config.optimizer.lr"),
    ({"total_steps": 0}, "config.total_steps"),
    ({"total_steps": -5}, "config.total_steps"),
    ({"schedule.warmup_steps": -1}, "config.schedule.warmup_steps"),
    ({"model.token_graying": "svd", "model.tg_eps": 0.0}, "eps"),
    ({"model.token_graying": "dct", "model.tg_eps": 1.5}, "eps"),
    ({"model.num_heads": 5}, "config.model.num_heads"),
    ({"model.patch_size": 3}, "config.model.patch_size"),
    ({"model.pool": "max"}, "config.model.pool"),
    ({"model.posemb": "rope"}, "config.model.posemb"),
    ({"model.dtype": "int8"}, "config.model.dtype"),
    ({"model.dropout": 1.0}, "config.model.dropout"),
    ({"model.drop_path": -0.1}, "config.model.drop_path"),
    ({"label_smoothing": 1.0}, "config.label_smoothing"),
    ({"optimizer.b1": 1.0}, "config.optimizer.b1"),
    ({"optimizer.b2": -0.1}, "config.optimizer.b2"),
    ({"optimizer.weight_decay": -0.1}, "config.optimizer.weight_decay"),
    ({"grad_clip_norm": -1.0}, "config.grad_clip_norm"),
    ({"log_every_steps": 0}, "config.log_every_steps"),
    ({"input.batch_size": 0}, "config.input.batch_size"),
    ({"sharding_rules": [("(", "fsdp")]}, "config.sharding_rules"),
    ({"sharding_rules": [(".*", "shard_everything")]}, "config.sharding_rules"),
    ({"trainer": "rl"}, "config.trainer"),
    ({"dataset.eval_split": ""}, "config.dataset.eval_split"),
    ({"model.init": "skipless", "model.init_alpha": 0.0}, "alpha"),
    ({"model.init": "skipless", "model.init_c": -3.0}, "c"),
    ({"model.width": 0}, "config.model.width"),
    ({"checkpoint_every_steps": -1}, "config.checkpoint_every_steps"),
    ({"grad_accum_steps": 3}, "config.grad_accum_steps"),
    ({"optimizer.name": "soap", "optimizer.precondition_frequency": 0}, "precondition_frequency"),
    # Non-finite numbers, which pass comparisons like `x > 0` (inf) or fail them silently (nan).
    ({"optimizer.lr": float("inf")}, "config.optimizer.lr=inf must be a finite number > 0"),
    ({"optimizer.lr": float("nan")}, "config.optimizer.lr=nan must be a finite number > 0"),
    ({"optimizer.weight_decay": float("inf")}, "config.optimizer.weight_decay=inf must be a finite number >= 0"),
    ({"optimizer.eps": float("nan")}, "config.optimizer.eps=nan must be a finite number"),
    ({"optimizer.b2": float("nan")}, "config.optimizer.b2=nan must be in [0, 1)"),
    ({"schedule.end_lr": float("inf")}, "config.schedule.end_lr=inf must be a finite number"),
    ({"schedule.end_lr": -1e-5}, "config.schedule.end_lr=-1e-05 must be a finite number >= 0"),
    ({"total_steps": None, "total_epochs": float("inf")}, "config.total_epochs=inf must be a finite number > 0"),
    (
        {"schedule.warmup_steps": None, "schedule.warmup_epochs": float("nan")},
        "config.schedule.warmup_epochs=nan must be a finite number >= 0",
    ),
    ({"grad_clip_norm": float("inf")}, "config.grad_clip_norm=inf must be a finite number > 0"),
    ({"label_smoothing": float("nan")}, "config.label_smoothing=nan must be in [0, 1)"),
    # A warm-up longer than the run, in steps or epochs (digits: 1437 train images, batch 32).
    (
        {"schedule.warmup_steps": 13},
        "config.schedule.warmup_steps=13 is a warm-up of 13 steps, longer than the run's 12 steps "
        "(config.total_steps=12)",
    ),
    (
        {"schedule.warmup_steps": None, "schedule.warmup_epochs": 1},
        "config.schedule.warmup_epochs=1 is a warm-up of 45 steps, longer than the run's 12 steps",
    ),
    (
        {"total_steps": None, "total_epochs": 1, "schedule.warmup_steps": 46},
        "warm-up of 46 steps, longer than the run's 45 steps (config.total_epochs=1)",
    ),
    # Checkpoints kept, image size.
    ({"keep_checkpoints": 0}, "config.keep_checkpoints=0 must be a positive integer"),
    ({"keep_checkpoints": -1}, "config.keep_checkpoints=-1 must be a positive integer"),
    ({"input.image_size": -8}, "config.input.image_size=-8 must be a positive integer (None: the dataset's own, 8)"),
    ({"input.image_size": 0}, "config.input.image_size=0 must be a positive integer"),
]


@pytest.mark.parametrize("overrides, field", CASES, ids=[",".join(f"{k}={v}" for k, v in o.items()) for o, _ in CASES])
def test_malformed_config_is_one_line_naming_the_field(overrides, field):
    config = tiny_config(**overrides)
    with pytest.raises(ValueError) as err:
        validate.validate_config(config, num_devices=8)
    message = str(err.value)
    assert "\n" not in message, message
    assert field in message, message


# Values of another type than the config file's (a config written with 2.0 where an integer
# belongs): set past ConfigDict's type safety by deleting the field first.
WRONG_TYPE = [
    ({"total_steps": 2.5}, "config.total_steps=2.5 must be a positive integer"),
    ({"log_every_steps": float("inf")}, "config.log_every_steps=inf must be a positive integer"),
    ({"keep_checkpoints": 2.0}, "config.keep_checkpoints=2.0 must be a positive integer"),
    ({"input.image_size": 8.5}, "config.input.image_size=8.5 must be a positive integer"),
]


@pytest.mark.parametrize(
    "overrides, field", WRONG_TYPE, ids=[",".join(f"{k}={v}" for k, v in o.items()) for o, _ in WRONG_TYPE]
)
def test_wrong_type_is_one_line_naming_the_field(overrides, field):
    config = tiny_config()
    for key, value in overrides.items():
        *parents, name = key.split(".")
        holder = config
        for parent in parents:
            holder = holder[parent]
        del holder[name]
        holder[name] = value
    with pytest.raises(ValueError, match=re.escape(field)):
        validate.validate_config(config, num_devices=8)


def test_well_formed_configs_pass():
    validate.validate_config(tiny_config(), num_devices=8)
    validate.validate_config(tiny_config(**{"schedule.warmup_steps": 12, "input.image_size": 8}), num_devices=8)
    validate.validate_config(tiny_config(**{"mesh.fsdp": 8}), num_devices=8)
    validate.validate_config(tiny_config(**{"mesh.data": 2, "mesh.fsdp": 4}), num_devices=8)
    validate.validate_config(tiny_config("skip_sab=False,skip_ffn=False,init=skipless"), num_devices=8)
    validate.validate_config(tiny_config(**{"model.token_graying": "dct", "model.tg_eps": 1.0}), num_devices=8)


def test_steps_per_epoch_as_the_trainers_count():
    config = tiny_config()
    assert inputs.steps_per_epoch(config, 1437) == 1437 / 32  # supervised: epochs may end mid-batch
    assert inputs.steps_per_epoch(config, 1437, **multicrop.EPOCH_STEPS) == 44  # DINO drops the last partial batch
    assert inputs.steps_per_epoch(config, 10, **multicrop.EPOCH_STEPS) == 1
    assert inputs.steps_per_epoch(config, 1437, batch_size=128, last_batch="pad") == 12  # linear eval: ⌈N/B⌉
    with pytest.raises(ValueError, match="holds no sample"):
        inputs.steps_per_epoch(config, 10, last_batch="drop")
