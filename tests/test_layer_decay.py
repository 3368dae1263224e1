"""Layer-wise lr decay (docs/method/ssl.md §9; MAE util/lr_decay.py) against a numpy per-group AdamW, and SOAP."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from skipless_jax.models import vit
from skipless_jax.optim import OPTIMIZERS, decay_mask
from skipless_jax.optim.layer_decay import layer_decay, layer_scales, scale_by_layer

vit_layer_id = vit.layer_id

DECAY = 0.65
DEPTH = 3
LAYER_ID = functools.partial(vit.layer_id, num_layers=DEPTH)


def _paths(tree):
    return {"/".join(str(k.key) for k in p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def expected_scale(path):
    """MAE: num_layers = len(blocks) + 1; scale = decay ** (num_layers - id)."""
    num_layers = DEPTH + 1
    top = path.split("/")[0]
    if top in ("cls", "pos_embedding") or top == "embedding":
        layer_id = 0
    elif top.startswith("block_"):
        layer_id = int(top.split("_")[1]) + 1
    else:
        layer_id = num_layers
    return DECAY ** (num_layers - layer_id)


@pytest.mark.parametrize(
    "path, layer_id",
    [("cls", 0), ("pos_embedding", 0), ("embedding/kernel", 0), ("params/embedding/bias", 0),
     ("block_0/MlpBlock_0/Dense_0/kernel", 1), ("block_11/LayerNorm_0/scale", 12),
     ("encoder_norm/scale", 13), ("fc_norm/bias", 13), ("head/kernel", 13)],
)
def test_vit_layer_id(path, layer_id):
    assert vit_layer_id(path, 12) == layer_id


def test_a_vit_layer_id_reads_the_role_not_a_name_prefix():
    with pytest.raises(ValueError, match="'embedding_extra/kernel' has no role"):  # not the stem's, nor any
        vit_layer_id("embedding_extra/kernel", 12)


def test_scales_for_every_leaf_of_a_depth_3_vit():
    model = vit.ViT(num_classes=10, patch_size=4, width=16, depth=DEPTH, mlp_dim=32, num_heads=2)
    params = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), jnp.zeros((1, 8, 8, 3))))["params"]
    assert set(params) == {"cls", "pos_embedding", "embedding", "block_0", "block_1", "block_2", "encoder_norm", "head"}
    scales = _paths(layer_scales(params, DECAY, DEPTH, LAYER_ID))
    assert set(scales) == set(_paths(params))
    for path, scale in scales.items():
        assert scale == pytest.approx(expected_scale(path), rel=1e-12), path
    assert scales["head/kernel"] == 1.0 and scales["cls"] == pytest.approx(DECAY**4)
    assert scales["block_2/MlpBlock_0/Dense_1/kernel"] == pytest.approx(DECAY)


def _toy():
    rng = np.random.default_rng(0)
    shapes = {"cls": (1, 1, 4), "embedding": {"kernel": (6, 4), "bias": (4,)},
              "block_0": {"Dense_0": {"kernel": (4, 4), "bias": (4,)}},
              "block_2": {"Dense_0": {"kernel": (4, 5), "bias": (5,)}},
              "encoder_norm": {"scale": (4,)}, "head": {"kernel": (4, 3), "bias": (3,)}}
    draw = lambda s: rng.normal(size=s).astype(np.float32)
    params = jax.tree.map(draw, shapes, is_leaf=lambda s: isinstance(s, tuple))
    grads = [jax.tree.map(lambda p: rng.normal(size=p.shape).astype(np.float32), params) for _ in range(3)]
    return params, grads


def _run(tx, params, grads):
    state = tx.init(params)
    p, updates = params, []
    for g in grads:
        u, state = tx.update(g, state, p)
        updates.append(u)
        p = optax.apply_updates(p, u)
    return p, updates


@pytest.mark.slow
def test_adamw_with_layer_decay_equals_per_group_torch_adamw():
    params, grads = _toy()
    schedule = optax.linear_schedule(1e-2, 5e-3, 3)
    hyper = dict(b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.05)
    tx = optax.chain(OPTIMIZERS["adamw"](hyper, schedule), layer_decay(DECAY, DEPTH, LAYER_ID))
    got, _ = _run(tx, params, grads)

    # torch.optim.AdamW per param group: lr = lr_t * lr_scale, weight decay 0 on 1-D / cls (MAE's groups).
    flat_p = {k: v.astype(np.float64) for k, v in _paths(params).items()}
    decays = _paths(decay_mask(params))
    m = {k: np.zeros_like(v) for k, v in flat_p.items()}
    v = {k: np.zeros_like(x) for k, x in flat_p.items()}
    for t, g in enumerate(grads, start=1):
        lr_t = float(schedule(t - 1))
        for k, gk in _paths(g).items():
            lr = lr_t * expected_scale(k)
            wd = hyper["weight_decay"] if decays[k] else 0.0
            flat_p[k] = flat_p[k] * (1 - lr * wd)
            m[k] = hyper["b1"] * m[k] + (1 - hyper["b1"]) * gk
            v[k] = hyper["b2"] * v[k] + (1 - hyper["b2"]) * gk.astype(np.float64) ** 2
            denom = np.sqrt(v[k]) / np.sqrt(1 - hyper["b2"] ** t) + hyper["eps"]
            flat_p[k] = flat_p[k] - lr / (1 - hyper["b1"] ** t) * m[k] / denom
    for k, want in flat_p.items():
        np.testing.assert_allclose(np.asarray(_paths(got)[k]), want, rtol=1e-5, atol=1e-6, err_msg=k)
    assert not decays["cls"] and not decays["embedding/bias"] and decays["embedding/kernel"]


@pytest.mark.slow
def test_soap_accepts_scale_by_layer():
    params, grads = _toy()
    hyper = dict(b1=0.9, b2=0.95, weight_decay=0.05, precondition_frequency=2)
    scales = layer_scales(params, DECAY, DEPTH, LAYER_ID)
    inner = OPTIMIZERS["soap"](hyper, 1e-2)
    scaled = optax.chain(OPTIMIZERS["soap"](hyper, 1e-2), scale_by_layer(scales))
    # Same gradients and params on both: the inner states evolve identically, scale_by_layer is stateless.
    s_in, s_sc = inner.init(params), scaled.init(params)
    update_in, update_sc = jax.jit(inner.update), jax.jit(scaled.update)  # one program each, not op by op
    for g in grads[:2]:  # call 0 is SOAP's zero step; call 1 is a real update
        u_in, s_in = update_in(g, s_in, params)
        u_sc, s_sc = update_sc(g, s_sc, params)
    flat_in, flat_sc, flat_s = _paths(u_in), _paths(u_sc), _paths(scales)
    assert any(np.abs(np.asarray(x)).max() > 0 for x in flat_in.values())
    for k in flat_in:
        np.testing.assert_allclose(np.asarray(flat_sc[k]), flat_s[k] * np.asarray(flat_in[k]), rtol=1e-6, err_msg=k)
    update_sc(grads[2], s_sc, params)  # a third step: the preconditioner refreshed under jit


def test_swin_relative_position_tables_are_not_decayed():
    """Swin's set_weight_decay skips names containing relative_position_bias_table; kernels decay."""
    import jax.tree_util as jtu

    from skipless_jax import sharding
    params = {
        "stage_0": {"block_0": {"attn": {"relative_position_bias": jnp.zeros((9, 2)),
                                         "qkv": {"kernel": jnp.zeros((8, 24)), "bias": jnp.zeros((24,))}}}},
    }
    decays = {sharding.path_str(k): bool(v) for k, v in jtu.tree_flatten_with_path(decay_mask(params))[0]}
    assert decays == {"stage_0/block_0/attn/relative_position_bias": False,
                      "stage_0/block_0/attn/qkv/kernel": True, "stage_0/block_0/attn/qkv/bias": False}
