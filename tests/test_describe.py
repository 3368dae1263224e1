"""`models.describe` (what evaluators and layer decay ask of a model) on every family, and the
evaluators and layer decay on every family: tiny random-init models on 32×32 digit scenes.

Each family's facts are checked against the built model (the block count, the `encoded` grid);
layer decay's multipliers against the per-family rule of docs/method/ssl.md §9 written out here by
parameter name; feature PCA and the linear segmentation probe against `model.apply` read by
hand; TokenCut on the families with attention keys on their token grid, refused by the config
check in one line on the others.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from skipless_jax import evaluators, models, optim, pictures, sharding, validate
from skipless_jax.data import pipeline, sources
from skipless_jax.evaluators import feature_pca, segmentation, tokencut

from util import tiny_config, tiny_model

SIZE = 32
FAMILIES = ("vit", "convmixer", "swin", "cait", "pvt_v2")
# (patch_size, token_stride, depth, prefix_tokens, width, block_keys, normed_blocks) of the tiny models.
EXPECTED = {
    "vit": (4, 4, 2, 1, 32, True, True),
    "convmixer": (2, 2, 1, 0, 16, False, False),
    "swin": (2, 4, 3, 0, 16, False, False),
    "cait": (8, 8, 1, 1, 16, True, False),
    "pvt_v2": (2, 4, 2, 0, 16, False, False),
}
# Layer-decay ids of each tiny model's top-level parameter names (docs/method/ssl.md §9): 0 the stem,
# a block's index + 1 (a stage's downsampling with its first block, its norm with its last),
# num_layers + 1 the rest; num_layers = the largest block id.
LAYER_IDS = {
    "vit": {"cls": 0, "pos_embedding": 0, "embedding": 0, "block_0": 1, "block_1": 2, "encoder_norm": 3, "head": 3},
    "convmixer": {"embedding": 0, "embedding_norm": 0, "block_0_depthwise": 1, "block_0_depthwise_norm": 1,
                  "block_0_pointwise": 1, "block_0_pointwise_norm": 1, "head": 2},
    "swin": {"embedding": 0, "embedding_norm": 0, "stage_0_block_0": 1, "stage_0_block_1": 2, "stage_1_merge_norm": 3,
             "stage_1_merge": 3, "stage_1_block_0": 3, "encoder_norm": 4, "head": 4},
    "cait": {"embedding": 0, "pos_embedding": 0, "cls": 0, "block_0": 1, "class_block_0": 2, "encoder_norm": 3,
             "head": 3},
    "pvt_v2": {"embedding": 0, "stage_0_block_0": 1, "stage_0_norm": 1, "stage_1_downsample": 2, "stage_1_block_0": 2,
               "stage_1_norm": 2, "head": 3},
}


def scene_config(family: str) -> ml_collections.ConfigDict:
    c = tiny_config("depth=2")  # two blocks: the layer ids of both
    c.dataset.name, c.dataset.train_split, c.dataset.eval_split = "digit_scenes", "train", "test"
    c.input.image_size = None
    c.input.eval_batch_size = 16
    if family == "vit":
        c.model.patch_size, c.model.pool = 4, "tok"  # a class token before the grid
    else:
        c.model = ml_collections.ConfigDict(tiny_model({"name": family}, SIZE))
    return c


@functools.cache
def backbone(family: str):
    """(config, model, host variables) of the family's tiny backbone, initialized once; the
    variables hold ConvMixer's running statistics, so its outputs do not depend on the batch."""
    config = scene_config(family)
    model = models.build(config.model, 0, SIZE)
    variables = jax.jit(model.init)(jax.random.PRNGKey(0), jnp.zeros((1, SIZE, SIZE, 1)))
    return config, model, jax.device_get(variables)


@functools.cache
def apply_fn(family: str):
    _, model, _ = backbone(family)
    return jax.jit(lambda v, x: model.apply(v, x)[1])


def context(family: str):
    config, model, params = backbone(family)
    mesh = sharding.make_mesh({"data": -1, "fsdp": 1})
    ctx = evaluators.Context(config, mesh, 10, outputs=lambda v, x: model.apply(v, x)[1])
    return ctx, jax.device_put(params, sharding.replicated(mesh))


def common(name: str, split: str) -> dict:
    return dict(prefix=name, every_steps=None, split=split)


def scene_images(split: str) -> tuple[np.ndarray, list[dict]]:
    info = sources.dataset_info("digit_scenes")
    source = sources.get_source("digit_scenes", split)
    records = [source[i] for i in range(len(source))]
    return np.stack([pipeline.normalize(r["image"], info.mean, info.std) for r in records]), records


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_describe_matches_the_built_model(family):
    config, _, params = backbone(family)
    d = models.describe(config.model)
    assert (d.patch_size, d.token_stride, d.depth, d.prefix_tokens, d.width, d.block_keys, d.normed_blocks) == \
        EXPECTED[family]
    assert d.family == family and d.grid_tokens
    out = apply_fn(family)(params, jnp.zeros((2, SIZE, SIZE, 1)))
    assert len(out["blocks"]) == d.depth
    grid = SIZE // d.token_stride
    assert out["encoded"].shape == (2, d.prefix_tokens + grid * grid, d.width)
    assert all(("keys" in b) == d.block_keys for b in out["blocks"])
    assert all(("normed" in b) == d.normed_blocks for b in out["blocks"])
    if d.block_keys:
        assert out["blocks"][-1]["keys"].shape[1] - grid * grid in (0, d.prefix_tokens)
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.depth = 7


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_layer_decay_multipliers_follow_the_family_rule(family):
    config = scene_config(family)
    model = models.build(config.model, 10, SIZE)  # with its head
    params = jax.eval_shape(model.init, jax.random.PRNGKey(0), jnp.zeros((1, SIZE, SIZE, 1)))["params"]
    params = jax.tree.map(lambda x: jnp.full(x.shape, 0.5, x.dtype), params)
    config = ml_collections.ConfigDict(config.to_dict())
    config.optimizer.name, config.schedule.warmup_steps = "adamw", 1
    plain, _ = optim.build_optimizer(config, 10)
    config.optimizer.layer_decay = 0.5
    validate.validate_config(config)  # the config check accepts layer decay for every family
    decayed, _ = optim.build_optimizer(config, 10)
    ids = LAYER_IDS[family]
    assert set(params) == set(ids)
    num_layers = max(ids.values()) - 1
    assert models.describe(config.model).num_layers == num_layers
    grads = jax.tree.map(jnp.ones_like, params)

    def second_update(tx):  # step 0 has lr 0 (warm-up from 0)
        state = tx.init(params)
        _, state = tx.update(grads, state, params)
        return tx.update(grads, state, params)[0]

    u_plain, u_decayed = (jax.jit(lambda tx=tx: second_update(tx))() for tx in (plain, decayed))  # compiled once each
    for path, got in jax.tree_util.tree_flatten_with_path(u_decayed)[0]:
        top = path[0].key
        want = np.asarray(_at(u_plain, path)) * 0.5 ** (num_layers + 1 - ids[top])
        assert np.abs(np.asarray(_at(u_plain, path))).min() > 0, path
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, err_msg=str(path))


def _at(tree, path):
    for k in path:
        tree = tree[k.key]
    return tree


@pytest.mark.parametrize("family", FAMILIES)
def test_feature_pca_on_every_family(family):
    ctx, params = context(family)
    entry = ml_collections.ConfigDict(dict(type="feature_pca", images=4))
    evaluators.check_config(ml_collections.ConfigDict({**ctx.config.to_dict(), "evals": {"pca": entry.to_dict()}}))
    ev = feature_pca.FeaturePCA.from_config("pca", entry, ctx, **common("pca", "test[:8]"))
    images, rgb, share = ev.colours(params)
    d = models.describe(ctx.config.model)
    grid = SIZE // d.token_stride
    assert images.shape == (4, SIZE, SIZE, 1) and rgb.shape == (4, grid, grid, 3)
    # Independent: the first 4 test images through model.apply, prefix dropped, PCA on the host.
    x, _ = scene_images("test[:4]")
    encoded = np.asarray(apply_fn(family)(backbone(family)[2], x)["encoded"], np.float64)
    want_rgb, want_share = pictures.pca_rgb(encoded[:, d.prefix_tokens:].reshape(4, grid, grid, -1))
    assert share == pytest.approx(want_share, rel=1e-4) and 0 < share <= 1
    np.testing.assert_allclose(rgb, want_rgb, atol=2e-3)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_linear_segmentation_on_every_family(family):
    ctx, params = context(family)
    entry = ml_collections.ConfigDict(dict(type="linear_segmentation", train_split="train[:16]", steps=2, warmup=1))
    ev = segmentation.LinearSegmentation.from_config("seg", entry, ctx, **common("seg", "test[:4]"))
    d = models.describe(ctx.config.model)
    x, records = scene_images("test[:4]")
    grid = SIZE // d.token_stride
    feats = np.asarray(jax.jit(ev.features)(params, jnp.asarray(x)))
    encoded = np.asarray(apply_fn(family)(backbone(family)[2], x)["encoded"])
    want = encoded[:, d.prefix_tokens:].reshape(4, grid, grid, d.width)
    np.testing.assert_allclose(feats, want, rtol=1e-5, atol=1e-5)
    conf = ev.confusion(params, ev.train(params))
    assert conf.sum() == 4 * SIZE * SIZE - sum(int((r["segmentation"] == 255).sum()) for r in records)


@pytest.mark.parametrize("family", ["vit", "cait"])
def test_tokencut_on_the_families_with_keys(family):
    ctx, params = context(family)
    entry = ml_collections.ConfigDict(dict(type="tokencut"))
    evaluators.check_config(ml_collections.ConfigDict({**ctx.config.to_dict(), "evals": {"tc": entry.to_dict()}}))
    ev = tokencut.TokenCut.from_config("tc", entry, ctx, **common("tc", "test[:8]"))
    preds, gts = ev.boxes(params)
    x, records = scene_images("test[:8]")
    d = models.describe(ctx.config.model)
    grid = SIZE // d.token_stride
    keys = np.asarray(apply_fn(family)(backbone(family)[2], x)["blocks"][-1]["keys"])
    for pred, k in zip(preds, keys):
        _, mask, seed = tokencut.ncut(k[k.shape[0] - grid * grid:], (grid, grid))
        assert tuple(pred) == tokencut.box(mask, seed, d.token_stride, (SIZE, SIZE))
        assert 0 <= pred[0] < pred[2] <= SIZE and 0 <= pred[1] < pred[3] <= SIZE
    ((metric, value),) = list(ev.run(params))
    assert metric == "corloc" and value == tokencut.corloc(preds, [r["boxes"] for r in records])


@pytest.mark.parametrize("family", ["convmixer", "swin", "pvt_v2"])
def test_tokencut_is_refused_in_one_line_on_the_others(family):
    config = scene_config(family)
    config.evals = dict(tc=dict(type="tokencut"))
    with pytest.raises(ValueError, match=rf"^config\.evals\.tc: type 'tokencut' is not available for the {family} "
                                         r"family: [^\n]*keys[^\n]*$"):
        evaluators.check_config(config)


@pytest.mark.parametrize("family", ["convmixer", "swin", "cait", "pvt_v2"])
def test_multi_block_segmentation_is_refused_in_one_line_on_the_others(family):
    config = scene_config(family)
    config.evals = dict(seg=dict(type="linear_segmentation", protocol="ms", blocks=2))
    with pytest.raises(ValueError, match=rf"^config\.evals\.seg: type 'linear_segmentation' with blocks=2 is not "
                                         rf"available for the {family} family: [^\n]*$"):
        evaluators.check_config(config)


def test_layer_id_reads_a_parameter_path():
    d = models.describe(scene_config("swin").model)
    paths = ("params/embedding/kernel", "stage_0_block_1/mlp/Dense_0/kernel", "stage_1_merge/kernel", "head/bias")
    assert [d.layer_id(p) for p in paths] == [0, 2, 3, 4]
