"""The MAE trainer and the fine-tuning path (docs/method/ssl.md §9): exact resume, masks that depend on
(seed, step) only, the encoder carried into the classifier, the position table, layer decay in
the registry optimizers, the reconstruction picture and one-line config errors."""

import os
import shutil

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from skipless_jax import checkpoint, evaluate, losses, models
from skipless_jax.models import mae as mae_lib
from skipless_jax.models.common import posemb_sincos_2d, resize_posemb
from skipless_jax.models.vit import layer_id as vit_layer_id
from skipless_jax.optim import build_optimizer
from skipless_jax.pretrained import init_from, posemb_extra, resize_posemb_table
from skipless_jax.trainers import common, mae, nonfinite, supervised, warm_start

from util import init_params, load_config

TINY_ENCODER = dict(width=32, mlp_dim=64, num_heads=2, depth=1)  # the pre-training and the fine-tuning


def tiny_mae_config(arg: str | None = None, **overrides):
    """configs/mae_digits_pretrain.py shrunk to seconds: width 32, depth 1, decoder 16 × 1, 4 steps."""
    c = load_config("mae_digits_pretrain", arg)
    c.model.update(TINY_ENCODER)
    c.mae.update(dict(decoder_width=16, decoder_depth=1, decoder_num_heads=2, picture_images=3))
    c.input.batch_size = 32
    c.total_epochs = None
    c.total_steps = 4
    c.schedule.warmup_epochs = None
    c.schedule.warmup_steps = 1
    c.log_every_steps = 2
    c.checkpoint_every_steps = 0
    c.evals = ml_collections.ConfigDict()
    c.update_from_flattened_dict(overrides)  # dotted keys, e.g. "model.depth"
    return c


def tiny_finetune_config(init_from, **overrides):
    c = load_config("mae_digits_finetune", f"init_from={init_from}" if init_from else None)
    c.model.update(TINY_ENCODER)
    c.input.batch_size = 32
    c.total_epochs = None
    c.total_steps = 1
    c.schedule.warmup_epochs = None
    c.schedule.warmup_steps = 0
    c.log_every_steps = 1
    c.update_from_flattened_dict(overrides)  # dotted keys, e.g. "model.depth"
    return c


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """(workdir, final state) of a 4-step tiny MAE run on the 8 fake devices (kNN at the end)."""
    workdir = str(tmp_path_factory.mktemp("mae") / "run")
    config = tiny_mae_config(checkpoint_every_steps=2, keep_checkpoints=5, eval_every_steps=2)
    config.evals = ml_collections.ConfigDict(dict(knn=dict(type="knn", k=5, temperature=0.07, prefix="test")))
    metrics = mae.train_and_evaluate(config, workdir)
    assert metrics["step"] == 4 and 0.1 < metrics["test_knn_accuracy"] <= 1.0
    return workdir, checkpoint.load_raw(workdir, 4)[1], metrics


@pytest.mark.slow
def test_resume_is_exact_and_the_picture_and_evaluate_command_work(pretrained, tmp_path):
    workdir, reference, metrics = pretrained
    # The picture, written at the last step.
    assert os.path.getsize(os.path.join(workdir, "reconstruction.png")) > 1000
    for step in (2, 4):  # during (every evaluation) and after pre-training
        assert os.path.exists(os.path.join(workdir, "reconstructions", f"step_{step:06d}.png"))
    # The evaluate command on the MAE workdir reproduces the run's last evaluation.
    assert evaluate.evaluate(workdir)["test_knn_accuracy"] == pytest.approx(metrics["test_knn_accuracy"], abs=1e-6)
    # Resume: a copy of the run loses step 4 (as if it had died after step 2), reruns, and must
    # end bitwise equal to the uninterrupted run.
    copy = str(tmp_path / "copy")
    shutil.copytree(workdir, copy)
    config = tiny_mae_config(checkpoint_every_steps=2, keep_checkpoints=5, eval_every_steps=2)
    mngr = checkpoint.manager(copy)
    assert mngr.all_steps() == [2, 4]
    mngr.delete(4)
    mngr.close()
    assert mae.train_and_evaluate(config, copy)["step"] == 4
    _, resumed = checkpoint.load_raw(copy, 4)
    for key in ("params", "opt_state", "rng", "step", "nonfinite"):
        jax.tree.map(np.testing.assert_array_equal, reference[key], resumed[key])


@pytest.mark.slow
def test_one_device_run_equals_the_eight_device_run(pretrained, tmp_path):
    """The masks (and so the step) depend on (seed, step) only, not on how the batch is split."""
    _, reference, _ = pretrained
    config = tiny_mae_config(checkpoint_every_steps=2, keep_checkpoints=5)
    mae.train_and_evaluate(config, str(tmp_path / "one"), devices=jax.devices()[:1])
    _, single = checkpoint.load_raw(str(tmp_path / "one"), 4)
    # The key bias is left out: its exact gradient is 0 (softmax ignores a shift shared by all keys),
    # so Adam turns its float noise into lr-sized steps of either sign.
    flat = lambda tree: {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}
    one, eight = flat(single["params"]), flat(reference["params"])
    compared = [k for k in one if "key_bias" not in k]
    assert len(compared) >= 42  # the encoder's and the decoder's leaves but the key biases: 42 at depth 1
    for k in compared:
        np.testing.assert_allclose(one[k], eight[k], rtol=1e-5, atol=1e-7, err_msg=k)


@pytest.mark.slow
def test_masks_of_a_step_depend_on_seed_and_step_only():
    config = tiny_mae_config()
    model = mae.build_model(config)
    images = jnp.asarray(np.random.default_rng(0).normal(size=(6, 8, 8, 1)), jnp.float32)
    params = init_params(model, {"params": jax.random.PRNGKey(0), "masking": jax.random.PRNGKey(1)}, images)
    rng = jax.random.PRNGKey(3)

    @jax.jit
    def mask_at(step, imgs):
        key = jax.random.split(jax.random.fold_in(rng, step))[0]
        return model.apply({"params": params}, imgs, train=True, rngs={"masking": key, "dropout": key})[2]

    m0 = np.asarray(mask_at(0, images))
    np.testing.assert_array_equal(m0, np.asarray(mask_at(0, images * 2.0)))  # not on the pixels
    assert not np.array_equal(m0, np.asarray(mask_at(1, images)))  # a new step: new masks
    np.testing.assert_array_equal(m0.sum(1), np.full(6, 16 - mae_lib.num_kept(16, 0.75)))


@pytest.mark.slow
def test_finetuning_starts_from_the_pretrained_encoder(pretrained, tmp_path):
    """Step 1 runs at the warm-up's lr 0, so it leaves the parameters as loaded: the encoder's."""
    workdir, saved, _ = pretrained
    config = tiny_finetune_config(workdir, **{"schedule.warmup_steps": 1})
    assert supervised.train_and_evaluate(config, str(tmp_path / "ft"))["step"] == 1
    _, tuned = checkpoint.load_raw(str(tmp_path / "ft"), 1)
    source, params = saved["params"], tuned["params"]
    assert set(params) == {"embedding", "cls", "pos_embedding", "block_0", "fc_norm", "head"}
    for name in ("embedding", "cls", "block_0"):
        jax.tree.map(np.testing.assert_array_equal, params[name], source[name])
    table = np.concatenate([np.zeros((1, 1, 32)), np.asarray(posemb_sincos_2d(4, 4, 32))], axis=1)
    np.testing.assert_allclose(params["pos_embedding"], table, atol=1e-7)
    np.testing.assert_array_equal(params["fc_norm"]["scale"], np.ones(32))
    np.testing.assert_array_equal(params["fc_norm"]["bias"], np.zeros(32))
    assert 0 < np.std(params["head"]["kernel"]) < 1e-4  # fresh, std 2e-5


@pytest.mark.slow
def test_position_table_is_resized_for_another_grid(pretrained):
    workdir, _, _ = pretrained
    config = tiny_finetune_config(workdir, **{"input.image_size": 16})
    model = models.build(config.model, 10)
    params = jax.jit(model.init)(jax.random.PRNGKey(0), jnp.zeros((1, 16, 16, 1)))["params"]
    one = jax.sharding.Mesh(jax.devices()[:1], ("data",))
    repl = jax.tree.map(lambda _: NamedSharding(one, PartitionSpec()), params)
    rename = warm_start.classifier_rename("params", checkpoint.saved_config(workdir))
    loaded = init_from(workdir, params, repl, "params", rename)
    grid4 = posemb_sincos_2d(4, 4, 32)
    expected = np.concatenate([np.zeros((1, 1, 32)), np.asarray(resize_posemb(grid4, 8, 8))], axis=1)
    assert loaded["pos_embedding"].shape == (1, 65, 32)
    np.testing.assert_allclose(loaded["pos_embedding"], expected, atol=1e-6)
    # A learned table of another grid (a classifier checkpoint) is resized the same way.
    table = jnp.arange(17 * 3, dtype=jnp.float32).reshape(1, 17, 3)
    resized = resize_posemb_table(table, (1, 65, 3))
    np.testing.assert_array_equal(resized[:, :1], table[:, :1])
    np.testing.assert_allclose(resized[:, 1:], resize_posemb(table[:, 1:], 8, 8), atol=1e-6)
    assert posemb_extra((1, 16, 3), (1, 64, 3)) == 0 and posemb_extra((1, 17, 3), (1, 51, 3)) is None


@pytest.mark.slow
@pytest.mark.parametrize("opt", ["adamw", "soap"])
def test_layer_decay_scales_each_group_by_its_formula(opt):
    """build_optimizer with config.optimizer.layer_decay: update = decay^(L+1−id) × the plain update."""
    config = tiny_finetune_config(None, **{"model.depth": 2})  # two blocks: layer ids 0 to 3
    config.optimizer = load_config("quickstart", f"opt={opt}").optimizer
    model = models.build(config.model, 10)
    params = init_params(model, jax.random.PRNGKey(0), jnp.zeros((1, 8, 8, 1)))
    grads = jax.tree.map(lambda p: jnp.full(p.shape, 0.3, p.dtype), params)
    plain, _ = build_optimizer(config, 10)
    config.optimizer.layer_decay = 0.5
    decayed, _ = build_optimizer(config, 10)
    step = lambda tx: jax.jit(lambda g, p: tx.update(g, tx.init(p), p)[0])(grads, params)
    u_plain, u_decay = step(plain), step(decayed)
    flat_plain = dict(jax.tree_util.tree_flatten_with_path(u_plain)[0])
    for path, u in jax.tree_util.tree_flatten_with_path(u_decay)[0]:
        name = "/".join(str(getattr(k, "key", k)) for k in path)
        scale = 0.5 ** (2 + 1 - vit_layer_id(name, 2))
        np.testing.assert_allclose(u, scale * flat_plain[path], rtol=1e-6, atol=1e-12)
    assert vit_layer_id("fc_norm/scale", 2) == 3 and vit_layer_id("pos_embedding", 2) == 0


def test_reconstruction_picture_shows_visible_patches_and_the_prediction_elsewhere():
    rng = np.random.default_rng(0)
    images = rng.normal(size=(2, 4, 4, 1))
    mask = np.array([[1, 0, 0, 1], [0, 0, 1, 1]], np.float32)
    prediction = rng.normal(size=(2, 4, 4))
    original, masked, recon = mae.reconstruction_rows(images, prediction, mask, 2, False, (0.5,), (0.25,))
    to01 = lambda x: np.clip(x * 0.25 + 0.5, 0, 1)
    np.testing.assert_allclose(original, to01(images))
    # Patch 0 (top-left) of image 0 is removed: NaN in the masked row, the prediction in the reconstruction.
    assert np.isnan(masked[0, :2, :2]).all() and not np.isnan(masked[0, :2, 2:]).any()
    np.testing.assert_allclose(recon[0, :2, :2, 0], to01(prediction[0, 0].reshape(2, 2)))
    np.testing.assert_allclose(recon[0, :2, 2:], original[0, :2, 2:])  # visible: the input


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"mae.mask_ratio": 1.0}, r"config\.mae\.mask_ratio=1\.0 must be in \[0, 1\)"),
        ({"mae.mask_ratio": 0.99}, r"config\.mae\.mask_ratio=0\.99 keeps no patch of the 16"),
        ({"mae.decoder_num_heads": 3}, r"config\.mae\.decoder_num_heads=3 does not divide config\.mae\.decoder_width"),
        ({"mae.target": "pixels"}, r"config\.mae\.target='pixels' is unknown; allowed: \['raw', 'grayed'\]"),
        ({"mae.picture_images": -1}, r"config\.mae\.picture_images=-1 must be an integer >= 0"),
        ({"grad_accum_steps": 2}, r"config\.grad_accum_steps=2: the mae trainer does not accumulate"),
        ({"evals": ml_collections.ConfigDict(dict(c=dict(type="classification")))},
         r"config\.evals\.c\.type='classification' is unknown for the mae trainer"),
        ({"optimizer.layer_decay": 1.5}, r"config\.optimizer\.layer_decay=1\.5 must be in \(0, 1\]"),
    ],
)
def test_bad_config_is_a_one_line_error_before_compiling(overrides, match, tmp_path):
    with pytest.raises(ValueError, match=match) as err:
        mae.train_and_evaluate(tiny_mae_config(**overrides), str(tmp_path))
    assert "\n" not in str(err.value)
    assert not (tmp_path / "checkpoints").exists()


@pytest.mark.slow
def test_grayed_target_reconstructs_the_token_grayed_patches():
    config = tiny_mae_config("tg=dct,target=grayed")
    model = mae.build_model(config)
    images = jnp.asarray(np.random.default_rng(1).normal(size=(4, 8, 8, 1)), jnp.float32)
    rngs = {"params": jax.random.PRNGKey(0), "masking": jax.random.PRNGKey(1)}
    params = init_params(model, rngs, images)
    forward = jax.jit(lambda p, x: model.apply({"params": p}, x, rngs={"masking": jax.random.PRNGKey(2)}))
    loss, prediction, mask = forward(params, images)
    from skipless_jax.models.common import patchify
    from skipless_jax.models.stem import token_gray_patches

    grayed = token_gray_patches(patchify(images, 2), "dct", 0.95)
    np.testing.assert_allclose(loss, losses.patch_loss(grayed, prediction, mask, False), rtol=1e-6)
    raw = losses.reconstruction_loss(images, prediction, mask, 2, False)
    assert abs(float(raw) - float(loss)) > 1e-4  # the two targets differ


@pytest.mark.slow
def test_mae_step_divides_its_flops_over_eight_devices():
    """The trainer's own MAE step, compiled for 1 and 8 fake devices: per-device FLOPs ≤ 0.2×."""
    from skipless_jax import sharding
    from skipless_jax.optim import build_optimizer

    config = tiny_mae_config()
    config.input.batch_size = 64
    model = mae.build_model(config)
    tx, schedule = build_optimizer(config, 10)
    step = mae.make_train_step(model, tx, schedule, config)

    def init_state(rng):
        params = model.init({"params": rng, "masking": rng}, jnp.zeros((1, 8, 8, 1)))["params"]
        return common.TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params), rng=rng,
                                 nonfinite=nonfinite.init_nonfinite())

    flops = {}
    for n in (1, 8):
        mesh = sharding.make_mesh({"data": n}, jax.devices()[:n])
        _, state, shardings = common.abstract_state(init_state, config, mesh)
        batch = {"image": jax.ShapeDtypeStruct((64, 8, 8, 1), jnp.float32, sharding=sharding.batch_sharding(mesh))}
        state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), state, shardings)
        with jax.set_mesh(mesh):
            flops[n] = jax.jit(step).lower(state, batch).compile().cost_analysis()["flops"]
    assert flops[8] <= 0.2 * flops[1], flops
