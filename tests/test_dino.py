"""DINO (docs/method/ssl.md §6) against independent float64 numpy references, exact resume, 4 devices, bad input."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from skipless_jax import checkpoint, losses, sharding
from skipless_jax.data import multicrop
from skipless_jax.models import dino_head
from skipless_jax.trainers import dino, model_ema

from util import load_config, one_device


def tiny_dino_config(**overrides):
    """configs/dino_digits.py shrunk to seconds: width 16, depth 1, 2×2 patches, K = 64, batch 16, 2 local crops."""
    c = load_config("dino_digits")
    c.model.update(dict(width=16, depth=1, num_heads=2, mlp_dim=32, patch_size=2))
    c.dino.update(dict(out_dim=64, hidden_dim=32, bottleneck_dim=16))
    c.input.batch_size = 16
    c.input.eval_batch_size = 128
    c.input.multicrop.num_local = 2
    c.total_epochs = None
    c.total_steps = 4
    c.schedule.warmup_epochs = None
    c.schedule.warmup_steps = 2
    if not any(key.startswith("evals.") for key in overrides):
        c.evals = ml_collections.ConfigDict()  # no evaluation: faster
    c.eval_at_start = False
    c.log_every_steps = 2
    c.checkpoint_every_steps = 0
    for key, value in overrides.items():
        holder = c
        *parents, field = key.split(".")
        for parent in parents:
            holder = holder[parent]
        holder[field] = value
    return c


# --------------------------------------------------------------------------------------------
# Independent float64 references (DINO's DINOLoss / update_center / cosine_scheduler, in numpy).


def np_softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def np_log_softmax(x):
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def ref_dino_loss(student_output, teacher_output, center, student_temp, teacher_temp, ncrops):
    """Crop-major (ncrops·B, K) and (2·B, K) outputs, as DINO's loss chunks them."""
    student_out = np.split(student_output / student_temp, ncrops)
    teacher_out = np.split(np_softmax((teacher_output - center) / teacher_temp), 2)
    total, n_terms = 0.0, 0
    for iq, q in enumerate(teacher_out):
        for v in range(len(student_out)):
            if v == iq:
                continue
            total += np.sum(-q * np_log_softmax(student_out[v]), axis=-1).mean()
            n_terms += 1
    return total / n_terms


def ref_cosine_scheduler(base, final, epochs, niter_per_ep, warmup_epochs=0, start_warmup_value=0.0):
    warmup_iters = warmup_epochs * niter_per_ep
    warmup = np.linspace(start_warmup_value, base, warmup_iters) if warmup_iters > 0 else np.array([])
    iters = np.arange(epochs * niter_per_ep - warmup_iters)
    schedule = final + 0.5 * (base - final) * (1 + np.cos(np.pi * iters / len(iters)))
    return np.concatenate((warmup, schedule))


@pytest.mark.parametrize("num_local", [0, 1, 4])
def test_dino_loss_matches_numpy_reference(num_local):
    rng = np.random.default_rng(num_local)
    b, k = 5, 32
    ncrops = 2 + num_local
    student = rng.normal(size=(ncrops * b, k)) * 3
    teacher = rng.normal(size=(2 * b, k)) * 3
    center = rng.normal(size=(1, k))
    expected = ref_dino_loss(student, teacher, center, 0.1, 0.04, ncrops)
    got = losses.dino_loss(
        jnp.asarray(student.reshape(ncrops, b, k), jnp.float32),
        jnp.asarray(teacher.reshape(2, b, k), jnp.float32),
        jnp.asarray(center, jnp.float32),
        0.1,
        0.04,
    )
    np.testing.assert_allclose(float(got), expected, rtol=2e-5)


def test_dino_loss_gradient_flows_only_through_the_student():
    rng = np.random.default_rng(0)
    s = jnp.asarray(rng.normal(size=(3, 4, 8)), jnp.float32)
    t = jnp.asarray(rng.normal(size=(2, 4, 8)), jnp.float32)
    c = jnp.zeros((1, 8))
    g_s, g_t = jax.jit(jax.grad(lambda s, t: losses.dino_loss(s, t, c, 0.1, 0.05), argnums=(0, 1)))(s, t)
    assert float(jnp.abs(g_t).max()) == 0.0
    assert float(jnp.abs(g_s).max()) > 0.0


def test_center_update_and_teacher_ema_equal_their_formulas():
    rng = np.random.default_rng(1)
    teacher_out = rng.normal(size=(2, 6, 16))
    center = rng.normal(size=(1, 16))
    m = 0.9
    expected = center * m + teacher_out.reshape(12, 16).sum(0, keepdims=True) / 12 * (1 - m)
    got = dino.update_center(jnp.asarray(center, jnp.float32), jnp.asarray(teacher_out, jnp.float32), m)
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-5, atol=1e-6)

    t = {"a": rng.normal(size=(3, 4)), "b": rng.normal(size=(5,))}
    s = {"a": rng.normal(size=(3, 4)), "b": rng.normal(size=(5,))}
    out = model_ema.update(jax.tree.map(jnp.asarray, t), jax.tree.map(jnp.asarray, s), jnp.float32(0.996))
    for key in t:
        np.testing.assert_allclose(np.asarray(out[key]), 0.996 * t[key] + 0.004 * s[key], rtol=1e-5, atol=1e-6)


def test_schedules_equal_dino_closed_forms():
    epochs, niter = 12, 7
    sched = dino.Schedules(
        total_steps=epochs * niter, steps_per_epoch=niter, warmup_steps=3 * niter, peak_lr=2e-3, min_lr=1e-6,
        weight_decay=0.04, weight_decay_end=0.4, momentum_teacher=0.996, warmup_teacher_temp=0.04,
        teacher_temp=0.07, warmup_teacher_temp_epochs=5, freeze_last_layer_steps=niter,
    )
    lr = ref_cosine_scheduler(2e-3, 1e-6, epochs, niter, warmup_epochs=3)
    wd = ref_cosine_scheduler(0.04, 0.4, epochs, niter)
    mom = ref_cosine_scheduler(0.996, 1.0, epochs, niter)
    temp = np.concatenate((np.linspace(0.04, 0.07, 5), np.ones(epochs - 5) * 0.07))
    steps = np.array([0, 1, 5, 20, 21, 22, 40, 60, 83])
    np.testing.assert_allclose(np.asarray(sched.lr(steps)), lr[steps], rtol=1e-5, atol=1e-9)
    np.testing.assert_allclose(np.asarray(sched.wd(steps)), wd[steps], rtol=1e-5)
    np.testing.assert_allclose(np.asarray(sched.momentum(steps)), mom[steps], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(sched.temp(steps)), temp[steps // niter], rtol=1e-6)
    # Past the last step every schedule holds its last value.
    np.testing.assert_allclose(float(sched.lr(500)), lr[-1], rtol=1e-5, atol=1e-9)


@pytest.mark.slow
def test_clip_per_tensor_and_frozen_last_layer():
    grads = {"head": {"last_layer_v": jnp.full((4, 4), 2.0)}, "w": jnp.full((3,), 0.5)}
    clipped, _ = dino.clip_per_tensor(3.0).update(grads, optax.EmptyState())
    np.testing.assert_allclose(np.asarray(clipped["head"]["last_layer_v"]), 2.0 * 3.0 / (8.0 + 1e-6), rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(clipped["w"]), 0.5)  # norm 0.87 < 3: untouched

    params = jax.tree.map(jnp.ones_like, grads)
    tx = dino.frozen_until(optax.adam(0.1), steps=2)
    state = tx.init(params)
    for step in range(3):
        updates, state = tx.update(grads, state, params)
        last = np.abs(np.asarray(updates["head"]["last_layer_v"])).max()
        assert (last == 0.0) == (step < 2), (step, last)
    # The inner state did not advance while frozen: the first real update is Adam's t = 1,
    # -lr·g/(|g| + eps) (it was -lr·0.64 with the count running on through zero gradients).
    np.testing.assert_allclose(np.asarray(updates["head"]["last_layer_v"]), -0.1 * 2.0 / (2.0 + 1e-8), rtol=1e-5)
    assert int(state.inner[0].count) == 1


def test_frozen_last_layer_starts_adam_at_t1_and_follows_the_global_lr_and_wd():
    """torch semantics: the frozen last layer has no grad, so AdamW skips it (no moments, no step,
    no decay); lr and wd of its first update are the global step's."""
    config = load_config("dino_digits", "opt=adamw")
    sched = dataclasses.replace(dino.schedules_from_config(config, 1437), freeze_last_layer_steps=2)
    tx = dino.build_dino_optimizer(config, sched)
    params = {"head": {"last_layer_v": jnp.full((4, 6), 0.5)}, "w": jnp.full((4, 4), 0.5)}
    state = tx.init(params)
    grads = {"head": {"last_layer_v": jnp.full((4, 6), 1e-3)}, "w": jnp.full((4, 4), 1e-3)}
    for step in range(3):
        g = jax.tree.map(lambda x, step=step: x * (step + 1), grads)  # gradients that differ per step
        updates, state = jax.jit(tx.update)(g, state, params)
    lr, wd = float(sched.lr(2)), float(sched.wd(2))
    g2 = 3e-3
    expected_last = -lr * g2 / (g2 + 1e-8) - lr * wd * 0.5  # Adam at t = 1
    np.testing.assert_allclose(np.asarray(updates["head"]["last_layer_v"]), expected_last, rtol=1e-4)
    m = (1 - 0.9) * (0.9**2 * 1e-3 + 0.9 * 2e-3 + 3e-3)  # the rest: Adam at t = 3
    v = (1 - 0.999) * (0.999**2 * 1e-6 + 0.999 * 4e-6 + 9e-6)
    m_hat, v_hat = m / (1 - 0.9**3), v / (1 - 0.999**3)
    expected_w = -lr * m_hat / (math.sqrt(v_hat) + 1e-8) - lr * wd * 0.5
    np.testing.assert_allclose(np.asarray(updates["w"]), expected_w, rtol=1e-4)


def test_dino_decays_position_table_and_class_token_but_not_biases():
    params = {"backbone": {"pos_embedding": jnp.ones((1, 5, 4)), "cls": jnp.ones((1, 1, 4)),
                           "embedding": {"kernel": jnp.ones((4, 4)), "bias": jnp.ones((4,))}},
              "head": {"last_layer_g": jnp.ones((6,))}}
    mask = dino.dino_decay_mask(params)
    assert mask["backbone"]["pos_embedding"] and mask["backbone"]["cls"] and mask["backbone"]["embedding"]["kernel"]
    assert not mask["backbone"]["embedding"]["bias"] and not mask["head"]["last_layer_g"]


@pytest.mark.slow
@pytest.mark.parametrize("opt", ["adamw", "soap"])
def test_registry_optimizer_inside_dino_schedules(opt):
    """Whatever `config.optimizer.name` builds: frozen last layer, then decay lr_t·wd_t·p on kernels only."""
    config = load_config("dino_digits", f"opt={opt}")
    sched = dataclasses.replace(dino.schedules_from_config(config, 1437), freeze_last_layer_steps=2)
    tx = dino.build_dino_optimizer(config, sched)
    params = {"head": {"last_layer_v": jnp.ones((4, 6))}, "w": jnp.ones((4, 4)), "b": jnp.ones((4,))}
    zero = jax.tree.map(jnp.zeros_like, params)
    state = tx.init(params)
    for step in range(3):
        updates, state = jax.jit(tx.update)(zero, state, params)
        shrink = float(sched.lr(step) * sched.wd(step))
        np.testing.assert_allclose(np.asarray(updates["w"]), -shrink, rtol=1e-5)  # zero gradient: decay alone
        np.testing.assert_array_equal(np.asarray(updates["b"]), 0.0)  # 1-D: not decayed
        expected = 0.0 if step < 2 else -shrink  # frozen for two steps
        np.testing.assert_allclose(np.asarray(updates["head"]["last_layer_v"]), expected, rtol=1e-5, atol=1e-12)


def test_head_is_mlp_l2norm_and_weight_normalized_last_layer():
    head = dino_head.DINOHead(out_dim=12, hidden_dim=8, bottleneck_dim=4)
    x = jax.random.normal(jax.random.PRNGKey(0), (3, 5))
    params = jax.jit(head.init)(jax.random.PRNGKey(1), x)["params"]
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    h = np.asarray(x, np.float64)
    gelu = lambda z: 0.5 * z * (1 + np.vectorize(math.erf)(z / math.sqrt(2)))
    h = gelu(h @ p["mlp_0"]["kernel"] + p["mlp_0"]["bias"])
    h = gelu(h @ p["mlp_1"]["kernel"] + p["mlp_1"]["bias"])
    h = h @ p["mlp_2"]["kernel"] + p["mlp_2"]["bias"]
    h = h / np.linalg.norm(h, axis=-1, keepdims=True)
    w = p["last_layer_v"] / np.linalg.norm(p["last_layer_v"], axis=0, keepdims=True)
    np.testing.assert_allclose(np.asarray(jax.jit(head.apply)({"params": params}, x)), h @ w, rtol=1e-5, atol=1e-6)
    assert "last_layer_g" not in params  # norm_last_layer: g = 1 frozen


def test_multicrop_shapes_and_determinism():
    rng = np.random.default_rng(0)
    for channels in (1, 3):
        image = rng.integers(0, 256, size=(20, 24, channels), dtype=np.uint8)
        mc = multicrop.MultiCrop(global_size=16, local_size=8, num_local=3, mean=(0.5,) * channels,
                                 std=(0.25,) * channels, channels=channels)
        crops = mc.crops(image, np.random.default_rng(7))
        assert [c.shape for c in crops] == [(16, 16, channels)] * 2 + [(8, 8, channels)] * 3
        assert all(c.dtype == np.float32 for c in crops)
        again = mc.crops(image, np.random.default_rng(7))
        for a, b in zip(crops, again, strict=True):
            np.testing.assert_array_equal(a, b)
        other = mc.crops(image, np.random.default_rng(8))
        assert not np.array_equal(crops[0], other[0])
        packed = mc(image, np.random.default_rng(7))
        assert packed.shape == (mc.packed_size,)
        batch = mc.unpack({"image": np.stack([packed, packed])})
        np.testing.assert_array_equal(batch["global"][1, 1], crops[1])
        np.testing.assert_array_equal(batch["local"][0, 2], crops[4])

    # A batch depends only on (seed, step): starting at step 2 gives the third batch.
    config = tiny_dino_config()
    stream = multicrop.train_iterator(config, 0, 0, 1)
    batches = [next(stream) for _ in range(3)]
    resumed = next(multicrop.train_iterator(config, 2, 0, 1))
    assert batches[2]["global"].shape == (16, 2, 8, 8, 1)
    assert batches[2]["local"].shape == (16, 2, 4, 4, 1)
    np.testing.assert_array_equal(resumed["global"], batches[2]["global"])
    np.testing.assert_array_equal(resumed["local"], batches[2]["local"])
    assert not np.array_equal(batches[0]["global"], batches[1]["global"])
    # Process 1 of 2 reads the second half of the same global batch.
    half = next(multicrop.train_iterator(config, 2, 1, 2))
    np.testing.assert_array_equal(half["local"], batches[2]["local"][8:])


@pytest.mark.slow
def test_views_are_crop_major_and_local_crops_use_the_resized_position_table():
    g = np.arange(3 * 2).reshape(3, 2, 1, 1, 1).astype(np.float32)
    globals_, _ = multicrop.split_views(g, np.zeros((3, 0, 1, 1, 1)))
    np.testing.assert_array_equal(globals_.ravel(), [0, 2, 4, 1, 3, 5])  # view 0 of every example first
    config = tiny_dino_config()
    model = dino.build_model(config)
    params = jax.jit(model.init)(jax.random.PRNGKey(0), (jnp.zeros((1, 8, 8, 1)),))["params"]
    assert params["backbone"]["pos_embedding"].shape == (1, 1 + 16, 16)  # sized for the 8×8 global crop
    out, feats = jax.jit(model.apply)({"params": params}, (jnp.ones((4, 8, 8, 1)), jnp.ones((6, 4, 4, 1))))
    assert out.shape == (10, 64) and feats.shape == (10, 16)


@pytest.mark.slow
def test_loss_and_centre_on_four_devices_equal_single_device():
    config = tiny_dino_config()
    sched = dino.schedules_from_config(config, 1437)
    model = dino.build_model(config)
    params = jax.jit(model.init)(jax.random.PRNGKey(0), (jnp.zeros((1, 8, 8, 1)),))["params"]
    teacher = jax.tree.map(lambda p: p * 1.01, params)
    center = jnp.full((1, config.dino.out_dim), 0.01)
    batch = next(multicrop.train_iterator(config, 0, 0, 1))
    batch = {k: jnp.asarray(batch[k]) for k in ("global", "local")}

    def forward(params, teacher, center, batch):
        teacher_out = dino.teacher_outputs(model, teacher, batch)
        loss = dino.student_loss(model, params, batch, teacher_out, center, 0.1, sched.temp(0), jax.random.PRNGKey(1))
        return loss, dino.update_center(center, teacher_out, 0.9), teacher_out

    results = []
    for devices in (jax.devices()[:1], jax.devices()[:4]):
        mesh = sharding.make_mesh([("data", -1)], devices)
        repl, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
        args = jax.device_put((params, teacher, center), repl) + (jax.device_put(batch, split),)
        with jax.set_mesh(mesh):
            results.append(jax.device_get(jax.jit(forward, out_shardings=repl)(*args)))
    (loss1, center1, teacher_out), (loss4, center4, _) = results
    np.testing.assert_allclose(loss4, loss1, rtol=1e-5)
    np.testing.assert_allclose(center4, center1, rtol=1e-5, atol=1e-8)
    # The centre is the mean over the global batch; one device's quarter would give another.
    np.testing.assert_allclose(
        center4, 0.009 + 0.1 * teacher_out.reshape(32, -1).mean(0, keepdims=True), rtol=1e-5, atol=1e-7
    )
    quarter = 0.009 + 0.1 * teacher_out[:, :4].reshape(8, -1).mean(0, keepdims=True)
    assert np.abs(center4 - quarter).max() > 1e-4


@pytest.mark.slow
def test_checkpoint_resume_continues_teacher_centre_and_schedules_exactly(tmp_path):
    # The mesh is all 8 fake devices; no local crops, to keep the compile short.
    config = tiny_dino_config(checkpoint_every_steps=2, keep_checkpoints=5, **{"input.multicrop.num_local": 0})
    workdir = str(tmp_path / "run")
    dino.train_and_evaluate(config, workdir, devices=one_device())
    _, reference = checkpoint.load_raw(workdir, 4)
    mngr = checkpoint.manager(workdir)
    assert mngr.all_steps() == [2, 4]
    mngr.delete(4)  # as if the run had died between steps 2 and 4
    mngr.close()
    metrics = dino.train_and_evaluate(config, workdir, devices=one_device())
    assert metrics["step"] == 4
    _, resumed = checkpoint.load_raw(workdir, 4)
    for key in ("params", "teacher", "center", "opt_state", "schedules", "step"):
        jax.tree.map(np.testing.assert_array_equal, reference[key], resumed[key])
    assert not np.array_equal(resumed["center"], 0.0)  # the centre moved
    sched = dino.schedules_from_config(config, 1437)
    np.testing.assert_allclose(resumed["schedules"]["lr"], float(sched.lr(3)), rtol=1e-7)
    np.testing.assert_allclose(resumed["schedules"]["momentum"], float(sched.momentum(3)), rtol=1e-7)


@pytest.mark.parametrize(
    "overrides, match",
    [
        (
            {"input.multicrop.local_size": 3},
            r"config\.input\.multicrop\.local_size=3 is not divisible by the patch size 2",
        ),
        ({"dino.teacher_temp": 0.0}, r"config\.dino\.teacher_temp=0\.0 must be a finite number > 0"),
        ({"dino.warmup_teacher_temp": -0.04}, r"config\.dino\.warmup_teacher_temp=-0\.04 must be"),
        ({"dino.student_temp": 0}, r"config\.dino\.student_temp=0\.0 must be a finite number > 0"),
        ({"dino.momentum_teacher": 1.5}, r"config\.dino\.momentum_teacher=1\.5 must be in \[0, 1\]"),
        ({"dino.center_momentum": -0.1}, r"config\.dino\.center_momentum=-0\.1 must be in \[0, 1\]"),
        ({"evals.knn.k": 0}, r"config\.evals\.knn\.k=0 must be a positive integer"),
        ({"evals.linear.type": "linear"}, r"config\.evals\.linear\.type='linear' is unknown for the dino trainer"),
        ({"grad_accum_steps": 2}, r"config\.grad_accum_steps=2: the dino trainer does not accumulate"),
        ({"grad_clip_norm": 1.0}, r"config\.grad_clip_norm=1\.0: the dino trainer clips per tensor"),
        ({"model.init": "glorot"}, r"model\.init='glorot' is unknown"),
    ],
)
def test_bad_config_is_a_one_line_error_before_compiling(overrides, match, tmp_path):
    config = tiny_dino_config(**overrides)
    with pytest.raises(ValueError, match=match) as err:
        dino.train_and_evaluate(config, str(tmp_path))
    assert "\n" not in str(err.value)
    assert not (tmp_path / "checkpoints").exists()  # failed before building anything
