"""Large-model switches of the ViT (config.model.scan, .remat, .attention_impl): the scanned
encoder computes the unrolled one's function, checkpoints convert between the layouts, the
per-layer optimizer pieces see layers, and remat cuts the train step's temporary memory
(XLA's memory analysis of the supervised trainer's own step, ViT-B/16 at 224)."""

import functools
import importlib.util
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from skipless_jax import checkpoint, models, pretrained
from skipless_jax.models import vit
from skipless_jax.optim import decay_mask
from skipless_jax.optim.layer_decay import layer_scales
from skipless_jax.trainers import supervised

from util import ROOT, init_params, one_device, tiny_config

_path = os.path.join(ROOT, "benchmarks", "large_model.py")
_spec = importlib.util.spec_from_file_location("benchmarks_large_model", _path)
large_model = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(large_model)

TINY = dict(num_classes=10, patch_size=2, width=32, depth=3, mlp_dim=64, num_heads=2, init_scheme="skipless",
            init_alpha=2.0, init_beta=0.6, init_c=3.0, head_zero_init=False)


def _images(n=4):
    return jnp.asarray(np.random.default_rng(0).normal(size=(n, 8, 8, 1)), jnp.float32)


@pytest.mark.slow
def test_scanned_encoder_equals_the_unrolled_one_in_logits_gradients_and_intermediates():
    x = _images()
    unrolled = vit.ViT(**TINY)
    params = init_params(unrolled, jax.random.PRNGKey(0), x)
    stacked = vit.stack_blocks(params)
    assert set(stacked) == {"embedding", "cls", "pos_embedding", "encoder_layers", "encoder_norm", "head"}
    assert stacked["encoder_layers"]["block"]["MlpBlock_0"]["Dense_0"]["kernel"].shape == (3, 32, 64)
    jax.tree.map(np.testing.assert_array_equal, vit.unstack_blocks(stacked), params)  # a round trip

    def loss(model, p):
        logits, out = model.apply({"params": p}, x, train=True, rngs={"dropout": jax.random.PRNGKey(1)})
        return (logits**2).sum(), out

    (l_u, out_u), g_u = jax.jit(jax.value_and_grad(lambda p: loss(unrolled, p), has_aux=True))(params)
    for extra in (dict(scan=True), dict(scan=True, remat="full"), dict(remat="dots")):
        model = vit.ViT(**TINY, **extra)
        p = stacked if extra.get("scan") else params
        (l_s, out_s), g_s = jax.jit(jax.value_and_grad(lambda q, m=model: loss(m, q), has_aux=True))(p)
        np.testing.assert_allclose(l_s, l_u, rtol=1e-5)
        g_s = vit.unstack_blocks(g_s)
        scale = max(float(jnp.abs(g).max()) for g in jax.tree.leaves(g_u))
        for a, b in zip(jax.tree.leaves(g_s), jax.tree.leaves(g_u)):
            np.testing.assert_allclose(a, b, atol=1e-5 * scale)
        assert len(out_s["blocks"]) == 3  # the κ analysis reads per-layer dicts either way
        ref = out_u["blocks"][2]["ffn_skip"]
        np.testing.assert_allclose(out_s["blocks"][2]["ffn_skip"], ref, atol=1e-5 * float(jnp.abs(ref).max()))


@pytest.mark.slow
def test_each_scanned_layer_draws_its_own_init_and_drop_path_rate():
    model = vit.ViT(**{**TINY, "drop_path": 0.5}, scan=True)
    params = init_params(model, jax.random.PRNGKey(0), _images())
    value = params["encoder_layers"]["block"]["MultiHeadAttention_0"]["value"]
    assert not np.allclose(value[0], value[1])  # not one layer copied L times
    # Layer 0's rate is 0: with the other layers' branches dropped for every example, the output
    # still differs from the eval output only through layers 1 and 2.
    train = jax.jit(lambda key: model.apply({"params": params}, _images(64), train=True, rngs={"dropout": key})[0])
    assert not np.allclose(train(jax.random.PRNGKey(1)), train(jax.random.PRNGKey(2)))


@pytest.mark.slow
def test_optimizer_masks_and_layer_decay_treat_the_stacked_axis_as_layers():
    params = vit.stack_blocks(init_params(vit.ViT(**TINY), jax.random.PRNGKey(0), _images()))
    mask = decay_mask(params)
    block = mask["encoder_layers"]["block"]
    assert block["MlpBlock_0"]["Dense_0"]["kernel"] and not block["MlpBlock_0"]["Dense_0"]["bias"]
    assert not block["LayerNorm_0"]["scale"]
    scales = layer_scales(params, 0.5, 3, functools.partial(vit.layer_id, num_layers=3))
    np.testing.assert_allclose(np.ravel(scales["encoder_layers"]["block"]["LayerNorm_0"]["bias"]),
                               [0.5**3, 0.5**2, 0.5**1])
    unrolled = layer_scales(vit.unstack_blocks(params), 0.5, 3, functools.partial(vit.layer_id, num_layers=3))
    assert unrolled["block_0"]["LayerNorm_0"]["bias"] == 0.5**3 and scales["head"]["bias"] == 1.0


@pytest.mark.slow
def test_a_checkpoint_initializes_a_model_of_the_other_layout(tmp_path):
    config = tiny_config(total_steps=2)
    supervised.train_and_evaluate(config, str(tmp_path / "unrolled"), devices=one_device())
    _, saved = checkpoint.load_raw(str(tmp_path / "unrolled"))
    scanned_config = tiny_config(total_steps=2, **{"model.scan": True})
    model = models.build(scanned_config.model, 10)
    params = jax.jit(model.init)(jax.random.PRNGKey(1), _images(1))["params"]
    mesh = jax.sharding.Mesh(jax.devices()[:1], ("data",))
    repl = jax.tree.map(lambda _: jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()), params)
    loaded = pretrained.init_from(str(tmp_path / "unrolled"), params, repl)
    jax.tree.map(np.testing.assert_array_equal, vit.unstack_blocks(loaded), saved["params"])
    # ... and the scanned run's checkpoint back into an unrolled model.
    scanned_config.init_from = str(tmp_path / "unrolled")
    supervised.train_and_evaluate(scanned_config, str(tmp_path / "scanned"), devices=one_device())
    _, scanned = checkpoint.load_raw(str(tmp_path / "scanned"))
    unrolled_model = models.build(config.model, 10)
    fresh = jax.jit(unrolled_model.init)(jax.random.PRNGKey(2), _images(1))["params"]
    back = pretrained.init_from(str(tmp_path / "scanned"), fresh, jax.tree.map(lambda _: repl["head"]["bias"], fresh))
    jax.tree.map(np.testing.assert_array_equal, vit.stack_blocks(back), scanned["params"])


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("remat", "some", r"config\.model\.remat='some' is unknown; allowed: None, 'full', 'dots'"),
        ("attention_impl", "flash", r"config\.model\.attention_impl='flash' is unknown"),
    ],
)
def test_bad_large_model_fields_are_one_line_errors(field, value, match):
    config = tiny_config()
    config.model[field] = value
    with pytest.raises(ValueError, match=match):
        supervised.check_config(config)


@pytest.mark.slow
def test_soap_on_a_scanned_encoder_equals_soap_on_its_unrolled_layers():
    """SOAP treats the stacked layer axis as L independent tensors: (L, s, s) factors, never an
    L×L one, and the same updates as on the unrolled model's leaves (eigh at call 0, power
    iteration + QR refreshes with the moment rotation at calls 3, 6, 9)."""
    from skipless_jax.optim import build_optimizer

    config = tiny_config("depth=2,opt=soap", **{"model.scan": True})
    config.optimizer.precondition_frequency = 3
    # No global-norm clip: its sum over the leaves rounds differently in the two layouts, and a
    # rank-deficient factor (the first one comes from one gradient) has an arbitrary null-space
    # basis that such rounding picks differently. Without it the two runs agree bit for bit.
    config.grad_clip_norm = None
    supervised.check_config(config)  # SOAP under scan is a valid config
    model = models.build(config.model, 10)
    stacked_params = jax.jit(model.init)(jax.random.PRNGKey(0), _images())["params"]
    unrolled_params = vit.unstack_blocks(stacked_params)
    tx, _ = build_optimizer(config, 20)
    states = [tx.init(stacked_params), tx.init(unrolled_params)]
    soap_state = [s for s in jax.tree.leaves(states[0], is_leaf=lambda x: hasattr(x, "gg")) if hasattr(s, "gg")][0]
    mlp_factors = soap_state.gg[vit.SCANNED_BLOCKS]["block"]["MlpBlock_0"]["Dense_0"]["kernel"]
    assert [f.shape for f in mlp_factors] == [(2, 32, 32), (2, 64, 64)]  # per layer, for the (L, d, mlp) kernel
    rng = np.random.default_rng(0)
    update = jax.jit(tx.update)
    params = [stacked_params, unrolled_params]
    for _ in range(11):
        grads = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), p.dtype), unrolled_params)
        u_stacked, states[0] = update(vit.stack_blocks(grads), states[0], params[0])
        u_unrolled, states[1] = update(grads, states[1], params[1])
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-9),
                     vit.unstack_blocks(jax.device_get(u_stacked)), jax.device_get(u_unrolled))
        params = [jax.tree.map(jnp.add, p, u) for p, u in zip(params, (u_stacked, u_unrolled))]


@pytest.mark.slow
def test_remat_halves_the_vitb_train_steps_temporary_memory():
    plain = large_model.compiled_vitb_step(8, scan=True)[0].memory_analysis().temp_size_in_bytes
    remat = large_model.compiled_vitb_step(8, scan=True, remat="full")[0].memory_analysis().temp_size_in_bytes
    assert remat <= 0.5 * plain, (remat, plain)
