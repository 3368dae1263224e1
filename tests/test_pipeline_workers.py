"""The input pipeline with worker processes (data/pipeline.py): the same batches with 0 and 2
workers (train transform, DINO multi-crop, eval), every eval example exactly once, and a run
resumed on another number of processes and workers continuing the exact example stream."""

from __future__ import annotations

import numpy as np
import pytest

from skipless_jax.data import augment, inputs, multicrop, pipeline, record_sources

from util import load_config


def _source(n=40, size=20, seed=0):
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, (n, size, size + 4, 3), dtype=np.uint8)
    return record_sources.ArraySource(images, rng.integers(0, 5, n))


def _deit_transform(size=16):
    aug = dict(randaug="rand-m9-mstd0.5-inc1", scale=(0.08, 1.0), flip=True, reprob=0.25, mixup=0.0, cutmix=0.0,
               mixup_switch_prob=0.5)
    return augment.train_transform(aug, size)


def _train(steps, *, start_step=0, process_index=0, process_count=1, num_workers=0, batch=8):
    it = pipeline.train_batches(_source(), _deit_transform(), num_classes=5, global_batch_size=batch, seed=3,
                                start_step=start_step, process_index=process_index, process_count=process_count,
                                num_workers=num_workers)
    return [next(it) for _ in range(steps)]


def _assert_batches_equal(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            np.testing.assert_array_equal(x[k], y[k], err_msg=k)


@pytest.mark.slow
def test_train_batches_are_the_same_with_0_and_2_worker_processes():
    plain = _train(3)
    assert plain[0]["image"].shape == (8, 16, 16, 3) and plain[0]["label"].shape == (8, 5)
    assert not np.array_equal(plain[0]["image"], plain[1]["image"])
    _assert_batches_equal(plain, _train(3, num_workers=2))


@pytest.mark.slow
def test_resumed_on_other_process_and_worker_counts_the_stream_continues():
    whole = _train(4)  # one process, in-process reads, from step 0
    for step in (2, 3):  # resumed at step 2 on two processes, each with two workers
        parts = [_train(2, start_step=2, process_index=p, process_count=2, num_workers=2) for p in (0, 1)]
        for p in (0, 1):
            _assert_batches_equal([whole[step] | {"image": whole[step]["image"][4 * p:4 * p + 4],
                                                  "label": whole[step]["label"][4 * p:4 * p + 4]}],
                                  [parts[p][step - 2]])


@pytest.mark.slow
def test_multicrop_batches_are_the_same_with_0_and_2_worker_processes():
    config = load_config("dino_digits")
    config.input.batch_size = 8

    def batches(num_workers):
        config.input.num_workers = num_workers
        it = multicrop.train_iterator(config, 5, 0, 1)
        return [next(it) for _ in range(2)]

    plain = batches(0)
    assert {"global", "local", "label"} <= plain[0].keys()
    _assert_batches_equal(plain, batches(2))


@pytest.mark.slow
@pytest.mark.parametrize("batch", [8, 5])  # 5: 25 padded examples, the workers' last chunk is short
def test_eval_with_workers_counts_every_example_once(batch):
    source = _source(n=21)
    transform = augment.eval_transform(16)

    def batches(num_workers):
        return list(pipeline.eval_batches(source, transform, num_classes=5, global_batch_size=batch,
                                          num_workers=num_workers))

    plain, workers = batches(0), batches(2)
    _assert_batches_equal(plain, workers)
    mask = np.concatenate([b["mask"] for b in workers])
    padded = -(-21 // batch) * batch
    assert mask.shape == (padded,) and mask.sum() == 21 and mask[:21].all()
    labels = np.concatenate([b["label"].argmax(-1) for b in workers])[:21]
    np.testing.assert_array_equal(labels, source.labels)
    expected = np.stack([transform(source[i]["image"]) for i in range(21)])
    np.testing.assert_array_equal(np.concatenate([b["image"] for b in workers])[:21], expected)


@pytest.mark.slow
def test_the_config_pipeline_with_workers_equals_in_process_reads():
    config = load_config("quickstart")
    config.input.batch_size = 16

    def read(num_workers):
        config.input.num_workers = num_workers
        it = inputs.train_iterator(config, 0, 0, 1)
        evals, n = inputs.eval_iterator(config, 0, 1, batch_size=128)
        return [next(it) for _ in range(2)], list(evals), n

    (train0, eval0, n), (train2, eval2, _) = read(0), read(2)
    _assert_batches_equal(train0, train2)
    _assert_batches_equal(eval0, eval2)
    assert sum(b["mask"].sum() for b in eval2) == n == 360


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2"])
def test_bad_num_workers_is_one_line(bad):
    with pytest.raises(ValueError, match=r"config.input.num_workers=.*must be an int >= 0"):
        next(pipeline.train_batches(_source(), _deit_transform(), num_classes=5, global_batch_size=8, seed=0,
                                    num_workers=bad))


def test_cached_eval_batches_are_read_once_and_replayed(monkeypatch):
    import jax

    from skipless_jax import sharding, validate
    from skipless_jax.evaluators import common

    config = load_config("quickstart")
    config.input.cache_eval = True
    ctx = common.Context(config, sharding.make_mesh(config.mesh), num_classes=10)
    reads = []
    eval_iterator = inputs.eval_iterator
    monkeypatch.setattr(inputs, "eval_iterator", lambda *a, **k: reads.append(a) or eval_iterator(*a, **k))
    first, n = ctx.batches("test")  # the eval batch size (128): whole-split reads are cached
    first = jax.device_get(list(first))
    second, _ = ctx.batches("test")
    second = jax.device_get(list(second))
    assert len(reads) == 1 and n == 360 and len(first) == 3
    ctx.batches("test", 32)  # another batch size (one-batch callers): read, not cached
    assert len(reads) == 2 and list(ctx.cache.eval_batches) == ["test"]
    _assert_batches_equal(first, second)
    assert first[0]["image"].dtype == np.float32  # normalized on the devices
    del config.input["cache_eval"]
    config.input.cache_eval = "yes"
    with pytest.raises(ValueError, match=r"config.input.cache_eval='yes' must be True or False"):
        validate.validate_config(config)
