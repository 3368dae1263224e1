"""Per-layer kNN and linear probe (docs/method/per_layer_eval.md): the metric at block i equals
the last-layer evaluator on the model cut after block i (depth i + 1, the same parameters), for
the ViT and ConvMixer on digits; names, `best_layer`, the curve, the one-line errors."""

import re

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from skipless_jax import models, sharding
from skipless_jax.evaluators import common, knn, linear_probe, per_layer

from util import load_config, tiny_model

DEPTH = 3
_BLOCK = re.compile(r"block_(\d+)(_|$)")


def digits_config(family):
    config = load_config("quickstart")
    if family == "vit":
        config.model.update(width=16, depth=DEPTH, mlp_dim=32, num_heads=2)
    else:
        config.model = ml_collections.ConfigDict(dict(tiny_model(dict(name=family), 8), depth=DEPTH))
    return config


def context(config):
    """The supervised trainer's view: features = pre_logits, outputs = the out dict; the variables
    are {'params', ['batch_stats']} (ConvMixer's BatchNorm)."""
    model = models.build(config.model, 10)
    apply = lambda variables, images: model.apply(variables, images, train=False)[1]
    return common.Context(config, sharding.make_mesh(config.mesh), 10,
                          features=lambda v, images: apply(v, images)["pre_logits"], outputs=apply)


def cut(variables, block):
    """The variables of the model cut after `block`: every collection without the later blocks."""
    keep = lambda name: not (_BLOCK.match(name) and int(_BLOCK.match(name).group(1)) > block)
    return {c: {k: v for k, v in tree.items() if keep(k)} for c, tree in variables.items()}


def evaluator(cls, ctx, layers=None, **fields):
    kind = "knn" if cls is knn.KNN else "linear_probe"
    entry = ml_collections.ConfigDict(dict(type=kind, train_split="train[:300]", **fields))
    if layers is not None:
        entry.layers = layers
    return cls.from_config(kind, entry, ctx, prefix=kind, every_steps=None, split="test[:120]")


@pytest.mark.slow
@pytest.mark.parametrize("family", ["vit", "convmixer"])
def test_knn_at_block_i_is_the_knn_of_the_model_cut_after_it(family):
    config = digits_config(family)
    variables = dict(models.build(config.model, 10).init(jax.random.PRNGKey(0), jnp.zeros((1, 8, 8, 1))))
    got = dict(evaluator(knn.KNN, context(config), "all", k=5).run(variables))
    assert sorted(got) == ["best_layer"] + [f"layer_{i}/knn_accuracy" for i in range(DEPTH)]
    for i in range(DEPTH):
        short = digits_config(family)
        short.model.depth = i + 1
        want = dict(evaluator(knn.KNN, context(short), k=5).run(cut(variables, i)))
        assert list(want) == ["knn_accuracy"]  # 'last': today's name
        assert got[f"layer_{i}/knn_accuracy"] == want["knn_accuracy"], i
    accuracies = [got[f"layer_{i}/knn_accuracy"] for i in range(DEPTH)]
    assert got["best_layer"] == int(np.argmax(accuracies))


@pytest.mark.slow
def test_linear_probe_per_layer_names_and_the_cut_model():
    config = digits_config("vit")
    variables = dict(models.build(config.model, 10).init(jax.random.PRNGKey(0), jnp.zeros((1, 8, 8, 1))))
    got = dict(evaluator(linear_probe.LinearProbe, context(config), [2, 0], steps=30).run(variables))
    assert list(got) == ["layer_2/linear_accuracy", "layer_0/linear_accuracy", "best_layer"]
    short = digits_config("vit")
    short.model.depth = 1
    want = dict(evaluator(linear_probe.LinearProbe, context(short), steps=30).run(cut(variables, 0)))
    assert abs(got["layer_0/linear_accuracy"] - want["linear_accuracy"]) <= 1 / 120


def test_curve_png(tmp_path):
    metrics = {"knn_layer_1/knn_accuracy": 0.5, "knn_layer_0/knn_accuracy": 0.25, "knn_best_layer": 1.0}
    assert per_layer.curves(metrics) == {"knn_accuracy": [(0, 0.25), (1, 0.5)]}
    assert per_layer.draw(str(tmp_path / "c.png"), metrics, "knn")
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"
    assert not per_layer.draw(str(tmp_path / "none.png"), {"knn_knn_accuracy": 0.5}, "knn")
    assert not (tmp_path / "none.png").exists()


@pytest.mark.parametrize("layers, family, message", [
    ("every", "vit", r"config\.evals\.knn\.layers='every' is not allowed; allowed: 'last', 'all' or a list"),
    ([1, 1], "vit", r"config\.evals\.knn\.layers=\[1, 1\] is not allowed"),
    ([0, 3], "vit", r"config\.evals\.knn\.layers=\[0, 3\]: block 3 does not exist; allowed: 0 … 2 \(3 blocks\)"),
    ("all", "cait", r"config\.evals\.knn\.layers='all': the 'cait' family has no per-block features"),
])
def test_bad_layers_are_one_line(layers, family, message):
    from skipless_jax import evaluators

    config = digits_config(family)
    config.evals = ml_collections.ConfigDict(dict(knn=dict(type="knn", layers=layers)))
    with pytest.raises(ValueError, match=message) as err:
        evaluators.check_config(config)
    assert "\n" not in str(err.value)


@pytest.mark.slow
def test_evaluate_only_writes_the_per_layer_metrics_and_their_curve(tmp_path):
    from skipless_jax import evaluate
    from skipless_jax.trainers import supervised

    from util import tiny_config

    config = tiny_config(total_steps=2)
    config.model.depth = 2
    config.evals = ml_collections.ConfigDict(dict(test=dict(type="classification"),
                                                  knn=dict(type="knn", k=5, layers="all")))
    supervised.train_and_evaluate(config, str(tmp_path))
    got = evaluate.evaluate(str(tmp_path), only=["knn"])
    assert sorted(got) == ["knn_best_layer", "knn_layer_0/knn_accuracy", "knn_layer_1/knn_accuracy", "step"]
    assert (tmp_path / "eval" / "knn.json").exists()
    assert (tmp_path / "eval" / "knn_layers.png").read_bytes()[:4] == b"\x89PNG"
