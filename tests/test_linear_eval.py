"""DINO's linear evaluation (docs/method/evals.md §18): the features against a plain reading of
eval_linear.py, the schedule against torch's CosineAnnealingLR, and the trained probe on digits."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from skipless_jax import evaluators, models, sharding
from skipless_jax.evaluators import linear_eval
from skipless_jax.trainers import supervised

from util import tiny_config


def _dino_reading(intermediate_output, avgpool):
    """eval_linear.py: output = cat([x[:, 0] for x in intermediate_output], -1); with avgpool
    cat((output.unsqueeze(-1), mean(intermediate_output[-1][:, 1:], 1).unsqueeze(-1)), -1)
    reshaped to (B, -1)."""
    output = np.concatenate([x[:, 0] for x in intermediate_output], axis=-1)
    if avgpool:
        mean = intermediate_output[-1][:, 1:].mean(axis=1)
        output = np.concatenate([output[..., None], mean[..., None]], axis=-1).reshape(output.shape[0], -1)
    return output


def test_features_equal_the_reading_of_eval_linear():
    rng = np.random.default_rng(0)
    blocks = [rng.normal(size=(3, 5, 4)).astype(np.float32) for _ in range(4)]
    for n in (1, 2, 4):
        got = linear_eval.dino_features([jnp.asarray(b) for b in blocks[-n:]], avgpool=False)
        np.testing.assert_allclose(got, _dino_reading(blocks[-n:], False), rtol=1e-6)
        assert got.shape == (3, 4 * n)
    got = linear_eval.dino_features([jnp.asarray(blocks[-1])], avgpool=True)
    np.testing.assert_allclose(got, _dino_reading(blocks[-1:], True), rtol=1e-6)
    np.testing.assert_allclose(got[:, 0::2], blocks[-1][:, 0], rtol=1e-6)  # interleaved: cls, avg, cls, ...
    with pytest.raises(ValueError, match=r"^dino_features: avgpool with n_last_blocks=2; DINO's eval_linear "):
        linear_eval.dino_features([jnp.asarray(b) for b in blocks[-2:]], avgpool=True)


def test_schedule_is_torch_cosine_annealing_stepped_per_epoch():
    schedule = linear_eval.epoch_cosine(0.004, epochs=10, steps_per_epoch=3)
    for step in range(30):
        epoch = step // 3  # CosineAnnealingLR(T_max=10, eta_min=0).step() once per epoch
        np.testing.assert_allclose(schedule(step), 0.004 * (1 + np.cos(np.pi * epoch / 10)) / 2, rtol=1e-6)


def test_dino_defaults_by_width():
    entry = lambda **f: ml_collections.ConfigDict(f)
    assert linear_eval.blocks_of(entry(), 384) == (4, False)  # ViT-S
    assert linear_eval.blocks_of(entry(), 768) == (1, True)  # ViT-B
    assert linear_eval.blocks_of(entry(avgpool=True), 384) == (1, True)
    assert linear_eval.blocks_of(entry(n_last_blocks=2), 768) == (2, False)
    assert linear_eval.blocks_of(entry(avgpool=False), 768) == (1, False)


@pytest.fixture(scope="module")
def vit():
    config = tiny_config("depth=2")  # n_last_blocks=2
    config.model.pool = "tok"  # a class token (the quickstart pools the patch tokens)
    mesh = sharding.make_mesh(config.mesh)
    ctx, _ = supervised.evaluation(config, mesh)
    model = models.build(config.model, 10)
    params = jax.jit(model.init)(jax.random.PRNGKey(0), jnp.zeros((1, 8, 8, 1)))["params"]
    return config, mesh, ctx, params


@pytest.mark.slow  # 96 SGD steps through the backbone
def test_trained_probe_beats_chance_on_digits(vit):
    config, mesh, ctx, params = vit
    entry = ml_collections.ConfigDict(dict(type="dino_linear", n_last_blocks=2, epochs=8, batch_size=128, lr=0.5))
    ev = linear_eval.DinoLinear.from_config("lin", entry, ctx, prefix="lin", every_steps=None, split="test")
    assert (ev.n_last_blocks, ev.avgpool, ev.steps_per_epoch) == (2, False, 12)  # ⌈1437 / 128⌉
    with jax.set_mesh(mesh):
        linear, losses = ev.train(params)
        got = {m: v for _, m, v in evaluators.run_all([ev], ctx, params)}
    assert linear["kernel"].shape == (2 * config.model.width, 10) and len(losses) == 8 * 12
    assert np.mean(losses[-12:]) < 0.9 * np.mean(losses[:12]) and losses[0] == pytest.approx(np.log(10), rel=0.05)
    # Random-init features of a width-32 ViT, 96 steps on RandomResizedCrop(scale 0.08-1) views of
    # 8-px digits: 0.33 measured; chance is 0.1 (top-5: 0.5).
    assert got["top1"] > 0.25 and got["top5"] >= max(got["top1"], 0.6)


@pytest.mark.slow
def test_two_sgd_steps_equal_the_numpy_momentum_update(vit):
    """torch SGD(momentum=0.9, dampening=0): v ← 0.9·v + g (v₀ = g), p ← p − lr·v, at epoch 0's lr."""
    from skipless_jax.data import device_images, device_input

    config, mesh, ctx, params = vit
    entry = ml_collections.ConfigDict(dict(type="dino_linear", n_last_blocks=1, epochs=4, batch_size=16, lr=2.0))
    ev = linear_eval.DinoLinear.from_config("lin", entry, ctx, prefix="lin", every_steps=None, split="test")
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 10, 16)
    batch = {"image": rng.integers(0, 256, (16, 8, 8, 1)).astype(np.uint8),
             "label": np.eye(10, dtype=np.float32)[labels]}
    with jax.set_mesh(mesh):
        state = ev.init(config.model.width)
        w0, b0 = (np.asarray(state["linear"][k], np.float64) for k in ("kernel", "bias"))
        images = device_images.prepare({"image": jnp.asarray(batch["image"])}, *ev._mean_std)["image"]
        x = np.asarray(jax.jit(ev._features)(params, images), np.float64)
        for _ in range(2):
            state, _ = ev._step(state, params, device_input.global_batch(batch, sharding.batch_sharding(mesh)))
    lr = 2.0 * 16 / 256

    def grads(w, b):
        z = x @ w + b
        p = np.exp(z - z.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        d = (p - batch["label"]) / 16
        return x.T @ d, d.sum(0)

    gw1, gb1 = grads(w0, b0)
    w1, b1 = w0 - lr * gw1, b0 - lr * gb1
    gw2, gb2 = grads(w1, b1)
    np.testing.assert_allclose(state["linear"]["kernel"], w1 - lr * (0.9 * gw1 + gw2), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(state["linear"]["bias"], b1 - lr * (0.9 * gb1 + gb2), rtol=1e-4, atol=1e-6)
    assert np.std(w0) == pytest.approx(0.01, rel=0.1) and not b0.any()  # N(0, 0.01²), bias 0


def test_bad_entries_are_one_line_errors(vit):
    config, _, ctx, _ = vit
    check = lambda **f: linear_eval.DinoLinear.check("lin", ml_collections.ConfigDict(dict(type="dino_linear", **f)))
    with pytest.raises(ValueError, match=r"^config\.evals\.lin: avgpool=True with n_last_blocks=4; DINO's"):
        check(avgpool=True, n_last_blocks=4)
    with pytest.raises(ValueError, match=r"^config\.evals\.lin\.epochs=0 must be a positive integer$"):
        check(epochs=0)
    with pytest.raises(ValueError, match=r"^config\.evals\.lin\.lr=0 must be a finite number > 0"):
        check(lr=0)
    config = config.copy_and_resolve_references()
    config.evals = ml_collections.ConfigDict(dict(lin=dict(type="dino_linear", n_last_blocks=3)))
    with pytest.raises(ValueError, match=r"^config\.evals\.lin\.n_last_blocks=3 exceeds the model's 2 blocks$"):
        evaluators.check_config(config)
    config.evals.lin.n_last_blocks = 1
    config.model.pool = "gap"
    with pytest.raises(ValueError, match=r"^config\.evals\.lin: type 'dino_linear' reads the class token .* which "
                                         r"the vit model does not have$"):
        evaluators.check_config(config)
    convmixer = ml_collections.ConfigDict(dict(name="convmixer", width=16, depth=1, kernel_size=3, patch_size=2))
    with pytest.raises(ValueError, match=r"^config\.evals\.lin: type 'dino_linear' reads the class token of every "
                                         r"block's final-norm output, which the convmixer model does not have$"):
        linear_eval.DinoLinear.check_model("lin", config.evals.lin, models.describe(convmixer))


def test_the_probe_reads_a_plain_stream_of_bilinear_crops(vit):
    """DINO's train loader: no drop_last, no repeated augmentation, whatever the run's stream;
    torchvision RandomResizedCrop's bilinear resampling."""
    from PIL import Image

    from skipless_jax.data import inputs, transforms

    config, mesh, ctx, params = vit
    config = ml_collections.ConfigDict(config.to_dict())
    config.input.drop_last, config.input.repeated_augmentation = True, 3  # a DeiT/DINO-style run's stream
    run_ctx, _ = supervised.evaluation(config, mesh)
    entry = ml_collections.ConfigDict(dict(type="dino_linear", n_last_blocks=1, epochs=2, batch_size=128))
    ev = linear_eval.DinoLinear.from_config("lin", entry, run_ctx, prefix="lin", every_steps=None, split="test")
    view = ev.view.config.input
    assert (view.drop_last, view.repeated_augmentation) == (False, 1)
    assert inputs.steps_per_epoch(ev.view.config) == 1437 / 128  # the schedule's ⌈N/B⌉ steps: one data epoch
    image = np.random.default_rng(1).integers(0, 256, (40, 30, 3)).astype(np.uint8)
    got = ev.train_views().transform(image, np.random.default_rng(7))
    rng = np.random.default_rng(7)  # the same draws, read plainly: box, bilinear resize, flip
    top, left, h, w = transforms.random_resized_crop_box(40, 30, rng, (0.08, 1.0), (3 / 4, 4 / 3))
    crop = np.asarray(Image.fromarray(image[top:top + h, left:left + w]).resize((8, 8), Image.Resampling.BILINEAR))
    np.testing.assert_array_equal(got, crop[:, ::-1] if rng.random() < 0.5 else crop)
    from skipless_jax.data import augment

    with pytest.raises(ValueError, match=r"aug\.interpolation='nearest' is unknown; allowed: \['bicubic', 'bil"):
        augment.validate_aug_config({**linear_eval.TRAIN_AUG, "interpolation": "nearest"})
