"""The supervised trainer on digits: learning, exact resume, evaluation coverage, bad input."""

import json
import os

import jax
import numpy as np
import pytest

from skipless_jax import checkpoint, train
from skipless_jax.data import pipeline, sources

from util import read_scalars, tiny_config


def _read_params(workdir, step=None):
    return checkpoint.load_raw(workdir, step)[1]


def test_loss_decreases_on_digits(tmp_path):
    config = tiny_config(total_steps=60)
    config.optimizer.lr = 1e-2
    metrics = train.train_and_evaluate(config, str(tmp_path))
    assert metrics["step"] == 60
    # The zero-initialized head starts at loss ln 10 = 2.30 and chance accuracy 10%.
    assert metrics["test_loss"] < 1.5, metrics
    assert metrics["test_accuracy"] > 0.4, metrics
    assert json.load(open(tmp_path / "final_metrics.json"))["step"] == 60


def test_resume_continues_from_saved_step_and_matches(tmp_path):
    config = tiny_config(total_steps=8, checkpoint_every_steps=4)
    train.train_and_evaluate(config, str(tmp_path / "full"))
    reference = _read_params(str(tmp_path / "full"))
    # Lose the last checkpoint, as if the run had died between steps 4 and 8.
    mngr = checkpoint.manager(str(tmp_path / "full"))
    assert mngr.all_steps() == [4, 8]
    mngr.delete(8)
    mngr.close()
    metrics = train.train_and_evaluate(config, str(tmp_path / "full"))
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
    make = lambda start, p=0, n=1: pipeline.train_batches(  # noqa: E731
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
    key = lambda x: sorted(map(bytes, x))  # noqa: E731
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
        ({"analysis.every_steps": 2, "analysis.probe_size": 12}, r"config.analysis.probe_size=12 must be .* divisible by the 8"),
        ({"analysis.every_steps": 2, "analysis.probe_size": 400}, r"config.analysis.probe_size=400 must be .* at most the 360 examples"),
    ],
)
def test_bad_config_fails_before_compiling(tmp_path, overrides, match):
    config = tiny_config(**overrides)
    config.mesh = [("data", 8)]
    with pytest.raises(ValueError, match=match):
        train.train_and_evaluate(config, str(tmp_path))
    assert not (tmp_path / "checkpoints").exists()


def test_missing_dataset_is_one_line(tmp_path):
    config = tiny_config()
    config.dataset.name = "cifar10"
    config.dataset.data_dir = str(tmp_path / "no_data")
    config.model.patch_size = 4
    with pytest.raises(FileNotFoundError, match=r"config.dataset.name='cifar10': dataset not found in data dir .*no_data.*docs/data.md") as err:
        train.check_config(config)
    assert "\n" not in str(err.value)


def test_gradient_accumulation_equals_the_full_batch(tmp_path):
    full = train.train_and_evaluate(tiny_config(total_steps=3, log_every_steps=3), str(tmp_path / "full"))
    accum = train.train_and_evaluate(tiny_config(total_steps=3, log_every_steps=3, grad_accum_steps=4), str(tmp_path / "accum"))
    np.testing.assert_allclose(accum["train_loss"], full["train_loss"], rtol=1e-5)
    a, b = _read_params(str(tmp_path / "full")), _read_params(str(tmp_path / "accum"))
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-6), a["params"], b["params"])


def test_live_kappa_monitoring_logs_probe_log_kappa(tmp_path):
    """config.analysis.every_steps: log κ of ① and ③ per layer on the fixed probe batch, at
    multiples of every_steps and the last step only, equal to a float64 numpy recomputation."""
    from skipless_jax.data import inputs
    from skipless_jax.models import vit

    config = tiny_config("skip_sab=False,skip_ffn=False,init=skipless", total_steps=5, log_every_steps=5)
    config.analysis.every_steps = 2
    config.analysis.probe_size = 16
    train.train_and_evaluate(config, str(tmp_path))

    scalars = read_scalars(tmp_path)
    kappa_tags = sorted(t for t in scalars if t.startswith("log_kappa/"))
    assert kappa_tags == [f"log_kappa/{p}/layer_{l}" for p in ("ffn", "sab") for l in (0, 1)]
    for tag in kappa_tags:
        assert sorted(scalars[tag]) == [2, 4, 5]

    # Reference for the last step: the final parameters on the first 16 eval images, κ in float64.
    params = _read_params(str(tmp_path))["params"]
    images = next(inputs.eval_iterator(config, 0, 1)[0])["image"][:16]
    model = vit.build_model(config.model, num_classes=10)
    _, out = model.apply({"params": params}, images, train=False)
    for point in ("sab", "ffn"):
        for layer, block in enumerate(out["blocks"]):
            s = np.linalg.svd(np.asarray(block[point], np.float64), compute_uv=False)
            expected = np.mean(np.log(s[:, 0] / s[:, -1]))
            np.testing.assert_allclose(scalars[f"log_kappa/{point}/layer_{layer}"][5], expected, rtol=1e-3)
    # The probe is fixed: a different step's value differs only because the parameters changed.
    assert scalars["log_kappa/sab/layer_0"][2] != scalars["log_kappa/sab/layer_0"][5]


def test_a_changed_model_in_an_old_workdir_fails_and_keeps_the_checkpoints(tmp_path):
    train.train_and_evaluate(tiny_config(total_steps=2), str(tmp_path))
    saved = sorted(os.listdir(tmp_path / "checkpoints"))
    deeper = tiny_config("depth=3", total_steps=4)
    with pytest.raises(checkpoint.IncompatibleCheckpointError, match=r"step 2 .* other parameters \(not in the checkpoint: \['block_2'\]"):
        train.train_and_evaluate(deeper, str(tmp_path))
    with pytest.raises(checkpoint.IncompatibleCheckpointError, match=r"other shape: \['block_0'\]"):
        train.train_and_evaluate(tiny_config(total_steps=4, **{"model.mlp_dim": 48}), str(tmp_path))
    assert sorted(os.listdir(tmp_path / "checkpoints")) == saved  # nothing set aside
    assert not (tmp_path / "checkpoints_unreadable").exists()
    assert train.train_and_evaluate(tiny_config(total_steps=4), str(tmp_path))["step"] == 4  # the same config resumes
