"""uint8 from the host, normalized and randomly erased on the device (data/device_images.py),
against the host chain it replaces (`augment.TrainTransform` with uint8=False), and the
normalization of the evaluation batches."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from skipless_jax.data import augment, device_images, inputs, pipeline, transforms

from util import load_config

MEAN, STD = transforms.IMAGENET_MEAN, transforms.IMAGENET_STD


def _aug(reprob=1.0):
    return dict(randaug="rand-m9-mstd0.5-inc1", scale=(0.08, 1.0), flip=True, reprob=reprob, mixup=0.0, cutmix=0.0,
                mixup_switch_prob=0.5)


def test_normalize_equals_the_host_normalize_and_passes_floats():
    u = np.random.default_rng(0).integers(0, 256, (4, 6, 5, 3), dtype=np.uint8)
    out = device_images.normalize(jnp.asarray(u), MEAN, STD)
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(out, pipeline.normalize(u, MEAN, STD), rtol=1e-6, atol=1e-6)
    x = jnp.ones((2, 3), jnp.float32)
    assert device_images.normalize(x, MEAN, STD) is x


def test_device_chain_matches_the_host_transform_outside_the_box_and_erases_the_same_box():
    host = augment.train_transform(_aug(reprob=0.6), 24, MEAN, STD)
    wire = dataclasses.replace(host, uint8=True)
    image = np.random.default_rng(1).integers(0, 256, (40, 52, 3), dtype=np.uint8)
    erased = 0
    for seed in range(12):
        reference = host(image, np.random.default_rng(seed))
        shipped = wire(image, np.random.default_rng(seed))
        assert shipped["image"].dtype == np.uint8 and shipped["erase"].dtype == np.int32
        out = device_images.prepare({k: jnp.asarray(v)[None] for k, v in shipped.items()}, MEAN, STD,
                                    jax.random.PRNGKey(seed))
        assert set(out) == {"image"}
        got = np.asarray(out["image"][0])
        top, left, h, w = shipped["erase"]
        box = np.zeros((24, 24, 1), bool)
        box[top:top + h, left:left + w] = True
        np.testing.assert_allclose(np.where(box, 0, got), np.where(box, 0, reference), rtol=1e-5, atol=1e-5)
        plain = pipeline.normalize(shipped["image"], MEAN, STD)
        # the host reference replaced exactly the same box (by its own noise)
        np.testing.assert_array_equal(np.any(~np.isclose(reference, plain, atol=1e-5), -1, keepdims=True), box)
        if h:
            erased += 1
            inside = got[top:top + h, left:left + w]
            assert abs(inside.mean()) < 0.5 and 0.6 < inside.std() < 1.4  # N(0, 1) noise
    assert 3 <= erased <= 11  # p = 0.6 of 12


def test_erasing_noise_does_not_depend_on_the_number_of_devices():
    rng = np.random.default_rng(0)
    batch = {"image": rng.integers(0, 256, (8, 12, 12, 3), dtype=np.uint8),
             "erase": np.tile(np.array([[2, 3, 5, 4]], np.int32), (8, 1))}
    key = jax.random.PRNGKey(7)
    one = jax.jit(lambda b: device_images.prepare(b, MEAN, STD, key))(batch)["image"]
    mesh = jax.make_mesh((8,), ("data",))
    spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    eight = jax.jit(lambda b: device_images.prepare(b, MEAN, STD, key))(jax.device_put(batch, spec))["image"]
    assert len(eight.sharding.device_set) == 8
    np.testing.assert_array_equal(np.asarray(one), np.asarray(eight))


def test_a_batch_with_boxes_needs_a_key():
    with pytest.raises(ValueError, match="needs a key"):
        device_images.prepare({"image": jnp.zeros((1, 4, 4, 3), jnp.uint8), "erase": jnp.zeros((1, 4), jnp.int32)},
                              MEAN, STD)


def test_the_config_iterators_ship_uint8_that_normalizes_to_the_host_batches():
    config = load_config("quickstart")
    config.input.batch_size = 16
    host = next(inputs.train_iterator(config, 3, 0, 1))
    wire = next(inputs.train_iterator(config, 3, 0, 1, on_device=True))
    assert wire["image"].dtype == np.uint8 and host["image"].dtype == np.float32
    np.testing.assert_allclose(device_images.prepare(wire, *device_images.dataset_stats(config))["image"],
                               host["image"], rtol=1e-6, atol=1e-6)
    host_eval = next(inputs.eval_iterator(config, 0, 1)[0])
    wire_eval = next(inputs.eval_iterator(config, 0, 1, on_device=True)[0])
    assert wire_eval["image"].dtype == np.uint8
    np.testing.assert_allclose(device_images.prepare(wire_eval, *device_images.dataset_stats(config))["image"],
                               host_eval["image"], rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(wire_eval["mask"], host_eval["mask"])
