"""The dense evaluators (TokenCut CorLoc, docs/method.md §7; linear segmentation probe, §8) on a
tiny random-init ViT (width 32, depth 2, patches 4) over 32×32 digit scenes, on the 8 fake
CPU devices, against independent paths (model.apply + the numpy functions)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from skipless_jax import evaluators, models, sharding
from skipless_jax.data import pipeline, sources
from skipless_jax.evaluators import segmentation as seg
from skipless_jax.evaluators import tokencut as tc

from util import tiny_config


def scene_config(pool: str = "tok") -> ml_collections.ConfigDict:
    c = tiny_config()
    c.dataset.name, c.dataset.train_split, c.dataset.eval_split = "digit_scenes", "train", "test"
    c.input.image_size = None
    c.input.eval_batch_size = 16
    c.model.update(dict(patch_size=4, pool=pool))
    return c


@functools.cache
def backbone(pool: str):
    config = scene_config(pool)
    model = models.build(config.model, 0)
    params = jax.jit(model.init)(jax.random.PRNGKey(0), jnp.zeros((1, 32, 32, 1)))["params"]
    return config, model, jax.device_get(params)


def context(pool: str, devices: int | None = None):
    """(Context over all 8 devices or the first `devices`, params replicated on its mesh, model)."""
    config, model, params = backbone(pool)
    mesh = sharding.make_mesh({"data": -1, "fsdp": 1}, None if devices is None else jax.devices()[:devices])
    ctx = evaluators.Context(config, mesh, 10, outputs=lambda p, x: model.apply({"params": p}, x)[1])
    return ctx, jax.device_put(params, sharding.replicated(mesh)), model


def common(name: str, split: str) -> dict:
    return dict(prefix=name, every_steps=None, split=split)


# ---------------------------------------------------------------------------------------------
# TokenCut
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("block, tau", [(-1, 0.2), (0, 0.1)])
def test_tokencut_corloc_matches_a_direct_loop(block, tau):
    split = "test[:24]"
    ctx, params, model = context("tok")
    entry = ml_collections.ConfigDict(dict(type="tokencut", block=block, tau=tau))
    ev = tc.TokenCut.from_config("tc", entry, ctx, **common("tc", split))
    preds, gts = ev.boxes(params)
    ((metric, value),) = list(ev.run(params))

    # Independent path: the records, normalized by hand, one model.apply on one device.
    info = sources.dataset_info("digit_scenes")
    source = sources.get_source("digit_scenes", split)
    records = [source[i] for i in range(len(source))]
    images = np.stack([pipeline.normalize(r["image"], info.mean, info.std) for r in records])
    _, _, host_params = backbone("tok")
    _, out = jax.jit(lambda p, x: model.apply({"params": p}, x))(host_params, images)
    keys = np.asarray(out["blocks"][block]["keys"])[:, 1:]  # CLS dropped
    ref_boxes = []
    for k in keys:
        _, mask, seed = tc.ncut(k, (8, 8), tau, tc.EPS)
        ref_boxes.append(tc.box(mask, seed, 4, (32, 32)))
    ref = tc.corloc(ref_boxes, [r["boxes"] for r in records])

    assert metric == "corloc" and len(preds) == 24
    np.testing.assert_array_equal(preds, np.asarray(ref_boxes, np.float64))
    for g, r in zip(gts, records):
        np.testing.assert_array_equal(g, r["boxes"])
    assert value == ref and 0.0 <= value <= 1.0


def test_tokencut_gap_model_has_no_prefix_and_iou_threshold():
    ctx, params, _ = context("gap")
    ev = tc.TokenCut.from_config(
        "tc", ml_collections.ConfigDict(dict(type="tokencut", iou=0.3)), ctx, **common("tc", "test[:8]")
    )
    preds, gts = ev.boxes(params)
    assert preds.shape == (8, 4)
    hits = [any(tc.box_iou(p, g) >= 0.3 for g in gt) for p, gt in zip(preds, gts)]
    assert dict(ev.run(params))["corloc"] == np.mean(hits)


# ---------------------------------------------------------------------------------------------
# Linear segmentation probe
# ---------------------------------------------------------------------------------------------


def probe(ctx, steps: int = 40, **fields):
    entry = ml_collections.ConfigDict(
        dict(type="linear_segmentation", train_split="train[:64]", steps=steps, warmup=4, lr=1e-2, **fields)
    )
    return seg.LinearSegmentation.from_config("seg", entry, ctx, **common("seg", "test[:32]"))


@pytest.fixture(scope="module")
def trained():
    ctx, params, _ = context("tok")
    ev = probe(ctx)
    return ev, params, ev.train(params)


def test_probe_beats_its_initialization_and_metrics_are_in_range(trained):
    ev, params, head = trained
    before = ev.evaluate(params, ev.train(params, steps=0))
    after = ev.evaluate(params, head)
    for m in (before, after):
        assert 0.0 <= m["miou"] <= 1.0 and 0.0 <= m["pixel_accuracy"] <= 1.0
    assert after["miou"] > before["miou"] and after["pixel_accuracy"] > before["pixel_accuracy"]
    assert after["pixel_accuracy"] > 0.7  # at least the background


def test_probe_head_is_affine_at_test_time(trained):
    _, _, head = trained
    rng = np.random.default_rng(0)
    x, y = (jnp.asarray(rng.normal(size=(2, 8, 8, 32)), jnp.float32) for _ in range(2))
    a, b = 0.7, -1.9
    f = lambda z: np.asarray(seg.head_logits(head["params"], head["stats"], z)[0], np.float64)
    np.testing.assert_allclose(f(a * x + b * y), a * f(x) + b * f(y) - (a + b - 1) * f(jnp.zeros_like(x)), atol=1e-4)
    assert not np.allclose(np.asarray(head["stats"]["mean"]), 0)  # the running statistics were trained


def test_sharded_probe_step_equals_the_one_device_step():
    results = []
    for devices in (None, 1):
        ctx, params, _ = context("tok", devices)
        ev = probe(ctx)
        batch = next(ev.train_batches())
        state = ev.init(params, batch["image"].shape[1:])
        for _ in range(2):
            state, loss = ev._step(state, params, batch)
        assert len(loss.sharding.device_set) == (8 if devices is None else 1)
        results.append(jax.device_get((state["params"], state["stats"], loss)))
    jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, rtol=1e-5, atol=1e-6), *results)


def test_miou_equals_a_numpy_recomputation(trained):
    ev, params, head = trained
    preds, labels = zip(*ev.predictions(params, head))
    pred, label = np.concatenate(preds), np.concatenate(labels)
    assert pred.shape == label.shape == (32, 32, 32)
    keep = label != 255
    ious = []
    for c in range(11):
        p, g = (pred == c) & keep, (label == c) & keep
        union = (p | g).sum()
        if union:
            ious.append((p & g).sum() / union)
    metrics = ev.evaluate(params, head)
    assert metrics["miou"] == pytest.approx(np.mean(ious), abs=1e-12)
    assert metrics["pixel_accuracy"] == pytest.approx(np.mean(pred[keep] == label[keep]), abs=1e-12)


def test_build_and_run_all_report_both_evaluators():
    ctx, params, _ = context("tok")
    config = scene_config("tok")
    config.evals = ml_collections.ConfigDict(
        dict(
            objects=dict(type="tokencut", split="test[:8]"),
            seg=dict(type="linear_segmentation", split="test[:16]", train_split="train[:16]", steps=2, warmup=1),
        )
    )
    evaluators.check_config(config)
    ctx.config = config
    results = {(p, m): v for p, m, v in evaluators.run_all(evaluators.build(config, ctx), ctx, params)}
    assert set(results) == {("objects", "corloc"), ("seg", "miou"), ("seg", "pixel_accuracy")}
    assert all(0.0 <= v <= 1.0 for v in results.values())


# ---------------------------------------------------------------------------------------------
# Config errors
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "entry, match",
    [
        (dict(type="tokencut", tau=1.5), r"^config\.evals\.e\.tau=1\.5 must be a number in \[-1, 1\)"),
        (dict(type="tokencut", block=1.5), r"^config\.evals\.e\.block=1\.5 must be an integer"),
        (dict(type="tokencut", eps=0.0), r"^config\.evals\.e\.eps=0\.0 must be"),
        (dict(type="tokencut", iou=0), r"^config\.evals\.e\.iou=0 must be"),
        (dict(type="tokencut", k=3), r"^config\.evals\.e\.k is not a field of a 'tokencut' evaluator"),
        (dict(type="linear_segmentation", protocol="ms"), r"^config\.evals\.e\.protocol='ms' .* not implemented yet"),
        (dict(type="linear_segmentation", protocol="lin2"), r"^config\.evals\.e\.protocol='lin2' is unknown"),
        (dict(type="linear_segmentation", steps=0), r"^config\.evals\.e\.steps=0 must be a positive integer"),
        (dict(type="linear_segmentation", batch_size=2.5), r"^config\.evals\.e\.batch_size=2\.5 must be"),
        (
            dict(type="linear_segmentation", steps=10, warmup=20),
            r"^config\.evals\.e\.warmup=20 must be an integer in \[0, steps=10\]",
        ),
        (dict(type="linear_segmentation", lr=-1.0), r"^config\.evals\.e\.lr=-1\.0 must be"),
        (dict(type="linear_segmentation", weight_decay=float("nan")), r"^config\.evals\.e\.weight_decay=nan must be"),
        (dict(type="linear_segmentation", num_classes=1), r"^config\.evals\.e\.num_classes=1 must be"),
    ],
)
def test_bad_fields_are_one_line_errors(entry, match):
    config = scene_config()
    config.evals = ml_collections.ConfigDict(dict(e=entry))
    with pytest.raises(ValueError, match=match) as err:
        evaluators.check_config(config)
    assert "\n" not in str(err.value)


def test_from_config_errors_need_the_model_and_dataset():
    ctx, _, _ = context("tok")
    with pytest.raises(ValueError, match=r"^config\.evals\.e\.block=2 is outside the model's 2 blocks"):
        tc.TokenCut.from_config("e", ml_collections.ConfigDict(dict(block=2)), ctx, **common("e", "test"))
    with pytest.raises(ValueError, match=r"does not divide over the mesh's 8 data shards"):
        seg.LinearSegmentation.from_config(
            "e", ml_collections.ConfigDict(dict(batch_size=12)), ctx, **common("e", "test")
        )
    ctx.config = tiny_config()  # digits: no boxes, no segmentation
    with pytest.raises(ValueError, match=r"^config\.evals\.e: type 'tokencut' needs a dataset with 'boxes_padded'"):
        tc.TokenCut.from_config("e", ml_collections.ConfigDict(), ctx, **common("e", "test"))
    ctx.config = scene_config()
    ctx.config.input.image_size = 16
    with pytest.raises(ValueError, match=r"needs eval images as stored \(size 32"):
        seg.LinearSegmentation.from_config("e", ml_collections.ConfigDict(), ctx, **common("e", "test"))
