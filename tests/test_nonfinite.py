"""A non-finite loss stops the run naming the step (last good checkpoint kept), or is skipped."""

import numpy as np
import pytest

from skipless_jax import checkpoint, train

from util import tiny_config


def _exploding(**kw):
    # Warm-up makes the first lr zero; the second update (~1e29) overflows the third forward pass.
    config = tiny_config(total_steps=6, log_every_steps=1, checkpoint_every_steps=1, **kw)
    config.optimizer.lr = 1e30
    config.grad_clip_norm = None
    return config


def test_nonfinite_loss_stops_naming_the_step_and_keeps_last_good_checkpoint(tmp_path):
    with pytest.raises(train.NonFiniteError, match=r"Non-finite loss or gradient at step 3 \(first offending parameter: .+\); stopped at step 3, last good checkpoint: 2") as err:
        train.train_and_evaluate(_exploding(), str(tmp_path))
    assert "\n" not in str(err.value)
    mngr = checkpoint.manager(str(tmp_path))
    assert max(mngr.all_steps()) == 2  # the state after updates 1 and 2; nothing later was saved
    mngr.close()
    _, state = checkpoint.load_raw(str(tmp_path))
    assert all(np.isfinite(np.asarray(x)).all() for x in __import__("jax").tree.leaves(state["params"]))


def test_skip_nonfinite_steps_counts_and_keeps_params_finite(tmp_path):
    metrics = train.train_and_evaluate(_exploding(skip_nonfinite_steps=True), str(tmp_path))
    assert metrics["step"] == 6
    assert metrics["train_nonfinite_steps"] == 4  # steps 3..6 skipped
    _, state = checkpoint.load_raw(str(tmp_path))
    assert int(state["nonfinite"]["first_step"]) == 3
    assert all(np.isfinite(np.asarray(x)).all() for x in __import__("jax").tree.leaves(state["params"]))
