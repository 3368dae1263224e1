"""Mixup / CutMix of the global batch inside the train step (data/device_mix.py): the mix for
given draws against a numpy reading of timm's batch mode, the draws' invariants, and a global
batch that does not depend on how many processes read it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from skipless_jax import config_blocks
from skipless_jax.data import device_mix, inputs

from util import tiny_config


def _batch(b=6, h=8, w=10, k=5):
    rng = np.random.default_rng(0)
    images = rng.normal(size=(b, h, w, 3)).astype(np.float32)
    labels = np.eye(k, dtype=np.float32)[rng.integers(0, k, b)]
    return images, labels


def test_mixup_for_given_draws_is_the_convex_mix_with_the_reversed_batch():
    images, labels = _batch()
    out, mixed = device_mix.apply(jnp.asarray(images), jnp.asarray(labels), jnp.float32(0.3), jnp.asarray(False),
                                  jnp.array([0, 0, 0, 0]))
    np.testing.assert_allclose(out, 0.3 * images + 0.7 * images[::-1], rtol=1e-6)
    np.testing.assert_allclose(mixed, 0.3 * labels + 0.7 * labels[::-1], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(mixed).sum(-1), 1.0, rtol=1e-6)


def test_cutmix_for_given_draws_pastes_the_box_and_corrects_lambda():
    images, labels = _batch()
    top, left, h, w = 2, 3, 4, 5
    out, mixed = device_mix.apply(jnp.asarray(images), jnp.asarray(labels), jnp.float32(0.9), jnp.asarray(True),
                                  jnp.array([top, left, h, w]))
    expected = images.copy()
    expected[:, top:top + h, left:left + w] = images[::-1][:, top:top + h, left:left + w]
    np.testing.assert_array_equal(out, expected)
    lam = 1 - h * w / (8 * 10)
    np.testing.assert_allclose(mixed, lam * labels + (1 - lam) * labels[::-1], rtol=1e-6)


@pytest.mark.parametrize("mixup, cutmix, prob", [(0.8, 0.0, 1.0), (0.0, 1.0, 1.0), (0.8, 1.0, 1.0), (0.8, 1.0, 0.0)])
def test_draws_follow_the_switches(mixup, cutmix, prob):
    lams, cuts = [], []
    for s in range(40):
        lam, use_cutmix, box = device_mix.draws(jax.random.PRNGKey(s), 8, 10, mixup, cutmix, 0.5, prob)
        top, left, h, w = np.asarray(box)
        assert top >= 0 and top + h <= 8 and left >= 0 and left + w <= 10
        assert h <= int(8 * np.sqrt(1 - float(lam))) and w <= int(10 * np.sqrt(1 - float(lam)))
        lams.append(float(lam))
        cuts.append(bool(use_cutmix))
    if prob == 0.0:
        assert lams == [1.0] * 40 and not any(cuts)
    else:
        assert all(0.0 <= v <= 1.0 for v in lams) and len(set(lams)) > 30
        assert any(cuts) == (cutmix > 0) and all(cuts) == (mixup == 0)


def _aug_config(mix_on=None):
    c = tiny_config()
    c.input.aug = ml_collections.ConfigDict(config_blocks.deit_aug(randaug=None, reprob=0.0))
    if mix_on is not None:
        c.input.aug.mix_on = mix_on
    return c


def _global_batch(mix_on: str, process_count: int, num_workers: int = 0, on_device: bool = False,
                  reprob: float = 0.0) -> dict:
    """Step 3's global batch of the train pipeline over 40 RGB 8×8 images, the processes' local
    batches concatenated, with the config's transforms."""
    from skipless_jax.data import pipeline, sources

    c = _aug_config(mix_on)
    c.input.aug.reprob = reprob
    rng = np.random.default_rng(0)
    source = sources.ArraySource(rng.integers(0, 256, (40, 8, 8, 3)).astype(np.uint8), rng.integers(0, 10, 40))
    c.dataset.name = "cifar10"  # 3 channels, stored at 32: the transforms resize and crop
    c.input.image_size = 8
    transform, _, batch_transform = inputs._transforms(c, on_device)
    local = [next(pipeline.train_batches(source, transform, num_classes=10, global_batch_size=8, seed=0, start_step=3,
                                         process_index=p, process_count=process_count,
                                         batch_transform=batch_transform, num_workers=num_workers))
             for p in range(process_count)]
    return {k: np.concatenate([b[k] for b in local]) for k in local[0]}


def test_the_step_input_after_erasing_and_mixing_is_the_same_for_any_processes_and_workers():
    """uint8 + erasing boxes from the pipeline, then the train step's prologue (normalize, erase,
    mix from (seed, step) keys): 1 process reading in-process and 2 processes with 2 worker
    processes each give the same images and labels."""
    from skipless_jax.data import device_images

    c = _aug_config()
    mean, std = device_images.dataset_stats(ml_collections.ConfigDict({"dataset": {"name": "cifar10"}}))
    key = jax.random.PRNGKey(5)

    def step_input(batch):
        batch = device_images.prepare({k: jnp.asarray(v) for k, v in batch.items()}, mean, std,
                                      jax.random.fold_in(key, 1))
        return device_mix.mixup_cutmix(jax.random.fold_in(key, 2), batch["image"], batch["label"], c.input.aug)

    one = _global_batch("device", 1, on_device=True, reprob=0.5)
    two = _global_batch("device", 2, num_workers=2, on_device=True, reprob=0.5)
    assert one["image"].dtype == np.uint8 and one["erase"][:, 2].any()  # some boxes
    for a, b in zip(step_input(one), step_input(two)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_the_global_batch_before_the_step_does_not_depend_on_the_process_count():
    """With mixing on the device the pipeline's global batch at step s is the same for 1 and 2
    processes (the mix is then a function of it and (seed, step)); the host mix is not."""
    assert device_mix.enabled(_aug_config()) and not device_mix.enabled(_aug_config("host"))
    one, two = _global_batch("device", 1), _global_batch("device", 2)
    for key in ("image", "label"):
        np.testing.assert_array_equal(two[key], one[key])
    np.testing.assert_array_equal(one["label"].max(-1), 1.0)  # one-hot: not mixed on the host
    host_one, host_two = _global_batch("host", 1), _global_batch("host", 2)
    assert not np.array_equal(host_one["label"], host_two["label"])  # each process mixed its own half


def test_bad_mix_on_is_a_one_line_error():
    from skipless_jax.trainers import supervised

    c = _aug_config("gpu")
    with pytest.raises(ValueError, match=r"aug\.mix_on='gpu' is unknown; allowed: \['device', 'host'\]"):
        supervised.check_config(c)
