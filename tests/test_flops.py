"""Model FLOPs (models/flops.py, docs/method/runs.md §25) against hand counts, against the matmuls and
convolutions of the traced forward pass (jaxpr), and against XLA's count of forward + backward."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import ml_collections
import pytest

from skipless_jax import models
from skipless_jax.models import flops
from skipless_jax.trainers import dino, mae, perf

from util import load_config

# One small config of each non-ViT family (hand counts below), on 8×8 RGB images, 10 classes.
FAMILY_CONFIGS = {
    "convmixer": dict(name="convmixer", width=16, depth=1, kernel_size=3, patch_size=2),
    "swin": dict(name="swin", width=8, depths=(2, 1), num_heads=(2, 2), window_size=2, patch_size=2),
    "cait": dict(name="cait", width=16, depth=1, num_heads=2, mlp_dim=32, patch_size=4, depth_token_only=1),
    "pvt_v2": dict(name="pvt_v2", widths=(8, 16), depths=(1, 1), num_heads=(1, 2), sr_ratios=(2, 1),
                   mlp_ratios=(2, 2), patch_size=2),
}


def vit(variant: str) -> ml_collections.ConfigDict:
    return ml_collections.ConfigDict(dict(variant=variant))


def test_vit_counts_by_hand():
    # quickstart: 8×8×1 digits, 2×2 patches (16 tokens, pool 'gap': no class token), width 64,
    # depth 4, MLP 128, 10 classes. stem 2·16·4·64 = 8,192; a block: Q,K,V,O 8·16·64² = 524,288,
    # attention 4·16²·64 = 65,536, MLP 4·16·64·128 = 524,288 (1,114,112; × 4 = 4,456,448); head
    # 2·64·10 = 1,280: forward 4,465,920, × 3.
    config = load_config("quickstart")
    assert flops.train_flops_per_example(config.model, 8, 10, channels=1) == 3 * 4_465_920
    # ViT-S/16 at 224 (197 tokens with the class token), 1000 classes: a block 2·197·(4·384² +
    # 2·384·1536) + 4·197²·384 = 756,782,592 (× 12 = 9,081,391,104); stem 2·196·768·384 =
    # 115,605,504; head 768,000: forward 9,197,764,608 (≈ 4.6 GMAC, timm's figure).
    assert flops.train_flops_per_example(vit("S/16"), 224, 1000) == 3 * 9_197_764_608
    # ViT-B/16: a block 2·197·(4·768² + 2·768·3072) + 4·197²·768 = 2,907,909,120 (× 12 =
    # 34,894,909,440); stem 2·196·768·768 = 231,211,008; head 1,536,000: forward 35,127,656,448
    # (≈ 17.6 GMAC); backbone only (DINO): no head.
    assert flops.train_flops_per_example(vit("B/16"), 224, 1000) == 3 * 35_127_656_448
    assert flops.forward_flops_per_example(vit("B/16"), 224, 0) == 35_127_656_448 - 1_536_000


def test_each_family_counted_by_hand():
    by_hand = {
        # stem 2·16·12·16 = 6,144; depthwise 3×3 2·16·9·16 = 4,608; pointwise 2·16·16² = 8,192; head 320
        "convmixer": 6_144 + 4_608 + 8_192 + 320,
        # stem 2·16·12·8 = 3,072; stage 0 (4×4 grid, 2×2 windows of 4 tokens, C 8), 2 blocks of
        # Q,K,V,O 8·16·8² = 8,192 + attention 4·16·4·8 = 2,048 + MLP 4·16·8·32 = 16,384; merge
        # 2·4·32·16 = 4,096; stage 1 (2×2 grid: one window of 4, C 16): 8·4·16² = 8,192 + 4·4·4·16
        # = 1,024 + 4·4·16·64 = 16,384; head 2·16·10 = 320
        "swin": 3_072 + 2 * (8_192 + 2_048 + 16_384) + 4_096 + (8_192 + 1_024 + 16_384) + 320,
        # 4 tokens of 4×4 patches: stem 2·4·48·16 = 6,144; block 8·4·16² = 8,192 + 4·4²·16 = 1,024 +
        # MLP 4·4·16·32 = 8,192 + talking heads 2·2·4²·2² = 256; class block: Q, O 4·16² = 1,024, K, V
        # on 5 tokens 4·5·16² = 5,120, attention 4·5·16 = 320, MLP 4·16·32 = 2,048; head 320
        "cait": 6_144 + (8_192 + 1_024 + 8_192 + 256) + (1_024 + 5_120 + 320 + 2_048) + 320,
        # stage 0: 3×3/2 conv on 8 px → 4×4, 2·16·9·3·8 = 6,912; SR 2×2 → 4 tokens 2·4·4·8² = 2,048;
        # Q, O 4·16·8² = 4,096; K, V 4·4·8² = 1,024; attention 4·16·4·8 = 2,048; fc1, fc2 4·16·8·16 =
        # 8,192; depthwise 3×3 2·16·9·16 = 4,608. stage 1: 3×3/2 conv → 2×2, 2·4·9·8·16 = 9,216;
        # Q, K, V, O 8·4·16² = 8,192; attention 4·4·4·16 = 1,024; fc 4·4·16·32 = 8,192; depthwise
        # 2·4·9·32 = 2,304; head 320
        "pvt_v2": 6_912 + (2_048 + 4_096 + 1_024 + 2_048 + 8_192 + 4_608) + 9_216 + (8_192 + 1_024 + 8_192 + 2_304)
        + 320,
    }
    for name, config in FAMILY_CONFIGS.items():
        config = ml_collections.ConfigDict(config)
        assert flops.train_flops_per_example(config, 8, 10) == 3 * by_hand[name], name


def test_mae_and_dino_counted_by_hand():
    # MAE digits: 16 patches, 4 kept (+ CLS: 5 encoder tokens), width 64, depth 4; decoder 32 wide,
    # 2 blocks, MLP 128, on 17 tokens. stem 8,192; encoder block 8·5·64² + 4·5²·64 + 4·5·64·128 =
    # 334,080 (× 4); decoder embedding 2·5·64·32 = 20,480; decoder block 8·17·32² + 4·17²·32 +
    # 4·17·32·128 = 454,784 (× 2); prediction 2·17·32·4 = 4,352.
    config = load_config("mae_digits_pretrain")
    mae_forward = 8_192 + 4 * 334_080 + 20_480 + 2 * 454_784 + 4_352
    assert perf.model_flops_per_example(config) == (3 * mae_forward, 0.0)
    # DINO digits: width 64, depth 4, 4×4 patches; global 8 px (4 patches + CLS), local 4 px (1 +
    # CLS); head 64 → 256 → 256 → 32 → 256. Backbone at 8 px: 2·4·16·64 + 4·334,080 = 1,344,512;
    # at 4 px: 2·16·64 + 4·(8·2·64² + 4·2²·64 + 4·2·64·128) = 530,432; head 2·(64·256 + 256² +
    # 256·32 + 32·256) = 196,608. Student on 2 + 2 crops, × 3; teacher on the 2 global crops.
    config = load_config("dino_digits")
    global_crop, local_crop = 1_344_512 + 196_608, 530_432 + 196_608
    assert perf.model_flops_per_example(config) == (3 * (2 * global_crop + 2 * local_crop) + 2 * global_crop, 0.0)


# ---------------------------------------------------------------- the traced forward's matmuls


def _size(shape) -> int:
    return math.prod(int(s) for s in shape)


def jaxpr_matmul_flops(jaxpr) -> float:
    """2 × multiply-adds of every dot_general and convolution of a jaxpr (sub-jaxprs included;
    a scan's body × its length): an independent count of what the model computes."""
    total = 0.0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "dot_general":
            (_, rhs_contract), (_, rhs_batch) = eqn.params["dimension_numbers"]
            lhs, rhs = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape
            free = [s for i, s in enumerate(rhs) if i not in rhs_contract and i not in rhs_batch]
            total += 2.0 * _size(lhs) * _size(free)
        elif name == "conv_general_dilated":
            rhs = eqn.invars[1].aval.shape
            out_features = rhs[eqn.params["dimension_numbers"].rhs_spec[0]]
            total += 2.0 * _size(eqn.outvars[0].aval.shape) * _size(rhs) / out_features
        repeat = eqn.params.get("length", 1) if name == "scan" else 1
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    total += repeat * jaxpr_matmul_flops(inner)
    return total


def per_example(forward, make_inputs) -> float:
    """Matmul FLOPs of `forward(*make_inputs(b))` at b = 2 less b = 1: what one more example costs
    (per-batch work, e.g. a position table's resize, cancels)."""
    counts = [jaxpr_matmul_flops(jax.make_jaxpr(forward)(*make_inputs(b)).jaxpr) for b in (1, 2)]
    return counts[1] - counts[0]


def _classifier_forward(model_config: ml_collections.ConfigDict, size: int, classes: int):
    model = models.build(model_config, classes)
    images = jnp.zeros((1, size, size, 3))
    variables = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), images))
    return lambda v, x: model.apply(v, x)[0], lambda b: (variables, jnp.zeros((b, size, size, 3)))


@pytest.mark.parametrize("name", ["vit", *FAMILY_CONFIGS, "vit_scan_remat"])
def test_forward_count_is_the_traced_matmuls(name):
    config = ml_collections.ConfigDict(FAMILY_CONFIGS.get(name, dict(width=32, depth=3, num_heads=2, mlp_dim=48,
                                                                        patch_size=4, pool="tok")))
    if name == "vit_scan_remat":  # a scanned, rematerialised encoder: the same forward
        config.update(dict(scan=True, remat="full"))
    size = 16 if name in ("vit", "vit_scan_remat") else 8
    forward, make_inputs = _classifier_forward(config, size, 10)
    assert per_example(forward, make_inputs) == flops.forward_flops_per_example(config, size, 10)


@pytest.mark.slow
def test_mae_and_dino_counts_are_the_traced_matmuls():
    config = load_config("mae_digits_pretrain")
    model = mae.build_model(config)
    images = jnp.zeros((1, 8, 8, 1))
    variables = jax.eval_shape(lambda: model.init({"params": jax.random.PRNGKey(0),
                                                   "masking": jax.random.PRNGKey(1)}, images))

    def mae_inputs(b):
        return variables, jnp.zeros((b, 8, 8, 1)), jax.random.uniform(jax.random.PRNGKey(2), (b, 16))

    traced = per_example(lambda v, x, noise: model.apply(v, x, noise=noise)[0], mae_inputs)
    assert 3 * traced == perf.model_flops_per_example(config)[0]

    config = load_config("dino_digits")
    model = dino.build_model(config)
    variables = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), (jnp.zeros((1, 8, 8, 1)),)))

    def crops(b, local=True):
        views = (jnp.zeros((2 * b, 8, 8, 1)), jnp.zeros((2 * b, 4, 4, 1)))  # 2 global, 2 local crops each
        return variables, views if local else views[:1]

    student = per_example(lambda v, views: model.apply(v, views)[0], crops)
    teacher = per_example(lambda v, views: model.apply(v, views)[0], lambda b: crops(b, local=False))
    assert 3 * student + teacher == perf.model_flops_per_example(config)[0]


# ---------------------------------------------------------------- XLA's count of a train step


def xla_cost(fn, *args) -> float:
    cost = jax.jit(fn).lower(*args).compile().cost_analysis()
    return float((cost[0] if isinstance(cost, (list, tuple)) else cost)["flops"])


def test_xla_costs_a_depthwise_filter_gradient_densely():
    """Why XLA's count (perf/xla_tflops_per_device) overstates depthwise models: the filter
    gradient of a depthwise 3×3 convolution over 256 channels costs 256 × its 2·9·positions·C."""
    x, w = jnp.zeros((2, 8, 8, 256)), jnp.zeros((3, 3, 1, 256))

    def conv(w, x):
        return jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"),
                                            feature_group_count=256).sum()

    work = 2 * 2 * 64 * 9 * 256
    assert abs(xla_cost(conv, w, x) / work - 1) < 0.15  # the forward: as counted
    assert xla_cost(jax.grad(conv), w, x) > 100 * work


@pytest.mark.slow
@pytest.mark.parametrize("name", ["vit", "cait", "swin", "pvt_v2"])
def test_within_ten_percent_of_xla_forward_and_backward(name):
    """XLA's count of the gradient of an unrolled model (no remat, no accumulation) per example,
    against 3 × forward: within 10 % (XLA also counts elementwise work, and skips the input
    gradient of the first layer). PVTv2: XLA costs a depthwise convolution's filter gradient as a
    dense convolution (C× its work, `test_xla_costs_a_depthwise_filter_gradient_densely`), so its
    check is 3 × XLA's forward. ConvMixer (matmuls equal to the traced ones above): its exact GELU
    and batch-statistics BatchNorm on every channel are 12 % of XLA's forward count at width 768,
    more than this check's margin."""
    configs = {
        "vit": (dict(width=192, depth=2, num_heads=3, mlp_dim=768, patch_size=8), 64),
        "cait": (dict(name="cait", width=192, depth=2, num_heads=4, mlp_dim=768, patch_size=8, depth_token_only=1),
                 64),
        "swin": (dict(name="swin", width=96, depths=(2, 2), num_heads=(3, 6), window_size=4, patch_size=4), 32),
        "pvt_v2": (dict(name="pvt_v2", widths=(64, 128), depths=(1, 1), num_heads=(1, 2), sr_ratios=(2, 1),
                        mlp_ratios=(4, 4), patch_size=4), 32),
    }
    fields, size = configs[name]
    config = ml_collections.ConfigDict(fields)
    model = models.build(config, 10)
    params = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), jnp.zeros((1, size, size, 3))))["params"]

    def loss(p, images):
        return model.apply({"params": p}, images)[0].sum()

    depthwise = name == "pvt_v2"
    step = loss if depthwise else jax.grad(loss)

    def xla_flops(batch: int) -> float:
        return xla_cost(step, params, jnp.zeros((batch, size, size, 3)))

    xla = (xla_flops(4) - xla_flops(2)) / 2 * (3 if depthwise else 1)
    ours = flops.train_flops_per_example(config, size, 10)
    print(f"{name}: XLA {xla:.6g}, model {ours:.6g}, ratio {xla / ours:.4f}")
    assert abs(xla / ours - 1) < 0.10, (xla, ours)


def test_token_graying_counted_apart():
    config = load_config("quickstart", "tg=svd")
    model, tg = perf.model_flops_per_example(config)
    assert model == 3 * 4_465_920  # the model's count is TG's-free
    # 16 × 4 patch matrix (a = 16, b = 4): R-SVD 6·16·4² + 20·4³, reconstruction 2·16·4²
    assert tg == 6 * 16 * 16 + 20 * 64 + 2 * 16 * 16
    assert flops.tg_matrix_flops("dct", 16, 4) == 5 * 64 * 6  # four real FFT passes, 5·ab·log₂(ab)
    assert flops.tg_matrix_flops(None, 16, 4) == 0.0
    dino_config = load_config("dino_digits")
    dino_config.model.token_graying = "dct"
    # the student's 2 global + 2 local crops and the teacher's 2 global crops, forward once each
    expected = 4 * flops.tg_matrix_flops("dct", 4, 16) + 2 * flops.tg_matrix_flops("dct", 1, 16)
    assert perf.model_flops_per_example(dino_config)[1] == expected == 4 * 5 * 64 * 6 + 2 * 5 * 16 * 4
    with pytest.raises(ValueError, match=r"mae_train_flops needs mae="):
        flops.mae_train_flops(config.model, 8, None)


def test_the_language_model_is_counted_per_sequence():
    """configs/lm_quickstart.py by hand: T = 128 tokens of width 128, depth 4, MLP 512, 257 symbols."""
    config = load_config("lm_quickstart")
    t, d, m, depth = config.model.seq_len, config.model.width, config.model.mlp_dim, config.model.depth
    vocab = 257
    block = 4 * 2 * t * d * d + 2 * t * t * d + 2 * 2 * t * d * m  # the causal half of the attention
    expected = 3 * (depth * block + 2 * t * d * vocab)
    assert (t, d, m, depth) == (128, 128, 512, 4)
    assert flops.lm_train_flops(config.model, vocab) == expected
    assert perf.model_flops_per_example(config) == (expected, 0.0)
