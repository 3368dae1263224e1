"""Mixup / CutMix per data shard inside the train step (data/device_mix.py): the mix for given
draws against a numpy reading of timm's batch mode on each shard, the draws' invariants and
keys, and a global batch that does not depend on how many processes read it."""

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


def _timm_batch_mode(x, y, lam, use_cutmix, box):
    """timm `Mixup._mix_batch` + `mixup_target` on one local batch (NHWC numpy, float64), for
    given λ, switch and box (timm's `rand_bbox` corners yl, yh, xl, xh = top, top+h, left, left+w)."""
    x, y = x.astype(np.float64), y.astype(np.float64)
    if use_cutmix:
        top, left, h, w = box
        x = x.copy()
        x[:, top:top + h, left:left + w] = x[::-1][:, top:top + h, left:left + w]
        lam = 1.0 - h * w / float(x.shape[1] * x.shape[2])  # correct_lam
    else:
        x = x * lam + x[::-1] * (1.0 - lam)
    return x, y * lam + y[::-1] * (1.0 - lam)


def test_the_mix_is_timm_batch_mode_on_each_shard():
    """4 shards of 3 images, each with its own λ / switch / box: each shard equals timm's batch
    mode on that shard alone (pairs within it), float64 reference."""
    images, labels = _batch(b=12)
    lam = np.array([0.3, 0.9, 0.55, 1.0], np.float32)
    use_cutmix = np.array([False, True, True, False])
    box = np.array([[0, 0, 0, 0], [2, 3, 4, 5], [1, 0, 7, 10], [0, 0, 0, 0]], np.int32)
    out, mixed = device_mix.apply_per_shard(jnp.asarray(images), jnp.asarray(labels), jnp.asarray(lam),
                                            jnp.asarray(use_cutmix), jnp.asarray(box))
    for s in range(4):
        rows = slice(3 * s, 3 * s + 3)
        x, y = _timm_batch_mode(images[rows], labels[rows], float(lam[s]), bool(use_cutmix[s]), box[s])
        np.testing.assert_allclose(np.asarray(out)[rows], x, rtol=1e-6, atol=1e-6, err_msg=f"shard {s}")
        np.testing.assert_allclose(np.asarray(mixed)[rows], y, rtol=1e-6, atol=1e-6, err_msg=f"shard {s}")


@pytest.mark.slow
def test_each_shard_draws_from_the_key_folded_with_its_index():
    """Shard s's (λ, switch, box) are `draws(fold_in(key, s))`; mixup_cutmix with S shards is
    apply_per_shard of them; S = 1 is the one-batch mix; shards that do not divide the batch
    are a one-line error."""
    images, labels = _batch(b=8)
    aug = ml_collections.ConfigDict(config_blocks.deit_aug(randaug=None))
    key = jax.random.PRNGKey(7)
    lam, cut, box = device_mix.shard_draws(key, 4, 8, 10, aug)
    for s in range(4):
        one = device_mix.draws(jax.random.fold_in(key, s), 8, 10, 0.8, 1.0, 0.5, 1.0)
        for got, want in zip((lam[s], cut[s], box[s]), one):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert len(set(np.asarray(lam).tolist())) == 4  # independent draws per shard
    out, mixed = device_mix.mixup_cutmix(key, jnp.asarray(images), jnp.asarray(labels), aug, shards=4)
    want = device_mix.apply_per_shard(jnp.asarray(images), jnp.asarray(labels), lam, cut, box)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(want[0]))
    np.testing.assert_array_equal(np.asarray(mixed), np.asarray(want[1]))
    single = device_mix.apply(jnp.asarray(images), jnp.asarray(labels),
                              *device_mix.draws(jax.random.fold_in(key, 0), 8, 10, 0.8, 1.0, 0.5, 1.0))
    np.testing.assert_array_equal(np.asarray(device_mix.mixup_cutmix(key, jnp.asarray(images), jnp.asarray(labels),
                                                                     aug, shards=1)[0]), np.asarray(single[0]))
    with pytest.raises(ValueError, match="a batch of 8 images does not split into 3 equal mixing shards"):
        device_mix.mixup_cutmix(key, jnp.asarray(images), jnp.asarray(labels), aug, shards=3)


@pytest.mark.slow
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


def test_switch_prob_picks_cutmix_that_often():
    cuts = [bool(device_mix.draws(jax.random.PRNGKey(s), 8, 10, 0.8, 1.0, 0.5, 1.0)[1]) for s in range(200)]
    assert 70 <= sum(cuts) <= 130  # Binomial(200, 0.5): ±4 σ


def test_mixup_cutmix_from_the_config_is_deterministic_and_mixup_prob_acts():
    """The config entry point: the same key gives the same mix; labels stay distributions (no
    smoothing inside: the loss applies it); mixup_prob 0 never mixes."""
    images, labels = _batch()
    aug = ml_collections.ConfigDict(config_blocks.deit_aug(randaug=None))
    key = jax.random.PRNGKey(3)
    out, mixed = device_mix.mixup_cutmix(key, jnp.asarray(images), jnp.asarray(labels), aug)
    again, mixed_again = device_mix.mixup_cutmix(key, jnp.asarray(images), jnp.asarray(labels), aug)
    np.testing.assert_array_equal(out, again)
    np.testing.assert_array_equal(mixed, mixed_again)
    np.testing.assert_allclose(np.asarray(mixed).sum(-1), 1.0, rtol=1e-6)
    assert not np.array_equal(np.asarray(out), images)
    aug.mixup_prob = 0.0
    out, mixed = device_mix.mixup_cutmix(key, jnp.asarray(images), jnp.asarray(labels), aug)
    np.testing.assert_array_equal(out, images)
    np.testing.assert_array_equal(mixed, labels)


def _aug_config():
    c = tiny_config()
    c.input.aug = ml_collections.ConfigDict(config_blocks.deit_aug(randaug=None, reprob=0.0))
    return c


def _global_batch(process_count: int, num_workers: int = 0, on_device: bool = False, reprob: float = 0.0) -> dict:
    """Step 3's global batch of the train pipeline over 40 RGB 8×8 images, the processes' local
    batches concatenated, with the config's transforms."""
    from skipless_jax.data import pipeline, record_sources

    c = _aug_config()
    c.input.aug.reprob = reprob
    rng = np.random.default_rng(0)
    source = record_sources.ArraySource(rng.integers(0, 256, (40, 8, 8, 3)).astype(np.uint8), rng.integers(0, 10, 40))
    c.dataset.name = "cifar10"  # 3 channels, stored at 32: the transforms resize and crop
    c.input.image_size = 8
    transform, _ = inputs.image_transforms(c, on_device)
    local = [next(pipeline.train_batches(source, transform, num_classes=10, global_batch_size=8, seed=0, start_step=3,
                                         process_index=p, process_count=process_count, num_workers=num_workers))
             for p in range(process_count)]
    return {k: np.concatenate([b[k] for b in local]) for k in local[0]}


@pytest.mark.slow
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

    one = _global_batch(1, on_device=True, reprob=0.5)
    two = _global_batch(2, num_workers=2, on_device=True, reprob=0.5)
    assert one["image"].dtype == np.uint8 and one["erase"][:, 2].any()  # some boxes
    for a, b in zip(step_input(one), step_input(two)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_the_global_batch_before_the_step_does_not_depend_on_the_process_count():
    """The pipeline's global batch at step s is the same for 1 and 2 processes (the mix is then a
    function of it and (seed, step)), and not mixed: one-hot labels."""
    assert device_mix.enabled(_aug_config())
    no_mix = _aug_config()
    no_mix.input.aug.update(mixup=0.0, cutmix=0.0)
    assert not device_mix.enabled(no_mix)
    one, two = _global_batch(1), _global_batch(2)
    for key in ("image", "label"):
        np.testing.assert_array_equal(two[key], one[key])
    np.testing.assert_array_equal(one["label"].max(-1), 1.0)


def test_the_removed_mix_on_field_is_a_one_line_error():
    from skipless_jax.trainers import supervised

    c = _aug_config()
    c.input.aug.mix_on = "host"
    with pytest.raises(ValueError, match=r"aug\.mix_on='host' is no longer a field: mixup/cutmix always run on the "
                                         r"device"):
        supervised.check_config(c)


@pytest.mark.parametrize("batch_size,rows", [(8, 1), (24, 3)])
def test_mixing_odd_or_single_rows_per_device_is_refused(batch_size, rows):
    from skipless_jax.trainers import supervised

    c = _aug_config()
    c.input.batch_size = batch_size
    with pytest.raises(ValueError, match=rf"^config\.input\.aug mixup/cutmix pair each device's rows .* "
                                         rf"config\.input\.batch_size={batch_size} gives {rows} rows on each of "
                                         r"the 8 data-parallel devices .*; allowed batch sizes: multiples of 16 "
                                         r"\(16, 32, 48, \.\.\.\)$"):
        supervised.check_config(c, 8)
    supervised.check_config(c, 4)  # 2 or 6 rows on each of 4 devices
    c.input.aug.update(mixup=0.0, cutmix=0.0)
    supervised.check_config(c, 8)  # no mix: any divisible batch
