"""Malformed configs: each raises a one-line error naming the field, before anything compiles."""

import pytest

from skipless_jax import validate

from util import tiny_config

CASES = [
    ({"model.variant": "Huge/16"}, "config.model.variant"),
    ({"optimizer.name": "lion"}, "config.optimizer.name"),
    ({"dataset.name": "mnist"}, "config.dataset.name"),
    ({"mesh": [("data", -1), ("model", 1)]}, "config.mesh"),
    ({"model.init": "xavier"}, "init"),
    ({"model.token_graying": "fft"}, "token_graying"),
    ({"mesh": [("data", 3)]}, "config.mesh"),
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
]


@pytest.mark.parametrize("overrides, field", CASES, ids=[",".join(f"{k}={v}" for k, v in o.items()) for o, _ in CASES])
def test_malformed_config_is_one_line_naming_the_field(overrides, field):
    config = tiny_config(**overrides)
    with pytest.raises(ValueError) as err:
        validate.validate_config(config, num_devices=8)
    message = str(err.value)
    assert "\n" not in message, message
    assert field in message, message


def test_well_formed_configs_pass():
    validate.validate_config(tiny_config(), num_devices=8)
    validate.validate_config(tiny_config("skip_sab=False,skip_ffn=False,init=skipless"), num_devices=8)
    validate.validate_config(tiny_config(**{"model.token_graying": "dct", "model.tg_eps": 1.0}), num_devices=8)
