"""Data-parallel and FSDP on 8 fake CPU devices equal one device; shardings are the intended ones."""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from skipless_jax import checkpoint, sharding
from skipless_jax.trainers import supervised

from util import tiny_config


def _final_state(tmp_path, name, mesh, devices):
    config = tiny_config(total_steps=5, log_every_steps=5)
    config.mesh = mesh
    metrics = supervised.train_and_evaluate(config, str(tmp_path / name), devices=devices)
    return metrics, checkpoint.load_raw(str(tmp_path / name))[1]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return _final_state(tmp_path_factory.mktemp("ref"), "one", {"data": 1}, jax.devices()[:1])


@pytest.mark.slow
@pytest.mark.parametrize("mesh", [{"data": 8, "fsdp": 1}, {"data": 2, "fsdp": 4}], ids=["dp8", "fsdp2x4"])
def test_multi_device_equals_one_device(tmp_path, reference, mesh):
    ref_metrics, ref_state = reference
    metrics, state = _final_state(tmp_path, "multi", mesh, jax.devices())
    np.testing.assert_allclose(metrics["train_loss"], ref_metrics["train_loss"], rtol=1e-5)
    np.testing.assert_allclose(metrics["test_loss"], ref_metrics["test_loss"], rtol=1e-5)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), state["params"], ref_state["params"]
    )


def test_fsdp_rules_shard_largest_divisible_dim_and_optimizer_state_follows():
    mesh = sharding.make_mesh([("data", 2), ("fsdp", 4)])
    import optax

    params = {
        "dense": {"kernel": jax.ShapeDtypeStruct((6, 16), np.float32), "bias": jax.ShapeDtypeStruct((16,), np.float32)},
        "norm": {"scale": jax.ShapeDtypeStruct((3,), np.float32)},
    }
    state = {"params": params, "opt_state": jax.eval_shape(optax.adamw(1e-3).init, params)}
    shardings = sharding.tree_shardings(state, mesh, [(".*", "fsdp")])
    assert shardings["params"]["dense"]["kernel"].spec == P(None, "fsdp")  # 16 % 4 == 0, 6 % 4 != 0
    assert shardings["params"]["dense"]["bias"].spec == P("fsdp")
    assert shardings["params"]["norm"]["scale"].spec == P()  # 3 is not divisible: replicated
    mu = shardings["opt_state"][0].mu
    assert mu["dense"]["kernel"].spec == P(None, "fsdp")
    assert shardings["opt_state"][0].count.spec == P()
    # Explicit rules win in order; a replicate rule for norms.
    rules = [("norm/", "replicate"), ("kernel", (("fsdp",), None)), (".*", "fsdp")]
    wide = {**params, "dense": {**params["dense"], "kernel": jax.ShapeDtypeStruct((8, 16), np.float32)}}
    explicit = sharding.tree_shardings(wide, mesh, rules)
    assert explicit["dense"]["kernel"].spec == P(("fsdp",), None)
    assert explicit["norm"]["scale"].spec == P()
    # An explicit rule that cannot be placed (6 rows over fsdp=4) is a one-line error, not a silent fallback.
    with pytest.raises(ValueError, match=r"dense/kernel") as err:
        sharding.tree_shardings(params, mesh, rules)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "mesh, devices, match",
    [
        ([("data", 3)], 8, r"config.mesh.data=3 is 3 devices but 8 are available"),
        ([("data", -1), ("fsdp", 3)], 8, r"config.mesh.fsdp=3 does not divide the 8 devices"),
        ([("model", 8)], 8, r"config.mesh.model .* is an unknown mesh axis; allowed: data, fsdp"),
        ([("data", -1), ("fsdp", -1)], 8, r"at most one axis may be -1"),
        ({"data": 2, "fsdp": 2}, 8, r"config.mesh.data=2 × config.mesh.fsdp=2 is 4 devices but 8 are available"),
        ({"data": -1, "fsdp": 3}, 8, r"config.mesh.fsdp=3 does not divide the 8 devices"),
        ({"data": -1, "model": 2}, 8, r"config.mesh.model=2 is an unknown mesh axis; allowed: data, fsdp"),
        ({"data": -1, "fsdp": 0}, 8, r"config.mesh.fsdp=0 must be a positive integer, or -1"),
        ({"data": -1, "fsdp": 2.0}, 8, r"config.mesh.fsdp=2.0 must be a positive integer"),
        ({"data": -1, "fsdp": -1}, 8, r"config.mesh.data=-1 and config.mesh.fsdp=-1: at most one axis may be -1"),
    ],
)
def test_mesh_mismatch_is_one_line(mesh, devices, match):
    with pytest.raises(ValueError, match=match):
        sharding.mesh_shape(mesh, devices)
