"""The functions issue 56 found mutating their arguments now leave them as given: called with
inputs that would raise on a write (a FrozenConfigDict, a frozen train state), they return new
values equal to the ones the in-place versions produced."""

from __future__ import annotations

import dataclasses
import types

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax


def test_apply_init_self_share_leaves_the_config_as_given():
    from skipless_jax import models
    from skipless_jax.data import inputs
    from skipless_jax.models import init as init_lib

    from util import load_config

    config = load_config("quickstart", "self_share=0.5")
    image_size = inputs.image_size(config)
    before = config.model.to_dict()
    frozen = ml_collections.FrozenConfigDict(config.model)  # a write raises
    digest = hash(frozen)
    derived, beta = models.apply_init_self_share(frozen, image_size)
    assert hash(frozen) == digest
    # the β of the search on the given config, in a new config that differs from it in init_beta only
    assert beta == init_lib.self_share_beta(config.model, models.num_tokens(config.model, image_size), 0.5)
    assert derived.init_beta == beta != before["init_beta"]
    assert {**derived.to_dict(), "init_beta": before["init_beta"]} == before
    derived, beta = models.apply_init_self_share(config.model, image_size)  # a mutable config: still unchanged
    assert config.model.to_dict() == before and derived is not config.model and derived.init_beta == beta
    config.model.init_self_share = None  # without a target: the config itself and no β
    assert models.apply_init_self_share(config.model, image_size) == (config.model, None)


def test_warm_start_loader_returns_a_new_state(monkeypatch):
    from skipless_jax import pretrained
    from skipless_jax.trainers import dino, nonfinite, warm_start

    loaded = {"w": jnp.full((2, 3), 7.0)}
    calls = []

    def init_from(path, params, shardings, key, names):  # the source run's parameters, no file read
        calls.append((path, key))
        return loaded

    monkeypatch.setattr(pretrained, "init_from", init_from)
    config = ml_collections.ConfigDict(dict(init_from="/source/run", init_from_key=None))
    tx = optax.adam(1e-3)
    params = {"w": jnp.zeros((2, 3))}
    state = dino.DinoState(params=params, opt_state=tx.init(params), teacher={"w": jnp.ones((2, 3))}, step=0,
                           center=jnp.zeros((1, 4)), rng=jax.random.PRNGKey(0), schedules={},
                           nonfinite=nonfinite.init_nonfinite())  # frozen: a write raises
    given = {f.name: getattr(state, f.name) for f in dataclasses.fields(state)}
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    out = warm_start.loader(config, tx, types.SimpleNamespace(params=device, opt_state=device))(state)
    assert all(getattr(state, k) is given[k] for k in given)  # the same entries, untouched
    assert calls == [("/source/run", "params")] and out is not state
    np.testing.assert_array_equal(out.params["w"], loaded["w"])
    np.testing.assert_array_equal(out.teacher["w"], loaded["w"])  # DINO's teacher = the loaded student
    assert out.teacher["w"] is not out.params["w"]
    assert jax.tree.structure(out.opt_state) == jax.tree.structure(tx.init(loaded)) and out.step == 0
    np.testing.assert_array_equal(jax.tree.leaves(out.opt_state)[0], 0)  # a fresh optimizer state
