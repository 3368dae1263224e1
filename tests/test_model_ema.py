"""Model EMA (trainers/model_ema.py, docs/method/recipes.md §22): timm ModelEmaV3's decay schedule, the
EMA of a short run against a float64 recurrence over its saved parameters, a rejected update
leaving it as it was, exact resume with EMA and repeated augmentation on, its evaluation prefix,
one-line config errors, and MAE's weight-decay rule."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from skipless_jax import checkpoint, sharding
from skipless_jax.optim import decay_mask
from skipless_jax.trainers import common, model_ema, nonfinite, supervised

from util import one_device, tiny_config

DIGIT_AUG = dict(randaug=None, scale=(0.08, 1.0), flip=False, reprob=0.0, mixup=0.0, cutmix=0.0,
                 mixup_switch_prob=0.5, crop="pad", crop_padding=1)


def _timm_decay(step, decay, warmup, gamma=1.0, power=2 / 3):
    """ModelEmaV3.get_decay, read plainly (update_after_step 0, min_decay 0)."""
    step = max(0, step - 0 - 1)
    if step <= 0:
        return 0.0
    if warmup:
        return max(min(1 - (1 + step / gamma) ** -power, decay), 0.0)
    return decay


@pytest.mark.parametrize("warmup", [False, True])
def test_decay_schedule_is_timm_model_ema_v3(warmup):
    ema = ml_collections.ConfigDict(dict(decay=0.999, warmup=warmup, warmup_gamma=1.0, warmup_power=2 / 3))
    steps = np.array([1, 2, 3, 10, 1000, 10**6])
    got = np.array([float(model_ema.decay_at(ema, jnp.int32(t))) for t in steps])
    np.testing.assert_allclose(got, [_timm_decay(t, 0.999, warmup) for t in steps], rtol=1e-6)


def test_a_rejected_update_leaves_the_ema_as_it_was():
    config = ml_collections.ConfigDict(dict(model_ema=dict(decay=0.5)))
    old = common.TrainState(step=jnp.int32(4), params={"w": jnp.ones(3)}, ema={"params": {"w": jnp.full(3, 0.25)}},
                            nonfinite=nonfinite.init_nonfinite(), opt_state=(), rng=jax.random.PRNGKey(0))
    kept = old.replace(step=jnp.int32(5), params={"w": jnp.full(3, 2.0)})
    rejected = old.replace(step=jnp.int32(5), nonfinite=old.nonfinite.replace(count=jnp.int32(1)))
    np.testing.assert_array_equal(model_ema.after_update(config, old, kept).ema["params"]["w"],
                                  np.full(3, 0.25 + 0.5 * 1.75))
    np.testing.assert_array_equal(model_ema.after_update(config, old, rejected).ema["params"]["w"],
                                  np.full(3, 0.25))


def _ema_config(**overrides):
    config = tiny_config(total_steps=6, checkpoint_every_steps=1, keep_checkpoints=10, **overrides)
    config.model_ema.decay = 0.6
    config.model_ema.warmup = True  # d_t = min(0.6, 1 − t'^(-2/3)): 0, 0.37, 0.52, 0.6, ...
    return config


@pytest.mark.slow
def test_the_ema_is_the_recurrence_over_the_saved_parameters(tmp_path):
    metrics = supervised.train_and_evaluate(_ema_config(), str(tmp_path), devices=one_device())
    assert {"test_accuracy", "ema_test_accuracy"} <= metrics.keys()
    saved = {s: checkpoint.load_raw(str(tmp_path), s)[1] for s in range(1, 7)}
    ema = jax.tree.map(lambda x: np.asarray(x, np.float64), saved[1]["params"])  # update 1 copies θ_1
    for t in range(2, 7):
        d = _timm_decay(t, 0.6, True)
        ema = jax.tree.map(lambda e, p, d=d: e + (1 - d) * (np.asarray(p, np.float64) - e), ema, saved[t]["params"])
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), saved[t]["ema"]["params"],
                     ema)
    head = saved[6]["params"]["head"]["kernel"]
    assert np.abs(saved[6]["ema"]["params"]["head"]["kernel"] - head).max() > 1e-4 * np.abs(head).max()


@pytest.mark.slow
def test_resume_with_ema_and_repeated_augmentation_is_exact(tmp_path):
    def config():
        c = tiny_config(total_steps=8, checkpoint_every_steps=4)
        c.input.aug, c.input.crop_pct = ml_collections.ConfigDict(DIGIT_AUG), 1.0
        c.input.repeated_augmentation = 3
        c.model_ema.decay = 0.9
        return c

    supervised.train_and_evaluate(config(), str(tmp_path / "run"), devices=one_device())
    reference = checkpoint.load_raw(str(tmp_path / "run"))[1]
    mngr = checkpoint.manager(str(tmp_path / "run"))
    assert mngr.all_steps() == [4, 8]
    mngr.delete(8)  # as if the run had died between steps 4 and 8
    mngr.close()
    assert supervised.train_and_evaluate(config(), str(tmp_path / "run"), devices=one_device())["step"] == 8
    resumed = checkpoint.load_raw(str(tmp_path / "run"))[1]
    for key in ("params", "opt_state", "ema"):
        jax.tree.map(np.testing.assert_array_equal, reference[key], resumed[key])


def test_the_ema_is_sharded_as_the_optimizer_state():
    from skipless_jax.trainers import common

    config = tiny_config()
    w = jax.ShapeDtypeStruct((64, 32), jnp.float32)
    abstract = common.TrainState(params={"w": w}, ema={"params": {"w": w}}, opt_state={"mu": w},
                                 nonfinite=jax.eval_shape(nonfinite.init_nonfinite),
                                 rng=jax.ShapeDtypeStruct((2,), jnp.uint32), step=jax.ShapeDtypeStruct((), jnp.int32))
    mesh = sharding.make_mesh(config.mesh, jax.devices()[:8])
    shardings = common.state_shardings(abstract, mesh, config)
    assert shardings.ema["params"]["w"].spec == shardings.opt_state["mu"].spec != shardings.params["w"].spec
    # the same specs as the mapping of its fields (the sharding rules read leaf paths, 'ema/params/w' in both)
    as_dict = common.state_shardings(checkpoint.entries(abstract), mesh, config)
    assert jax.tree.leaves(as_dict) == jax.tree.leaves(checkpoint.entries(shardings))


@pytest.mark.parametrize("field, value, match", [
    ("decay", 1.5, r"config.model_ema.decay=1.5; allowed: a float in \(0, 1\)"),
    ("decay", 1.0, r"config.model_ema.decay=1.0; allowed"),
    ("evals", ("nope",), "config.model_ema.evals names 'nope'"),
    ("warmup_power", -1.0, "warmup_power=-1.0"),
])
def test_bad_ema_configs_fail_in_one_line(tmp_path, field, value, match):
    config = tiny_config()
    config.model_ema.decay = 0.9
    config.model_ema[field] = value
    with pytest.raises(ValueError, match=match):
        supervised.train_and_evaluate(config, str(tmp_path))


def test_an_unknown_ema_field_is_refused():
    config = tiny_config()
    with config.model_ema.unlocked():
        config.model_ema.decya = 0.9
    with pytest.raises(ValueError, match=r"config.model_ema.decya is unknown"):
        model_ema.check_config(config)


def test_mae_pretraining_decays_the_class_and_mask_tokens():
    decoder = {"mask_token": np.zeros(4), "decoder_norm": {"scale": np.zeros(4)},
               "decoder_embed": {"kernel": np.zeros((8, 4)), "bias": np.zeros(4)}}
    params = {"cls": np.zeros((1, 1, 8)), "decoder": decoder, "pos_embedding": np.zeros((1, 5, 8))}
    deit = jax.tree.leaves(decay_mask(params))
    mae = jax.tree.leaves(decay_mask(params, "mae_pretrain"))
    names = [sharding.path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    assert dict(zip(names, deit)) == {"cls": False, "decoder/decoder_embed/bias": False,
                                      "decoder/decoder_embed/kernel": True, "decoder/decoder_norm/scale": False,
                                      "decoder/mask_token": False, "pos_embedding": False}
    assert dict(zip(names, mae)) == {**dict(zip(names, deit)), "cls": True, "decoder/mask_token": True}
    with pytest.raises(ValueError, match="weight_decay_rule='timm'"):
        decay_mask(params, "timm")


def test_which_evaluators_run_on_the_ema_does_not_block_a_resume():
    from skipless_jax import pretrained

    saved = tiny_config()
    saved.model_ema.decay = 0.9
    resumed = tiny_config()
    resumed.model_ema.decay = 0.9
    resumed.model_ema.evals = ("test",)  # evaluation only: a runtime field
    assert pretrained.config_differences(saved.to_dict(), resumed.to_dict()) == []
    resumed.model_ema.decay = 0.99  # what is trained
    assert pretrained.config_differences(saved.to_dict(), resumed.to_dict()) == ["model_ema.decay"]


def test_params_choice_and_a_run_without_ema_are_one_line_errors():
    model_ema.check_params("ema", ["ema", "params", "step"], "/runs/a")
    model_ema.check_params("model", ["params"], "/runs/a")
    with pytest.raises(ValueError, match=r"^--params='teacher' is unknown; allowed: model, ema$"):
        model_ema.check_params("teacher", ["params"], "/runs/a")
    with pytest.raises(ValueError, match=r"^--params=ema: the checkpoint at '/runs/a' keeps no model EMA "
                                         r"\(its run had no config\.model_ema\.decay; it has \['params'\]\); "
                                         r"use --params=model$"):
        model_ema.check_params("ema", ["params"], "/runs/a")
    state = {"params": {"w": 1}, "batch_stats": {"m": 2}, "ema": {"params": {"w": 3}, "batch_stats": {"m": 4}}}
    ema = model_ema.weights(state, "ema")
    assert (ema["params"], ema["batch_stats"]) == ({"w": 3}, {"m": 4})
    assert model_ema.weights(state, "model") is state
