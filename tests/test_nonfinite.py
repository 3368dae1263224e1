"""A non-finite loss stops the run naming the step (last good checkpoint kept), or is skipped."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from skipless_jax import checkpoint
from skipless_jax.trainers import common, nonfinite, supervised

from util import one_device, tiny_config


@pytest.mark.parametrize("loss", [1.0, float("nan")])
def test_guarded_update_passes_every_entry_through(loss):
    """A field guarded_update does not update (here `ema`, which the trainer moves after it, and
    `rng`) survives the update whole, kept or rejected; a rejected one keeps params and optimizer state."""
    tx = optax.sgd(0.5)
    params = {"w": jnp.ones(3)}
    state = common.TrainState(step=jnp.int32(7), params=params, opt_state=tx.init(params),
                              rng=jax.random.PRNGKey(1), nonfinite=nonfinite.init_nonfinite(),
                              ema={"params": {"w": jnp.arange(3.0)}})
    new, metrics = nonfinite.guarded_update(state, jnp.float32(loss), {"w": jnp.full(3, 2.0)}, tx, lambda s: 0.5)
    assert type(new) is common.TrainState and new.batch_stats is None
    jax.tree.map(np.testing.assert_array_equal, new.ema, state.ema)
    np.testing.assert_array_equal(new.rng, state.rng)
    assert int(new.step) == 8
    kept = np.isfinite(loss)
    np.testing.assert_array_equal(new.params["w"], np.zeros(3) if kept else np.ones(3))
    assert int(metrics["nonfinite_steps"]) == int(new.nonfinite.count) == (0 if kept else 1)


def _exploding(opt="adamw", **kw):
    # Warm-up makes the first lr zero; the second update (~1e29) overflows the third forward pass.
    config = tiny_config(f"opt={opt}", total_steps=6, log_every_steps=1, checkpoint_every_steps=1, **kw)
    config.optimizer.lr = 1e30
    config.grad_clip_norm = None
    return config


@pytest.mark.slow
def test_nonfinite_loss_stops_naming_the_step_and_keeps_last_good_checkpoint(tmp_path):
    with pytest.raises(
        nonfinite.NonFiniteError,
        match=r"Non-finite values at step 3 \(first: .+\); stopped at step 3, last good checkpoint: 2",
    ) as err:
        supervised.train_and_evaluate(_exploding(), str(tmp_path), devices=one_device())
    assert "\n" not in str(err.value)
    mngr = checkpoint.manager(str(tmp_path))
    assert max(mngr.all_steps()) == 2  # the state after updates 1 and 2; nothing later was saved
    mngr.close()
    _, state = checkpoint.load_raw(str(tmp_path))
    assert all(np.isfinite(np.asarray(x)).all() for x in __import__("jax").tree.leaves(state["params"]))


@pytest.mark.slow
def test_skip_nonfinite_steps_counts_and_keeps_params_finite(tmp_path):
    metrics = supervised.train_and_evaluate(_exploding(skip_nonfinite_steps=True), str(tmp_path), devices=one_device())
    assert metrics["step"] == 6
    assert metrics["train_nonfinite_steps"] == 4  # steps 3..6 skipped
    _, state = checkpoint.load_raw(str(tmp_path))
    assert int(state["nonfinite"]["first_step"]) == 3
    assert all(np.isfinite(np.asarray(x)).all() for x in __import__("jax").tree.leaves(state["params"]))


def _all_finite(tree):
    return all(
        np.isfinite(np.asarray(x)).all()
        for x in jax.tree.leaves(tree)
        if np.issubdtype(np.asarray(x).dtype, np.inexact)
    )


@pytest.mark.slow
def test_soap_with_a_huge_lr_never_saves_infinite_parameters(tmp_path):
    """SOAP turns finite gradients into infinite parameters at lr 1e30: the guard checks what the
    optimizer produced, so no checkpoint ("last good" or later) holds a non-finite value."""
    with pytest.raises(
        nonfinite.NonFiniteError, match=r"Non-finite values at step (\d+) \(first: (parameter|optimizer state) .+\)"
    ) as err:
        supervised.train_and_evaluate(_exploding(opt="soap"), str(tmp_path), devices=one_device())
    assert "\n" not in str(err.value)
    mngr = checkpoint.manager(str(tmp_path))
    steps = mngr.all_steps()
    mngr.close()
    assert steps
    for step in steps:
        _, state = checkpoint.load_raw(str(tmp_path), step)
        assert _all_finite(state["params"]) and _all_finite(state["opt_state"]), step


@pytest.mark.slow
def test_soap_skip_nonfinite_steps_finishes_with_finite_parameters(tmp_path):
    metrics = supervised.train_and_evaluate(_exploding(opt="soap", skip_nonfinite_steps=True), str(tmp_path),
                                            devices=one_device())
    assert metrics["step"] == 6 and metrics["train_nonfinite_steps"] >= 1
    _, state = checkpoint.load_raw(str(tmp_path))
    assert _all_finite(state["params"]) and _all_finite(state["opt_state"])
