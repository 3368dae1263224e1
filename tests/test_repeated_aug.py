"""Repeated augmentation (DeiT's RASampler) and whole-batch epochs in the train stream
(data/pipeline.py, docs/method/recipes.md §21): the stream's structure against a plain reading of the
RASampler, epoch lengths and steps per epoch, and the same stream on any number of processes
and worker processes."""

from __future__ import annotations

import dataclasses

import grain
import numpy as np
import pytest

from skipless_jax.data import inputs, pipeline, record_sources

from util import load_config

N, R, B, SEED = 600, 3, 24, 5  # an epoch of ⌊600/256⌋·256 = 512 positions


@dataclasses.dataclass(frozen=True)
class _Draw:
    """A 'transform' that ships one draw of the example's augmentation rng (picklable, for
    worker processes); the record's label is its index, so the batch names the image too."""

    def __call__(self, image: np.ndarray, rng: np.random.Generator) -> dict[str, np.ndarray]:
        return {"image": image, "draw": np.float32(rng.random())}


def _stream(steps, *, repeats=R, drop_last=False, batch=B, start_step=0, process_index=0, process_count=1,
            num_workers=0, n=N, shards=1):
    """(image indices, augmentation draws) of the global positions [start_step·B, (start_step +
    steps)·B) as process `process_index` of `process_count` reads them."""
    source = record_sources.ArraySource(np.zeros((n, 1, 1, 1), np.uint8), np.arange(n))
    it = pipeline.train_batches(source, _Draw(), num_classes=n, global_batch_size=batch, seed=SEED,
                                start_step=start_step, process_index=process_index, process_count=process_count,
                                num_workers=num_workers, repeats=repeats, drop_last=drop_last, shards=shards)
    batches = [next(it) for _ in range(steps)]
    return (np.concatenate([b["label"].argmax(-1) for b in batches]),
            np.concatenate([b["draw"] for b in batches]))


def _order(epoch, n=N):
    """Epoch e's image order, read directly from the seeded per-epoch shuffle (the r = 1 stream)."""
    images = grain.MapDataset.range(n).shuffle(seed=SEED).repeat(None)
    return np.array([images[epoch * n + k] for k in range(n)])


def test_epoch_length_is_deits_num_selected_samples_and_whole_batches():
    assert pipeline.epoch_length(1281167, 3) == 1281024  # ImageNet: ⌊N/256⌋·256
    assert pipeline.epoch_length(1281167, 1) == 1281167
    assert pipeline.epoch_length(1281167, 3, 1000) == 1281000  # and whole global batches
    assert pipeline.epoch_length(1281167, 1, 1024) == 1251 * 1024
    assert pipeline.epoch_length(600, 2) == 512


@pytest.mark.parametrize("repeats, match", [(0, "repeated_augmentation=0"), (True, "repeated_augmentation=True"),
                                            (2.0, "repeated_augmentation=2.0")])
def test_bad_repeats_are_one_line(repeats, match):
    with pytest.raises(ValueError, match=match):
        pipeline.epoch_length(600, repeats)


def test_a_split_too_small_for_an_epoch_is_refused():
    with pytest.raises(ValueError, match="holds no sample"):
        pipeline.epoch_length(255, 3)
    with pytest.raises(ValueError, match="holds no sample"):
        pipeline.epoch_length(20, 1, 32)


def test_copies_are_adjacent_differently_augmented_and_follow_the_rasampler():
    steps = 512 // B + 3  # one epoch and some of the next
    ids, draws = _stream(steps)
    length = pipeline.epoch_length(N, R)
    # The reference: DeiT's RASampler with one replica, epoch e's indices
    # repeat_interleave(perm_e, r)[:⌊N/256⌋·256], epochs one after the other.
    expected = np.concatenate([np.repeat(_order(e), R)[:length] for e in range(2)])[: steps * B]
    np.testing.assert_array_equal(ids, expected)
    first = ids[:length]
    assert len(np.unique(first)) == -(-length // R) == 171  # ≈ N/r distinct images per epoch
    groups = first[: length // R * R].reshape(-1, R)
    assert (groups == groups[:, :1]).all()  # r copies next to each other
    d = draws[: length // R * R].reshape(-1, R)
    assert (np.diff(np.sort(d, axis=1), axis=1) > 0).all()  # each copy augmented differently
    assert not np.array_equal(_order(0)[:20], _order(1)[:20])  # each epoch its own order


def test_one_repeat_is_the_plain_stream():
    ids, _ = _stream(5, repeats=1)
    images = grain.MapDataset.range(N).shuffle(seed=SEED).repeat(None)
    np.testing.assert_array_equal(ids, [images[i] for i in range(5 * B)])


def test_drop_last_starts_each_epoch_on_a_batch_boundary():
    n, batch = 100, 24  # 4 whole batches (96 positions), the other 4 images unused each epoch
    ids, _ = _stream(6, repeats=1, drop_last=True, batch=batch, n=n)
    np.testing.assert_array_equal(ids[:96], _order(0, n)[:96])
    np.testing.assert_array_equal(ids[96:], _order(1, n)[:48])


@pytest.mark.slow
@pytest.mark.parametrize("processes, workers", [(2, 0), (2, 2), (3, 1)])
def test_the_repeated_stream_is_the_same_on_any_process_and_worker_count(processes, workers):
    batch = 24
    whole_ids, whole_draws = _stream(4, batch=batch, start_step=19)  # across the epoch boundary at 512
    parts = [_stream(4, batch=batch, start_step=19, process_index=p, process_count=processes, num_workers=workers)
             for p in range(processes)]
    local = batch // processes
    for p, (ids, draws) in enumerate(parts):
        rows = np.concatenate([np.arange(s * batch + p * local, s * batch + (p + 1) * local) for s in range(4)])
        np.testing.assert_array_equal(ids, whole_ids[rows])
        np.testing.assert_array_equal(draws, whole_draws[rows])


def test_the_copies_of_an_image_are_on_different_devices_of_8():
    import jax

    from skipless_jax import sharding
    from skipless_jax.data import device_input

    assert jax.device_count() == 8
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    steps, shards = 3, 8
    plain_ids, plain_draws = _stream(steps, batch=B, shards=1)
    ids, draws = _stream(steps, batch=B, shards=shards)
    # The same positions of the (seed, position) stream, placed by row (k mod S)·B/S + ⌊k/S⌋.
    k = np.arange(B)
    rows = np.concatenate([s * B + (k % shards) * (B // shards) + k // shards for s in range(steps)])
    np.testing.assert_array_equal(ids[rows], plain_ids)
    np.testing.assert_array_equal(draws[rows], plain_draws)
    # On the devices: each image's R copies (each step holds whole groups) on R different devices.
    for step in range(steps):
        batch = device_input.device_batches(iter([{"label": ids[step * B:(step + 1) * B]}]),
                                            sharding.batch_sharding(mesh), 0)
        on = {}
        for shard in next(batch)["label"].addressable_shards:
            for image in np.asarray(shard.data):
                on.setdefault(int(image), []).append(shard.device.id)
        assert len(on) == B // R and all(len(set(d)) == R for d in on.values()), on
    # Any process count reads its contiguous rows of the same placed batch.
    halves = [_stream(steps, batch=B, shards=shards, process_index=p, process_count=2)[0] for p in range(2)]
    np.testing.assert_array_equal(np.concatenate([h.reshape(steps, -1) for h in halves], 1).reshape(-1), ids)
    with pytest.raises(ValueError, match="batch_size=24 is not divisible by the 5 data-parallel devices"):
        _stream(1, shards=5)


@pytest.mark.parametrize("repeats, drop_last, expected", [(1, False, 1437 / 64), (3, False, 20.0), (1, True, 22.0),
                                                          (3, True, 20.0)])
def test_steps_per_epoch_of_the_quickstart(repeats, drop_last, expected):
    config = load_config("quickstart")
    config.input.repeated_augmentation, config.input.drop_last = repeats, drop_last
    assert inputs.steps_per_epoch(config) == expected


# (repeats, EMA decay, clip) as each reference's code sets them (docs/recipes.md): DeiT's main.py
# for CaiT; PVT's main.py and configs/pvt_v2/pvt_v2_b3.py; Swin's config.py (no RASampler, no EMA).
REFERENCES = {"cait_s24_i1k_tg": (3, 0.99996, None), "pvtv2_b3_i1k_tg": (3, 0.0, 1.0), "swin_s_i1k_tg": (1, 0.0, 5.0)}


@pytest.mark.parametrize("name", list(REFERENCES))
def test_family_recipes_repeat_average_and_clip_as_their_references(name):
    config = load_config(name)
    repeats, decay, clip = REFERENCES[name]
    assert (config.input.repeated_augmentation, config.model_ema.decay, config.grad_clip_norm) == (repeats, decay, clip)
    assert config.input.drop_last  # every reference's train loader drops the last partial batch
