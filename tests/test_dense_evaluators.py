"""The dense evaluators (TokenCut CorLoc, docs/method/dense.md §7; linear segmentation probe, §8) on a
tiny random-init ViT (width 32, depth 2, patches 4) over 32×32 digit scenes, on the 8 fake
CPU devices, against independent paths (model.apply + the numpy functions)."""

from __future__ import annotations

import dataclasses
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
from skipless_jax.evaluators.common import global_rows

from util import tiny_config


def scene_config(pool: str = "tok") -> ml_collections.ConfigDict:
    c = tiny_config("depth=2")  # the protocols that read the last 2 blocks
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


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
def test_sharded_probe_step_equals_the_one_device_step():
    results = []
    for devices in (None, 1):
        ctx, params, _ = context("tok", devices)
        ev = probe(ctx)
        batch = global_rows(ctx.mesh, ev.train_batch(ev.source(ev.train_split), 0))
        state = ev.init(params, batch["image"].shape[1:])
        for _ in range(2):
            state, loss = ev._step(state, params, batch)
        assert len(loss.sharding.device_set) == (8 if devices is None else 1)
        results.append(jax.device_get((state["params"], state["stats"], loss)))
    jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, rtol=1e-5, atol=1e-6), *results)


@pytest.mark.slow
def test_miou_equals_a_numpy_recomputation_from_the_model(trained):
    """One 32×32 window per scene (crop 32): the test scores are the head's logits on the model's
    own patch tokens, upsampled; mIoU recounted pixel by pixel."""
    ev, params, head = trained
    _, model, host_params = backbone("tok")
    source = ev.source(ev.split)
    records = [source[i] for i in range(len(source))]
    info = sources.dataset_info("digit_scenes")
    images = np.stack([pipeline.normalize(r["image"], info.mean, info.std) for r in records])
    _, out = jax.jit(lambda p, x: model.apply({"params": p}, x))(host_params, images)
    tokens = np.asarray(out["encoded"])[:, 1:].reshape(len(images), 8, 8, -1)
    logits, _ = seg.head_logits(jax.device_get(head["params"]), jax.device_get(head["stats"]), tokens)
    ref = np.asarray(jax.image.resize(logits, (len(images), 32, 32, 11), "bilinear"))
    scores = np.stack(list(ev.scores(params, head, [r["image"] for r in records])))
    np.testing.assert_allclose(scores, ref, atol=2e-4)
    pred, label = scores.argmax(-1), np.stack([r["segmentation"] for r in records])
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


@pytest.mark.slow
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
    ctx = dataclasses.replace(ctx, config=config)
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
        (dict(type="linear_segmentation", crop_size=0), r"^config\.evals\.e\.crop_size=0 must be a positive"),
        (dict(type="linear_segmentation", flip=1), r"^config\.evals\.e\.flip=1 must be True, False or None"),
        (
            dict(type="linear_segmentation", dataset="voc13"),
            r"^config\.evals\.e\.dataset='voc13' is unknown; allowed: \[.*'voc12_seg'",
        ),
        (dict(type="tokencut", data_dr="x"), r"^config\.evals\.e\.data_dr is not a field"),
        (dict(type="tokencut", dataset="voc07_boxes"),
         r"^config\.evals\.e\.split is required for its own dataset 'voc07_boxes' \(splits: \['test', 'trainval'\]\)"),
        (dict(type="linear_segmentation", dataset="ade20k", split="val"),
         r"^config\.evals\.e\.train_split is required for its own dataset 'ade20k'"),
        (dict(type="tokencut", dataset=["voc07_boxes"]), r"^config\.evals\.e\.dataset=\['voc07_boxes'\] must be"),
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
    with pytest.raises(ValueError, match=r"^config\.evals\.e: protocol 'ms' reads the last 4 blocks; the model has 2"):
        seg.LinearSegmentation.from_config("e", ml_collections.ConfigDict(dict(protocol="ms")), ctx,
                                           **common("e", "test"))
    with pytest.raises(ValueError, match=r"^config\.evals\.e: crop_size=30 is not a multiple of the patch size 4"):
        seg.LinearSegmentation.from_config("e", ml_collections.ConfigDict(dict(crop_size=30)), ctx,
                                           **common("e", "test"))
    with pytest.raises(ValueError, match=r"^config\.evals\.e\.train_split is required for the dataset 'voc12_seg'"):
        seg.LinearSegmentation.from_config("e", ml_collections.ConfigDict(dict(dataset="voc12_seg")), ctx,
                                           **common("e", "val"))
    with pytest.raises(ValueError, match=r"^config\.evals\.e: type 'tokencut' needs a dataset with 'boxes' targets; "
                                         r"'voc12_seg' has \['segmentation'\]"):
        tc.TokenCut.from_config("e", ml_collections.ConfigDict(dict(dataset="voc12_seg")), ctx, **common("e", "val"))
    ctx = dataclasses.replace(ctx, config=tiny_config())  # digits: no boxes, no segmentation
    with pytest.raises(ValueError, match=r"^config\.evals\.e: type 'tokencut' needs a dataset with 'boxes'"):
        tc.TokenCut.from_config("e", ml_collections.ConfigDict(), ctx, **common("e", "test"))


# ---------------------------------------------------------------------------------------------
# The full protocols: multi-layer features, multi-scale + flip windows, images of any size
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_multi_layer_features_are_each_blocks_output_through_the_final_norm():
    import flax.linen as nn

    ctx, params, model = context("tok")
    ev = probe(ctx, blocks=2)
    _, _, host = backbone("tok")
    images = np.random.default_rng(0).normal(size=(2, 32, 32, 1)).astype(np.float32)
    feats = np.asarray(ev.features(params, jnp.asarray(images)))
    _, out = jax.jit(lambda p, x: model.apply({"params": p}, x))(host, images)
    norm = lambda x: nn.LayerNorm().apply({"params": host["encoder_norm"]}, x)
    ref = np.concatenate([np.asarray(norm(b["output"]))[:, 1:] for b in out["blocks"]], -1).reshape(2, 8, 8, 64)
    np.testing.assert_allclose(feats, ref, atol=1e-5)
    np.testing.assert_allclose(ref[..., 32:], np.asarray(out["encoded"])[:, 1:].reshape(2, 8, 8, 32), atol=1e-5)


def _reference_scores(ev, model, host, head, image: np.ndarray) -> np.ndarray:
    """Mean softmax over the test views, one window at a time, written out plainly (each
    window's forward, head and resize compiled as one program per window shape, not op by op)."""
    from skipless_jax.data import dense

    @functools.partial(jax.jit, static_argnums=1)
    def window_logits(padded, size):
        _, out = model.apply({"params": host}, padded[None])
        tokens = jnp.concatenate([b["normed"][:, 1:] for b in out["blocks"][-2:]], -1)
        ph, pw = padded.shape[:2]
        logits, _ = seg.head_logits(head["params"], head["stats"], tokens.reshape(1, ph // 4, pw // 4, -1))
        return jax.image.resize(logits, (1, *size, 11), "bilinear")[0]

    info = sources.dataset_info("digit_scenes")
    pr = ev.protocol
    probs = []
    for scale in pr.test_scales:
        for flip in (False, True):
            h, w = dense.rescale_hw(image.shape[:2], np.inf, pr.short * scale)
            x = pipeline.normalize(dense.resize_image(image, (h, w)), info.mean, info.std)
            if flip:
                x = x[:, ::-1]
            total, count = np.zeros((h, w, 11)), np.zeros((h, w, 1))
            for y0, y1, x0, x1 in dense.windows((h, w), pr.crop, pr.stride):
                win = x[y0:y1, x0:x1]
                ph, pw = -(-win.shape[0] // 4) * 4, -(-win.shape[1] // 4) * 4
                top, left = (ph - win.shape[0]) // 2, (pw - win.shape[1]) // 2
                padded = np.zeros((ph, pw, 1), np.float32)
                padded[top : top + win.shape[0], left : left + win.shape[1]] = win
                total[y0:y1, x0:x1] += np.asarray(window_logits(padded, win.shape[:2]))
                count[y0:y1, x0:x1] += 1
            logits = dense.resize_bilinear(total / count, image.shape[:2])
            probs.append(dense.softmax(logits[:, ::-1] if flip else logits))
    return np.mean(probs, 0)


@pytest.mark.slow
def test_multi_scale_flip_scores_equal_a_plain_loop_over_views_and_windows():
    ctx, params, model = context("tok")
    ev = probe(ctx, protocol="ms", blocks=2, steps=6)
    head = jax.device_get(ev.train(params))
    _, _, host = backbone("tok")
    source = ev.source("test[:2]")
    images = [source[i]["image"] for i in range(2)]
    assert len(ev.protocol.test_scales) == 5 and ev.protocol.test_flip
    scores = list(ev.scores(params, head, images))
    for image, score in zip(images, scores, strict=True):
        ref = _reference_scores(ev, model, host, head, image)
        np.testing.assert_allclose(score / 10, ref, atol=2e-5)  # 10 views summed
        assert score.shape == (32, 32, 11)
    # Windows sent 3 at a time and after every image (no view buffer kept): the same scores.
    ev.chunk, ev.buffer_bytes = 3, 0
    for a, b in zip(list(ev.scores(params, head, images)), scores, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)


def _rgb_context():
    """A 3-channel tiny ViT (patch 4) over 8 devices, for images of any size."""
    config = scene_config("tok")
    model = models.build(config.model, 0, image_size=32)  # its position table resized for other grids
    params = jax.jit(model.init)(jax.random.PRNGKey(1), jnp.zeros((1, 32, 32, 3)))["params"]
    mesh = sharding.make_mesh({"data": -1, "fsdp": 1})
    ctx = evaluators.Context(config, mesh, 10, outputs=lambda p, x: model.apply({"params": p}, x)[1])
    return ctx, jax.device_put(params, sharding.replicated(mesh)), model, jax.device_get(params)


@pytest.mark.slow
def test_tokencut_on_images_of_several_sizes_equals_a_per_image_loop(tmp_path):
    from dense_folders import voc_boxes_folder

    gts = voc_boxes_folder(str(tmp_path))
    ctx, params, model, host = _rgb_context()
    entry = ml_collections.ConfigDict(dict(type="tokencut", dataset="voc07_boxes", data_dir=str(tmp_path)))
    ev = tc.TokenCut.from_config("tc", entry, ctx, **common("tc", "trainval"))
    ev.chunk = 3  # two chunks, each with images of two padded shapes
    preds, got = ev.boxes(params)
    source = sources.get_source("voc07_boxes", "trainval", str(tmp_path))
    mean, std = sources.dataset_info("voc07_boxes").mean, sources.dataset_info("voc07_boxes").std
    last_keys = jax.jit(lambda x: model.apply({"params": host}, x)[1]["blocks"][-1]["keys"])  # per image shape
    for i in range(len(source)):
        image = source[i]["image"]
        x = tc.pad_to_patch_multiple(pipeline.normalize(image, mean, std), 4)
        keys = np.asarray(last_keys(x[None]))[0, 1:]
        _, mask, seed = tc.ncut(keys, (x.shape[0] // 4, x.shape[1] // 4))
        assert tuple(preds[i]) == tc.box(mask, seed, 4, image.shape[:2])
        np.testing.assert_array_equal(got[i], gts[i])
    assert dict(ev.run(params))["corloc"] == tc.corloc(preds, got)


@pytest.mark.slow
def test_probe_on_a_segmentation_folder_of_another_dataset(tmp_path):
    from dense_folders import voc_seg_folder

    voc_seg_folder(str(tmp_path))
    ctx, params, _, _ = _rgb_context()
    entry = ml_collections.ConfigDict(dict(type="linear_segmentation", dataset="voc12_seg", data_dir=str(tmp_path),
                                           train_split="train", crop_size=32, steps=3, warmup=1))
    ev = seg.LinearSegmentation.from_config("seg", entry, ctx, **common("seg", "val"))
    assert ev.num_classes == 21 and ev.protocol.crop == 32 and ev.protocol.stride == 21
    metrics = dict(ev.run(params))
    assert 0.0 <= metrics["miou"] <= 1.0 and 0.0 <= metrics["pixel_accuracy"] <= 1.0
    # Every pixel of every val image was scored at its own resolution.
    source = ev.source("val")
    conf = ev.confusion(params, ev.train(params, steps=1))
    assert conf.sum() == sum(int((source[i]["segmentation"] != 255).sum()) for i in range(len(source)))


def test_train_crops_depend_on_seed_and_step_only():
    import concurrent.futures

    ctx, _, _ = context("tok")
    ev = probe(ctx)
    source = ev.source(ev.train_split)
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        threaded = ev.train_batch(source, 5, pool)
    plain = ev.train_batch(source, 5)
    for k in ("image", "segmentation"):
        np.testing.assert_array_equal(threaded[k], plain[k])
    assert threaded["image"].shape == (16, 32, 32, 1) and threaded["segmentation"].dtype == np.uint8
    assert not np.array_equal(ev.train_batch(source, 6)["image"], plain["image"])


def test_tokencut_splits_the_cut_over_processes_and_gathers_every_box(monkeypatch):
    """Two processes simulated in one: process r reads, decodes and cuts only records r, r + 2, …;
    the gathers (boxes, ground truths) put every row back: equal to one process."""
    from jax.experimental import multihost_utils

    ctx, params, _ = context("tok")
    ev = tc.TokenCut.from_config("tc", ml_collections.ConfigDict(), ctx, **common("tc", "test[:11]"))
    ev.chunk = 4
    whole, whole_gts = ev.boxes(params)
    source = ev.records()
    read: dict[int, list[int]] = {0: [], 1: []}
    sent: dict[int, list[np.ndarray]] = {0: [], 1: []}

    class Recording:
        def __init__(self, rank):
            self.rank = rank

        def __len__(self):
            return len(source)

        def __getitem__(self, i):
            read[self.rank].append(i)
            return source[i]

    monkeypatch.setattr(jax, "process_count", lambda: 2)
    for rank in (0, 1):
        monkeypatch.setattr(jax, "process_index", lambda rank=rank: rank)
        monkeypatch.setattr(ev, "records", lambda rank=rank: Recording(rank))

        def gather(x, tiled=False, rank=rank):
            if tiled:  # the params, whole on each process
                return jax.tree.map(np.asarray, jax.device_get(x))
            sent[rank].append(np.asarray(x))
            return np.stack([np.asarray(x)] * 2)

        monkeypatch.setattr(multihost_utils, "process_allgather", gather)
        ev.boxes(params)
    assert read == {0: [0, 2, 4, 6, 8, 10], 1: [1, 3, 5, 7, 9]}
    boxes = [sent[r][0] for r in (0, 1)]
    assert np.all(boxes[0][1::2] == 0) and np.all(boxes[1][0::2] == 0)  # each cut only its rows
    np.testing.assert_array_equal(np.stack(boxes)[np.arange(11) % 2, np.arange(11)], whole)
    k = max(int(sent[0][1]), int(sent[1][1]))
    gts = [np.pad(sent[r][2], ((0, 0), (0, k - sent[r][2].shape[1]), (0, 0)), constant_values=np.nan)
           for r in (0, 1)]  # each process's own k here (the real gather agrees on the largest)
    for i, g in enumerate(np.stack(gts)[np.arange(11) % 2, np.arange(11)]):
        np.testing.assert_array_equal(g[~np.isnan(g[:, 0])], whole_gts[i])


# ---------------------------------------------------------------------------------------------
# The device test pass (docs/method/dense.md §8) = the host reference
# ---------------------------------------------------------------------------------------------


def _host_and_device(ev, params, head, images):
    host = [s.argmax(-1) for s in ev.scores(params, head, images)]
    device = list(ev.device_predictions(params, head, images))
    return host, device


@pytest.mark.slow
@pytest.mark.parametrize("protocol", ["lin", "ms"])
def test_device_test_pass_equals_the_host_reference(protocol, tmp_path):
    """VOC-like folder images of several sizes at crop 32 (windows overlap, views of several sizes,
    buffers padded to their buckets): the device predictions are the host's argmax pixel for
    pixel, and the confusions are equal."""
    from dense_folders import voc_seg_folder

    voc_seg_folder(str(tmp_path))
    ctx, params, _, _ = _rgb_context()
    entry = ml_collections.ConfigDict(dict(type="linear_segmentation", dataset="voc12_seg", data_dir=str(tmp_path),
                                           train_split="train", crop_size=32, steps=3, warmup=1, protocol=protocol,
                                           blocks=2 if protocol == "ms" else None))
    ev = seg.LinearSegmentation.from_config("seg", entry, ctx, **common("seg", "val"))
    head = ev.train(params)
    source = ev.source("val")
    rng = np.random.default_rng(0)
    images = [source[0]["image"]] + [rng.integers(0, 256, (*hw, 3), dtype=np.uint8) for hw in ((37, 29), (45, 61))]
    host, device = _host_and_device(ev, params, jax.device_get(head), images)
    for h, d, image in zip(host, device, images, strict=True):
        assert d.shape == image.shape[:2]
        np.testing.assert_array_equal(d, h)
    np.testing.assert_array_equal(ev.confusion(params, head, device=True), ev.confusion(params, head, device=False))


def test_device_test_pass_splits_images_over_processes_and_sums_the_confusions(monkeypatch):
    """Two processes simulated in one: process r reads only records r, r + 2, …; the two local
    confusions add up to the one-process confusion."""
    from jax.experimental import multihost_utils

    ctx, params, _ = context("tok")
    ev = probe(ctx, steps=4)
    ev.split = "test[:8]"
    head = ev.train(params)
    whole = ev.confusion(params, head)
    source = ev.source(ev.split)
    read: dict[int, list[int]] = {0: [], 1: []}
    local: dict[int, np.ndarray] = {}

    class Recording:
        def __init__(self, rank):
            self.rank = rank

        def __len__(self):
            return len(source)

        def __getitem__(self, i):
            read[self.rank].append(i)
            return source[i]

    monkeypatch.setattr(jax, "process_count", lambda: 2)
    for rank in (0, 1):
        monkeypatch.setattr(jax, "process_index", lambda rank=rank: rank)
        monkeypatch.setattr(ev, "source", lambda split, rank=rank: Recording(rank))

        def gather(x, tiled=False, rank=rank):
            if tiled:  # the params and head, whole on each process
                return jax.tree.map(np.asarray, jax.device_get(x))
            if np.ndim(x) == 2:
                local[rank] = np.asarray(x)
            return np.stack([np.asarray(x)] * 2)

        monkeypatch.setattr(multihost_utils, "process_allgather", gather)
        ev.confusion(params, head)
    assert read == {0: [0, 2, 4, 6], 1: [1, 3, 5, 7]}
    np.testing.assert_array_equal(local[0] + local[1], whole)


# ---------------------------------------------------------------------------------------------
# Two real processes (gloo) = one process: the segmentation test pass and TokenCut
# ---------------------------------------------------------------------------------------------

_WORKER = r'''
import json, sys
sys.path.insert(0, sys.argv[2])
from skipless_jax import distributed
distributed.initialize()
import jax, jax.numpy as jnp, ml_collections, numpy as np
from skipless_jax import evaluators, models, sharding
from skipless_jax.evaluators import segmentation as seg, tokencut as tc
from util import tiny_config

config = tiny_config()
config.dataset.name, config.input.image_size = "digit_scenes", None
config.model.update(dict(patch_size=4, pool="tok"))
model = models.build(config.model, 0, image_size=32)
mesh = sharding.make_mesh({"data": -1, "fsdp": 1})
distributed.log_topology(mesh)
params = jax.jit(model.init, out_shardings=sharding.replicated(mesh))(
    jax.random.PRNGKey(1), jnp.zeros((1, 32, 32, 3)))["params"]
ctx = evaluators.Context(config, mesh, 10, outputs=lambda p, x: model.apply({"params": p}, x)[1])
rng = np.random.default_rng(0)
records = [{"image": rng.integers(0, 256, (*hw, 3), dtype=np.uint8),
            "segmentation": np.where(rng.random(hw) < 0.1, 255, rng.integers(0, 21, hw)).astype(np.uint8),
            "boxes": np.array([[0, 0, 12, 9.0]] * (1 + k % 3))}
           for k, hw in enumerate([(24, 16), (37, 29), (45, 61)])]

class Source:
    def __len__(self):
        return len(records)
    def __getitem__(self, i):
        return dict(records[i])

entry = ml_collections.ConfigDict(dict(type="linear_segmentation", dataset="voc12_seg", train_split="train",
                                       crop_size=32, steps=2, warmup=1))
ev = seg.LinearSegmentation.from_config("seg", entry, ctx, prefix="seg", every_steps=None, split="val")
ev.source = lambda split: Source()
head = ev.train(params)
confusion = ev.confusion(params, head)
cut = tc.TokenCut("tc", "tc", None, "x", ctx, dataset="voc07_boxes", chunk=2)
cut.records = Source
boxes, gts = cut.boxes(params)
if jax.process_index() == 0:
    json.dump({"confusion": confusion.tolist(), "boxes": boxes.tolist(), "gts": [g.tolist() for g in gts],
               "processes": jax.process_count(), "devices": jax.device_count()},
              open(sys.argv[1], "w"))
'''


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_processes_equal_one_process_for_segmentation_and_tokencut(tmp_path, tmp_path_factory):
    import json
    import os
    import sys

    import subprocess_runs as sr

    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    tests = os.path.dirname(os.path.abspath(__file__))
    cache = os.path.join(sr.session_dir(tmp_path_factory), "jax_cache")
    address = f"127.0.0.1:{sr.free_port()}"
    procs, logs = [], []
    for index in range(2):
        environ = sr.env(2, cache_dir=cache, JAX_COORDINATOR_ADDRESS=address, JAX_NUM_PROCESSES="2",
                         JAX_PROCESS_ID=str(index))
        logs.append(str(tmp_path / f"process_{index}.log"))
        procs.append(sr.start([sys.executable, str(script), str(tmp_path / "two.json"), tests], environ, logs[-1]))
    sr.run([sys.executable, str(script), str(tmp_path / "one.json"), tests], sr.env(4, cache_dir=cache),
           str(tmp_path / "one.log"), 900)
    for proc, log in zip(procs, logs):
        assert sr.finish(proc, log, 900) == 0, sr.tail(log)
    one, two = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("one", "two"))
    assert (one.pop("processes"), two.pop("processes"), one.pop("devices"), two.pop("devices")) == (1, 2, 4, 4)
    assert np.asarray(one["confusion"]).sum() > 0
    assert one == two
