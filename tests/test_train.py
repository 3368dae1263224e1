"""The supervised trainer on digits: learning, exact resume, evaluation coverage, bad input."""

import glob
import json
import logging
import os
import re

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from skipless_jax import checkpoint, config_blocks, pretrained
from skipless_jax.data import pipeline, sources
from skipless_jax.trainers import supervised, warm_start

from util import one_device, read_scalars, tiny_config


def _read_params(workdir, step=None):
    return checkpoint.load_raw(workdir, step)[1]


@pytest.mark.slow
def test_loss_decreases_on_digits(tmp_path):
    config = tiny_config("depth=2", total_steps=60)
    config.optimizer.lr = 1e-2
    metrics = supervised.train_and_evaluate(config, str(tmp_path))
    assert metrics["step"] == 60
    # The zero-initialized head starts at loss ln 10 = 2.30 and chance accuracy 10%.
    assert metrics["test_loss"] < 1.5, metrics
    assert metrics["test_accuracy"] > 0.4, metrics
    assert json.loads((tmp_path / "final_metrics.json").read_text())["step"] == 60


@pytest.mark.slow
def test_resume_continues_from_saved_step_and_matches(tmp_path):
    config = tiny_config(total_steps=8, checkpoint_every_steps=4)
    supervised.train_and_evaluate(config, str(tmp_path / "full"))
    reference = _read_params(str(tmp_path / "full"))
    # Lose the last checkpoint, as if the run had died between steps 4 and 8.
    mngr = checkpoint.manager(str(tmp_path / "full"))
    assert mngr.all_steps() == [4, 8]
    mngr.delete(8)
    mngr.close()
    metrics = supervised.train_and_evaluate(config, str(tmp_path / "full"))
    assert metrics["step"] == 8
    resumed = _read_params(str(tmp_path / "full"))
    assert int(resumed["step"]) == 8
    jax.tree.map(np.testing.assert_array_equal, reference["params"], resumed["params"])
    jax.tree.map(np.testing.assert_array_equal, reference["opt_state"], resumed["opt_state"])


@pytest.mark.parametrize("batch, processes", [(128, 1), (100, 4), (7, 1), (64, 2)])
def test_eval_counts_every_example_exactly_once(batch, processes):
    source = sources.get_source("digits", "test")
    seen = []
    for p in range(processes):
        for b in pipeline.eval_batches(source, lambda im: im.astype(np.float32), num_classes=10,
                                       global_batch_size=batch * processes, process_index=p, process_count=processes):
            seen.append(b["mask"].sum())
            assert b["image"].shape[0] == batch
    assert sum(seen) == len(source) == 360


def test_train_batches_depend_only_on_seed_and_step():
    source = sources.get_source("digits", "train")
    make = lambda start, p=0, n=1: pipeline.train_batches(
        source, lambda im, rng: im.astype(np.float32) + rng.normal(), num_classes=10,
        global_batch_size=8, seed=3, start_step=start, process_index=p, process_count=n)
    it = make(0)
    batches = [next(it) for _ in range(5)]
    resumed = next(make(3))
    np.testing.assert_array_equal(resumed["image"], batches[3]["image"])
    # Two processes read disjoint halves of the same global batch.
    halves = [next(make(2, p, 2))["image"] for p in range(2)]
    np.testing.assert_array_equal(np.concatenate(halves), batches[2]["image"])
    # An epoch (1437 = 3 × 479 examples) holds every example once, in a new order each epoch.
    epoch = pipeline.train_batches(source, lambda im, rng: im, num_classes=10, global_batch_size=479, seed=0)
    first = np.concatenate([next(epoch)["image"] for _ in range(3)])
    second = np.concatenate([next(epoch)["image"] for _ in range(3)])
    key = lambda x: sorted(map(bytes, x))
    assert key(first) == key(second) == key(np.stack([source[i]["image"] for i in range(len(source))]))
    assert not np.array_equal(first, second)


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"model.variant": "Q/16"}, r"config.model.variant='Q/16'"),
        ({"model.patch_size": 3}, r"config.model.patch_size=3 does not divide the image size 8"),
        ({"input.batch_size": 60}, r"config.input.batch_size=60 is not divisible by the 8 data-parallel devices"),
        ({"dataset.name": "mnist"}, r"config.dataset.name='mnist' is unknown"),
        ({"model.num_heads": 3}, r"config.model.num_heads=3 does not divide config.model.width=32"),
        ({"optimizer.name": "lion"}, r"config.optimizer.name='lion' is unknown"),
        ({"analysis.every_steps": -1}, r"config.analysis.every_steps=-1 must be a non-negative number"),
        (
            {"analysis.every_steps": 2, "analysis.probe_size": 12},
            r"config.analysis.probe_size=12 must be .* divisible by the 8",
        ),
        (
            {"analysis.every_steps": 2, "analysis.probe_size": 400},
            r"config.analysis.probe_size=400 must be .* at most the 360 examples",
        ),
    ],
)
def test_bad_config_fails_before_compiling(tmp_path, overrides, match):
    config = tiny_config(**overrides)
    config.mesh = {"data": 8}
    with pytest.raises(ValueError, match=match):
        supervised.train_and_evaluate(config, str(tmp_path))
    assert not (tmp_path / "checkpoints").exists()


def test_missing_dataset_is_one_line(tmp_path):
    config = tiny_config()
    config.dataset.name = "cifar10"
    config.dataset.data_dir = str(tmp_path / "no_data")
    config.model.patch_size = 4
    with pytest.raises(
        FileNotFoundError, match=r"config.dataset.name='cifar10': dataset not found in data dir .*no_data.*docs/data.md"
    ) as err:
        supervised.check_config(config)
    assert "\n" not in str(err.value)


@pytest.mark.slow
def test_gradient_accumulation_equals_the_full_batch(tmp_path):
    full = supervised.train_and_evaluate(tiny_config(total_steps=3, log_every_steps=3), str(tmp_path / "full"))
    accum = supervised.train_and_evaluate(
        tiny_config(total_steps=3, log_every_steps=3, grad_accum_steps=4), str(tmp_path / "accum")
    )
    np.testing.assert_allclose(accum["train_loss"], full["train_loss"], rtol=1e-5)
    a, b = _read_params(str(tmp_path / "full")), _read_params(str(tmp_path / "accum"))
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-6), a["params"], b["params"])


@pytest.mark.slow
def test_live_kappa_monitoring_logs_probe_log_kappa(tmp_path):
    """config.analysis.every_steps: log κ of ① and ③ per layer on the fixed probe batch, at
    multiples of every_steps and the last step only, equal to a float64 numpy recomputation."""
    from skipless_jax.data import inputs
    from skipless_jax.models import vit

    config = tiny_config("depth=2,skip_sab=False,skip_ffn=False,init=skipless", total_steps=5, log_every_steps=5)
    config.analysis.every_steps = 2
    config.analysis.probe_size = 16
    supervised.train_and_evaluate(config, str(tmp_path))

    scalars = read_scalars(tmp_path)
    kappa_tags = sorted(t for t in scalars if t.startswith("log_kappa/"))
    assert kappa_tags == [f"log_kappa/{p}/layer_{layer}" for p in ("ffn", "sab") for layer in (0, 1)]
    for tag in kappa_tags:
        assert sorted(scalars[tag]) == [2, 4, 5]

    # Reference for the last step: the final parameters on the first 16 eval images, κ in float64.
    params = _read_params(str(tmp_path))["params"]
    images = next(inputs.eval_iterator(config, 0, 1)[0])["image"][:16]
    model = vit.build(config.model, num_classes=10)
    _, out = model.apply({"params": params}, images, train=False)
    for point in ("sab", "ffn"):
        for layer, block in enumerate(out["blocks"]):
            s = np.linalg.svd(np.asarray(block[point], np.float64), compute_uv=False)
            expected = np.mean(np.log(s[:, 0] / s[:, -1]))
            np.testing.assert_allclose(scalars[f"log_kappa/{point}/layer_{layer}"][5], expected, rtol=1e-3)
    # The probe is fixed: a different step's value differs only because the parameters changed.
    assert scalars["log_kappa/sab/layer_0"][2] != scalars["log_kappa/sab/layer_0"][5]


@pytest.mark.slow
def test_a_changed_model_in_an_old_workdir_fails_and_keeps_the_checkpoints(tmp_path):
    supervised.train_and_evaluate(tiny_config(total_steps=2), str(tmp_path))
    saved = sorted(os.listdir(tmp_path / "checkpoints"))
    deeper = tiny_config("depth=3", total_steps=2)
    with pytest.raises(
        pretrained.ConfigChangedError,
        match=r"another config \(model\.depth: 1 -> 3\); use a new --workdir, or pass --allow_config_change",
    ):
        supervised.train_and_evaluate(deeper, str(tmp_path))
    # Forced: the parameters still do not fit.
    with pytest.raises(
        checkpoint.IncompatibleCheckpointError,
        match=r"step 2 .* other parameters \(not in the checkpoint: \['block_1'\]",
    ):
        supervised.train_and_evaluate(deeper, str(tmp_path), allow_config_change=True)
    with pytest.raises(checkpoint.IncompatibleCheckpointError, match=r"other shape: \['block_0'\]"):
        supervised.train_and_evaluate(
            tiny_config(total_steps=2, **{"model.mlp_dim": 48}), str(tmp_path), allow_config_change=True
        )
    assert sorted(os.listdir(tmp_path / "checkpoints")) == saved  # nothing set aside
    assert not (tmp_path / "checkpoints_unreadable").exists()
    # A longer schedule is a deliberate change: refused without the flag, resumed with it.
    with pytest.raises(pretrained.ConfigChangedError, match=r"total_steps: 2 -> 4"):
        supervised.train_and_evaluate(tiny_config(total_steps=4), str(tmp_path))
    resumed = supervised.train_and_evaluate(tiny_config(total_steps=4), str(tmp_path), allow_config_change=True)
    assert resumed["step"] == 4


@pytest.mark.parametrize("first, second, field", [
    ("", "skip_sab=False", "model.skip_sab: True -> False"),  # same parameter shapes: resumed the other model before
    ("opt=soap", "opt=adamw", "optimizer.name: 'soap' -> 'adamw'"),  # set the checkpoints aside and retrained before
])
def test_a_changed_config_with_the_same_shapes_is_refused_and_nothing_moves(tmp_path, first, second, field):
    supervised.train_and_evaluate(tiny_config(first, total_steps=2), str(tmp_path))
    before = sorted(os.listdir(tmp_path / "checkpoints"))
    with pytest.raises(pretrained.ConfigChangedError, match=re.escape(field)) as err:
        supervised.train_and_evaluate(tiny_config(second, total_steps=2), str(tmp_path))
    assert "\n" not in str(err.value)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == before
    assert not (tmp_path / "checkpoints_unreadable").exists()


def test_a_finished_run_rerun_reports_its_final_metrics_and_changes_nothing(tmp_path):
    config = tiny_config(total_steps=4)
    first = supervised.train_and_evaluate(config, str(tmp_path))
    files = {p: os.path.getmtime(p) for p in glob.glob(str(tmp_path / "**"), recursive=True) if os.path.isfile(p)}
    final = (tmp_path / "final_metrics.json").read_text()
    again = supervised.train_and_evaluate(tiny_config(total_steps=4), str(tmp_path))
    assert again == first and again["test_accuracy"] == first["test_accuracy"]
    assert (tmp_path / "final_metrics.json").read_text() == final
    now = {p: os.path.getmtime(p) for p in glob.glob(str(tmp_path / "**"), recursive=True) if os.path.isfile(p)}
    assert now == files  # no file written, none added


def test_aug_label_smoothing_is_refused():
    """(mixup_prob acting: tests/test_device_mix.py.)"""
    from skipless_jax.data import augment

    aug = ml_collections.ConfigDict(config_blocks.deit_aug())
    aug.label_smoothing = 0.1
    with pytest.raises(ValueError, match=r"aug\.label_smoothing=0\.1 is not used; set config\.label_smoothing"):
        augment.validate_aug_config(aug)


def test_records_carry_dense_targets_through_the_pipeline_and_splits_slice():
    """Digit scenes: the segmentation and padded boxes travel with their images; a minival
    carved from train ('train[:10%]') sits next to the rest of train ('train[10%:]')."""
    from skipless_jax.data import inputs

    config = tiny_config(**{"dataset.name": "digit_scenes", "model.patch_size": 4})
    source = sources.get_source("digit_scenes", "test")
    batches, n = inputs.eval_iterator(config, 0, 1, "test", batch_size=64)
    batch = next(batches)
    assert n == len(source) == 720
    assert batch["segmentation"].shape == (64, 32, 32) and batch["boxes_padded"].shape == (64, 3, 4)
    for i in (0, 17, 63):
        np.testing.assert_array_equal(batch["segmentation"][i], source[i]["segmentation"])
        np.testing.assert_array_equal(batch["num_boxes"][i], source[i]["num_boxes"])
    train = next(inputs.train_iterator(config, 0, 0, 1))
    assert train["segmentation"].shape == (32, 32, 32)

    minival, rest = sources.get_source("digits", "train[:10%]"), sources.get_source("digits", "train[10%:]")
    full = sources.get_source("digits", "train")
    assert len(minival) == 144 and len(rest) == 1437 - 144
    np.testing.assert_array_equal(minival[0]["image"], full[0]["image"])
    np.testing.assert_array_equal(rest[0]["image"], full[144]["image"])
    with pytest.raises(ValueError, match=r"split 'valid' of 'digits' is unknown"):
        sources.get_source("digits", "valid")


@pytest.mark.slow
def test_several_evaluation_splits_report_under_their_prefixes(tmp_path):
    config = tiny_config(total_steps=2)
    config.dataset.train_split = "train[10%:]"
    config.evals = ml_collections.ConfigDict(dict(
        minival=dict(type="classification", split="train[:10%]"),
        test=dict(type="classification", split="test"),
        knn=dict(type="knn", split="test", train_split="train[10%:]", k=5, prefix="test"),
    ))
    metrics = supervised.train_and_evaluate(config, str(tmp_path))
    for key in ("minival_accuracy", "minival_loss", "test_accuracy", "test_loss", "test_knn_accuracy"):
        assert 0.0 <= metrics[key] <= max(1.0, metrics[key]), key
    assert metrics["minival_accuracy"] != metrics["test_accuracy"] or metrics["minival_loss"] != metrics["test_loss"]
    scalars = read_scalars(str(tmp_path))
    assert 2 in scalars["minival/accuracy"] and 2 in scalars["test/knn_accuracy"]


@pytest.mark.slow
def test_quickstart_val_split_and_init_self_share_reach_the_final_metrics(tmp_path, caplog):
    """`val=True` adds val_accuracy (train[90%:]) beside test_accuracy; `self_share` sets β by its
    target before the model is built: in the log and in final_metrics.json; the saved config is
    the one given (init_beta as given, the target beside it); a rerun of the finished run finds the
    same β and the same config."""
    from skipless_jax.models import init

    config = tiny_config("init=skipless,self_share=0.7,val=True", total_steps=2)
    beta = init.self_share_beta(tiny_config("init=skipless").model, 16, 0.7)
    with caplog.at_level(logging.INFO, logger="absl"):  # absl's own level, whatever an earlier test left
        metrics = supervised.train_and_evaluate(config, str(tmp_path))
    assert f"init_self_share=0.7 at 16 tokens: init_beta={beta:g}" in caplog.text
    final = json.loads((tmp_path / "final_metrics.json").read_text())
    assert final["init_beta"] == metrics["init_beta"] == beta != 0.6
    assert 0.0 <= final["val_accuracy"] <= 1.0 and "test_accuracy" in final
    saved = checkpoint.saved_config(str(tmp_path))["model"]
    assert (saved["init_beta"], saved["init_self_share"]) == (config.model.init_beta, 0.7) == (0.6, 0.7)
    again = supervised.train_and_evaluate(tiny_config("init=skipless,self_share=0.7,val=True", total_steps=2),
                                          str(tmp_path))
    assert again == final


@pytest.mark.slow
def test_init_from_a_dino_teacher_maps_the_backbone_and_keeps_a_fresh_head(tmp_path, tiny_dino_run):
    """config.init_from with init_from_key='teacher': block and embedding weights are the DINO
    teacher's backbone, the new classifier head keeps its initialization."""
    from jax.sharding import NamedSharding, PartitionSpec

    from skipless_jax import models

    _, dino_workdir = tiny_dino_run  # configs/dino_digits.py shrunk, 3 steps (conftest.py)
    one = one_device()
    _, saved = checkpoint.load_raw(dino_workdir)

    config = tiny_config(
        total_steps=1, init_from=dino_workdir, init_from_key="teacher", **{"schedule.warmup_steps": 0}
    )
    config.model.update(dict(patch_size=4, pool="tok", gelu="exact", posemb_antialias=False))
    config.input.image_size = 8
    model = models.build(config.model, 10)
    params = jax.jit(model.init)(jax.random.PRNGKey(0), jnp.zeros((1, 8, 8, 1)))["params"]
    replicated = NamedSharding(jax.sharding.Mesh(one, ("data",)), PartitionSpec())
    repl = jax.tree.map(lambda _: replicated, params)
    loaded = pretrained.init_from(config.init_from, params, repl, "teacher", warm_start.classifier_rename("teacher"))
    np.testing.assert_array_equal(loaded["block_0"]["MlpBlock_0"]["Dense_0"]["kernel"],
                                  saved["teacher"]["backbone"]["block_0"]["MlpBlock_0"]["Dense_0"]["kernel"])
    np.testing.assert_array_equal(loaded["pos_embedding"], saved["teacher"]["backbone"]["pos_embedding"])
    np.testing.assert_array_equal(loaded["head"]["kernel"], params["head"]["kernel"])  # fresh
    assert supervised.train_and_evaluate(config, str(tmp_path / "sup"), devices=one)["step"] == 1
    with pytest.raises(ValueError, match=r"config\.init_from=.* has no teacher/"):
        pretrained.init_from(config.init_from, {"nope": params["head"]["kernel"]}, {"nope": repl["head"]["kernel"]},
                         "teacher", lambda name: name)


@pytest.mark.slow
def test_evaluate_command_reports_the_final_metrics_of_a_finished_run(tmp_path):
    """`python -m skipless_jax.evaluate --workdir=DIR` on a finished run equals its last evaluation."""
    from skipless_jax import evaluate

    config = tiny_config(total_steps=4)
    final = supervised.train_and_evaluate(config, str(tmp_path))
    results = evaluate.evaluate(str(tmp_path))  # the saved config
    assert results["step"] == 4
    np.testing.assert_allclose(results["test_accuracy"], final["test_accuracy"], rtol=1e-6)
    np.testing.assert_allclose(results["test_loss"], final["test_loss"], rtol=1e-5)
    assert json.loads((tmp_path / "evaluation.json").read_text())["test_accuracy"] == results["test_accuracy"]
    config.evals = ml_collections.ConfigDict(dict(knn=dict(type="knn", k=5)))
    assert 0.0 <= evaluate.evaluate(str(tmp_path), config)["knn_knn_accuracy"] <= 1.0  # another evaluator
    with pytest.raises(ValueError, match=r"--config trains another model than the checkpoint .*model\.depth"):
        evaluate.evaluate(str(tmp_path), tiny_config("depth=3", total_steps=4))
