"""ConvMixer's running BatchNorm statistics in the supervised trainer, and the triangular lr
schedule (docs/method/families.md §10, docs/method/recipes.md §14)."""

import json

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from skipless_jax import checkpoint, evaluate, models, optim, validate
from skipless_jax.data import inputs
from skipless_jax.models import family_parts
from skipless_jax.trainers import common, nonfinite, supervised

from util import load_config


def _convmixer_config(**fields):
    c = load_config("families_digits", "family=convmixer")
    c.model.width, c.model.depth = 8, 2
    c.total_epochs, c.total_steps = None, 4
    c.schedule.warmup_epochs, c.schedule.warmup_steps = None, 1
    c.input.batch_size = 32
    c.log_every_steps = 2
    c.checkpoint_every_steps = 0
    for k, v in fields.items():
        c[k] = v
    return c


def test_batchnorm_matches_torch_semantics_in_float64():
    x = np.random.default_rng(0).normal(2.0, 3.0, (6, 5, 4)).astype(np.float32)
    bn = family_parts.BatchNorm()
    variables = bn.init(jax.random.key(0), jnp.asarray(x), train=False)
    variables = {"params": {"scale": jnp.arange(1.0, 5.0), "bias": jnp.arange(4.0) / 10}, **{
        k: v for k, v in variables.items() if k != "params"}}
    y, upd = bn.apply(variables, jnp.asarray(x), train=True, mutable=["batch_stats"])
    x64 = x.reshape(-1, 4).astype(np.float64)
    mean, var = x64.mean(0), x64.var(0)
    scale, bias = np.arange(1.0, 5.0), np.arange(4.0) / 10
    np.testing.assert_allclose(np.asarray(y).reshape(-1, 4), (x64 - mean) / np.sqrt(var + 1e-5) * scale + bias,
                               rtol=1e-5, atol=1e-5)
    n = x64.shape[0]  # torch: running ← 0.9 running + 0.1 batch (variance unbiased)
    np.testing.assert_allclose(upd["batch_stats"]["mean"], 0.1 * mean, rtol=1e-5)
    np.testing.assert_allclose(upd["batch_stats"]["var"], 0.9 + 0.1 * var * n / (n - 1), rtol=1e-5)
    evaluated = bn.apply({**variables, **upd}, jnp.asarray(x), train=False)  # eval: the running statistics
    want = (x64 - 0.1 * mean) / np.sqrt(0.9 + 0.1 * var * n / (n - 1) + 1e-5) * scale + bias
    np.testing.assert_allclose(np.asarray(evaluated).reshape(-1, 4), want, rtol=1e-5, atol=1e-5)


def _state_and_step(config):
    model = models.build(config.model, 10)
    tx, schedule = optim.build_optimizer(config, 4)
    variables = model.init(jax.random.key(0), jnp.zeros((1, 8, 8, 1)), train=False)
    state = common.TrainState(step=jnp.zeros((), jnp.int32), params=variables["params"],
                              opt_state=tx.init(variables["params"]), rng=jax.random.key(1),
                              nonfinite=nonfinite.init_nonfinite(), batch_stats=variables["batch_stats"])
    return model, state, supervised.make_train_step(model, tx, schedule, config)


def _batch(config):
    batch = next(inputs.train_iterator(config, 0, 0, 1))
    return {"image": jnp.asarray(batch["image"]), "label": jnp.asarray(batch["label"])}


@pytest.mark.slow
def test_the_step_updates_running_statistics_once_per_micro_batch():
    """One update with k = 2 strided micro-batches moves the statistics as two sequential BN
    updates on examples (0, 2, …) then (1, 3, …); with k = 1 as one update on the whole batch."""
    for k in (1, 2):
        config = _convmixer_config(grad_accum_steps=k)
        batch = _batch(config)
        model, state, step = _state_and_step(config)
        new_state, _ = jax.jit(step)(state, batch)
        stats = state.batch_stats
        bn_update = jax.jit(lambda p, s, x, m=model: m.apply({"params": p, "batch_stats": s}, x, train=True,
                                                             mutable=["batch_stats"])[1]["batch_stats"])
        for j in range(k):
            stats = bn_update(state.params, stats, batch["image"][j::k])
        close = lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6)
        jax.tree.map(close, new_state.batch_stats, stats)
        moved = jax.tree.map(lambda a, b: float(jnp.abs(a - b).max()), new_state.batch_stats, state.batch_stats)
        assert min(jax.tree.leaves(moved)) > 0


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("convmixer"))
    config = _convmixer_config()
    return config, workdir, supervised.train_and_evaluate(config, workdir)


@pytest.mark.slow
def test_trained_convmixer_is_evaluated_with_its_running_statistics(trained):
    config, workdir, metrics = trained
    _, state = checkpoint.load_raw(workdir)
    assert set(state["batch_stats"]) >= {"embedding_norm", "block_0_depthwise_norm", "block_1_pointwise_norm"}
    assert float(np.abs(state["batch_stats"]["embedding_norm"]["mean"]).max()) > 0  # updated from its zeros
    # The trainer's evaluation equals applying the model with the saved running statistics ...
    local, n = inputs.eval_iterator(config, 0, 1, "test", 360)
    batch = next(iter(local))
    keep = batch["mask"] > 0
    assert n == int(keep.sum()) == 360
    model = models.build(config.model, 10)
    logits = jax.jit(lambda v, x: model.apply(v, x, train=False)[0])(
        {"params": state["params"], "batch_stats": state["batch_stats"]}, jnp.asarray(batch["image"][keep]))
    accuracy = float((np.asarray(logits).argmax(-1) == batch["label"][keep].argmax(-1)).mean())
    assert metrics["test_accuracy"] == pytest.approx(accuracy, abs=1e-6)
    # ... and so does the evaluate command on the checkpoint.
    assert evaluate.evaluate(workdir)["test_accuracy"] == pytest.approx(accuracy, abs=1e-6)


@pytest.mark.slow
def test_init_from_loads_the_running_statistics(trained, tmp_path):
    """A run initialized from the trained one evaluates at step 0 exactly as that run ended: its
    parameters and its running statistics were both loaded."""
    config, workdir, metrics = trained
    follow = _convmixer_config(init_from=workdir, eval_at_start=True, total_steps=1)
    supervised.train_and_evaluate(follow, str(tmp_path))
    first = json.loads((tmp_path / "history.jsonl").read_text().splitlines()[0])
    assert first["step"] == 0
    assert first["init_test_loss"] == pytest.approx(metrics["test_loss"], rel=1e-5)
    assert first["init_test_accuracy"] == pytest.approx(metrics["test_accuracy"], abs=1e-6)


def test_triangular_schedule_equals_the_reference_interp():
    epochs, per_epoch, peak = 25, 7, 0.05
    schedule = optim.triangular(peak, epochs * per_epoch)
    got = np.asarray([schedule(t) for t in range(epochs * per_epoch)])
    want = [np.interp(e + (i + 1) / per_epoch, [0, epochs * 2 // 5, epochs * 4 // 5, epochs], [0, peak, peak / 20, 0])
            for e in range(epochs) for i in range(per_epoch)]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-9)
    config = load_config("convmixer_cifar10")
    assert config.schedule.name == "triangular"
    tx_schedule = optim.build_schedule(config, epochs * per_epoch)
    assert float(tx_schedule(10 * per_epoch - 1)) == pytest.approx(0.05)


@pytest.mark.parametrize("fields, match", [
    (dict(name="step"), r"config.schedule.name='step' is unknown; allowed: warmup_cosine, triangular"),
    (dict(name="triangular", warmup_steps=3), r"config.schedule.warmup_steps=3: the triangular schedule"),
    (dict(name="triangular", peak_at=0.9, fall_at=0.8), r"peak_at=0.9, fall_at=0.8"),
])
def test_bad_schedule_is_one_line(fields, match):
    config = _convmixer_config()
    config.schedule = ml_collections.ConfigDict({"warmup_steps": None, **fields})
    with pytest.raises(ValueError, match=match):
        validate.validate_config(config)
