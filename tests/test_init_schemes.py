"""The references' inits (`config.model.init` 'timm' / 'mae', docs/method/families.md §24): per family,
every tensor of a fresh init against the reference's rule as §24 states it, restated
here per parameter path: zeros and ones exact, uniform bounds and the ±2 truncation respected,
mean and second moment within 5 sampling standard deviations of the rule's (5σ: a two-sided
chance of 6·10⁻⁷ a moment under the normal approximation, so the ~600 moments tested here pass
together with 99.96 %; 4σ would fail one in ~4 % of keys). The redraw key is 3: with key 2 the
MAE decoder's second query kernel (1024 draws) is a genuine 5.1σ draw (checked: the same
uniform draw, not the rule)."""

from __future__ import annotations

import importlib.util
import math
import os
import re

import flax
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from skipless_jax import models
from skipless_jax.models import init_schemes
from skipless_jax.models import mae as mae_lib

SIGMAS = 5
_CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")


def _config(name: str, arg: str) -> ml_collections.ConfigDict:
    spec = importlib.util.spec_from_file_location(f"cfg_{name}", os.path.join(_CONFIGS, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(arg)


def _fresh(family: str, scheme: str) -> tuple[dict, ml_collections.ConfigDict, object]:
    """{path: float64 array} of a fresh init under `scheme` (ViT width 64, the families' digits sizes)."""
    if family in ("vit", "mae"):
        c = _config("mae_digits_pretrain" if family == "mae" else "quickstart", f"init={scheme}")
        if family == "vit":
            c.model.update(skip_sab=True, skip_ffn=True, pool="tok", posemb="learn")
        if family == "mae":
            from skipless_jax.trainers import mae as mae_trainer

            model = mae_trainer.build_model(c)
        else:
            model = models.build(c.model, 10)
    else:
        c = _config("families_digits", f"family={family},init={scheme}")
        model = models.build(c.model, 10)
    size = c.input.image_size or 8
    rngs = {"params": jax.random.PRNGKey(0), "masking": jax.random.PRNGKey(1)}
    # One compiled program: eager, every parameter's initializer and redraw compiles on its own.
    variables = jax.jit(
        lambda r, x: init_schemes.reinitialize(model, model.init(r, x, train=False), jax.random.PRNGKey(3))
    )(rngs, jnp.zeros((1, size, size, 3)))
    flat = flax.traverse_util.flatten_dict(variables["params"], sep="/")
    return {k: np.asarray(v, np.float64) for k, v in flat.items()}, c, model


def _fan_in(kernel_shape) -> int:
    return math.prod(kernel_shape[:-1])


def _rule(family: str, scheme: str, path: str, shape, flat) -> tuple:
    """docs/method/families.md §24 for one parameter: ('zeros',) | ('ones',) | ('keep',) |
    ('normal', σ, truncation bound or None) | ('uniform', bound) | ('exact', array)."""
    kernel = flat.get(re.sub(r"/bias$", "/kernel", path), np.zeros(shape)).shape
    if re.search(r"(LayerNorm_\d+|norm\d?|_norm)/scale$", path):
        return ("ones",)
    if re.search(r"(LayerNorm_\d+|norm\d?|_norm)/bias$", path):
        return ("zeros",)
    if scheme == "timm":
        if family == "convmixer":
            return ("uniform", 1 / math.sqrt(_fan_in(kernel)))
        if family == "pvt_v2" and re.search(r"/(proj|sr|dwconv)/kernel$", path):
            fan_out = shape[0] * shape[1] * (1 if "dwconv" in path else shape[-1])
            return ("normal", math.sqrt(2 / fan_out), None)
        if family == "pvt_v2" and re.search(r"/(proj|sr|dwconv)/bias$", path):
            return ("zeros",)
        if path.startswith("embedding/"):
            return ("uniform", 1 / math.sqrt(_fan_in(kernel)))
        if re.search(r"gamma_[12]$", path):
            return ("keep",)
        if path.endswith("bias") and not path.endswith("relative_position_bias"):
            return ("zeros",)
        return ("normal", 0.02, 2.0)  # Linear, q/k/v/out, talking heads, cls, pos, rel. bias, merge
    # mae
    if path == "embedding/kernel":
        return ("uniform", math.sqrt(6 / (shape[0] + shape[1])))
    if path == "embedding/bias":
        return ("uniform", 1 / math.sqrt(_fan_in(kernel)))
    if path in ("cls", "decoder/mask_token"):
        return ("normal", 0.02, None)
    if path == "pos_embedding":
        g = int(round((shape[1] - 1) ** 0.5))
        return ("exact", np.asarray(mae_lib.encoder_position_table(g, shape[2], shape)))
    if path == "head/kernel":
        return ("normal", 2e-5, 2.0)
    if path.endswith("bias"):
        return ("zeros",)
    d_in, d_out = shape
    fused = 3 if re.search(r"/(query|key|value)$", path) else 1  # q/k/v: slices of one (d, 3d) Linear
    return ("uniform", math.sqrt(6 / (d_in + fused * d_out)))


def _check(name: str, x: np.ndarray, rule: tuple, keep_value=None) -> None:
    kind, n = rule[0], x.size
    if kind == "zeros":
        np.testing.assert_array_equal(x, 0.0, err_msg=name)
    elif kind == "ones":
        np.testing.assert_array_equal(x, 1.0, err_msg=name)
    elif kind == "keep":  # CaiT's γ: the config's layerscale_init, as the default init sets it
        np.testing.assert_array_equal(x, keep_value, err_msg=name)
        assert np.unique(x).size == 1, name
    elif kind == "exact":
        np.testing.assert_allclose(x, rule[1], rtol=1e-6, atol=1e-7, err_msg=name)
    else:
        if kind == "uniform":
            bound = rule[1]
            assert np.abs(x).max() <= bound, f"{name}: max |w| {np.abs(x).max():.4g} > bound {bound:.4g}"
            var, var_sd = bound**2 / 3, math.sqrt(4 * bound**4 / 45 / n)  # Var(w²) = 4b⁴/45
        else:
            sigma, limit = rule[1], rule[2]
            if limit is not None:
                assert np.abs(x).max() <= limit, f"{name}: outside the truncation ±{limit}"
            var, var_sd = sigma**2, sigma**2 * math.sqrt(2 / n)  # Var(w²) = 2σ⁴
        second = float(np.mean(x**2))
        assert abs(second - var) <= SIGMAS * var_sd, f"{name} ({x.shape}): E w² = {second:.4g}, rule {var:.4g}"
        assert abs(float(x.mean())) <= SIGMAS * math.sqrt(var / n), f"{name}: mean {x.mean():.4g}"


@pytest.mark.slow
@pytest.mark.parametrize("family, scheme", [("vit", "timm"), ("cait", "timm"), ("swin", "timm"), ("pvt_v2", "timm"),
                                            ("convmixer", "timm"), ("vit", "mae"), ("mae", "mae")])
def test_fresh_init_follows_the_reference_rule(family, scheme):
    flat, _, _ = _fresh(family, scheme)
    default = _fresh(family, "default")[0] if family == "cait" else {}
    kinds = set()
    for path, x in flat.items():
        rule = _rule(family, scheme, path, x.shape, flat)
        kinds.add(rule[0])
        _check(f"{family}/{scheme}: {path}", x, rule, keep_value=default.get(path))
    assert {"zeros", "ones"} <= kinds and kinds & {"normal", "uniform"}


def test_mae_qkv_is_the_fused_tensors_xavier_not_the_separate_one():
    """The separate (d, d) xavier bound √(6/2d) is √2 × the fused (d, 3d) one: a fresh 'mae' query
    kernel stays within the fused bound, a 'default' one does not."""
    mae_flat, _, _ = _fresh("vit", "mae")
    default_flat, _, _ = _fresh("vit", "default")
    name = "block_0/MultiHeadAttention_0/query"
    fused = math.sqrt(6 / (4 * 64))
    assert np.abs(mae_flat[name]).max() <= fused < np.abs(default_flat[name]).max()


@pytest.mark.slow
def test_the_trainers_init_state_applies_the_scheme():
    """supervised.make_init_state under init='timm' (models.init_variables) holds `reinitialize`
    of the model's init."""
    from skipless_jax.trainers import supervised

    c = _config("quickstart", "init=timm")
    model = models.build(c.model, 10)
    dummy = jnp.zeros((1, 8, 8, 3))
    state = supervised.make_init_state(c.model, model, optax.sgd(0.1), dummy)(jax.random.PRNGKey(4))
    init_rng = jax.random.split(jax.random.PRNGKey(4))[0]
    want = init_schemes.reinitialize(model, model.init({"params": init_rng}, dummy, train=False), init_rng)
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(want["params"])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # analyze's step-0 parameters are the trainer's (seed 0: the first half of its split; jitted
    # there, so equal to float32 rounding)
    from skipless_jax import analyze

    seed_rng = jax.random.split(jax.random.PRNGKey(c.seed))[0]
    want = init_schemes.reinitialize(model, model.init({"params": seed_rng}, dummy, train=False), seed_rng)
    for a, b in zip(jax.tree.leaves(analyze.init_params(model, c, (8, 8, 3))), jax.tree.leaves(want["params"])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-8)
    # under init='default' the variables are the module's own init
    plain = _config("quickstart", "init=default")
    plain_model = models.build(plain.model, 10)
    got = models.init_variables(plain.model, plain_model, init_rng, dummy)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(plain_model.init({"params": init_rng}, dummy, train=False))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_scheme_without_a_table_is_a_one_line_error():
    c = _config("families_digits", "family=swin,init=mae")
    with pytest.raises(ValueError, match=r"config\.model\.init='mae' is not defined for the 'swin' family; 'mae' is "
                                         r"defined for: mae, vit"):
        models.check_config(c.model, 8)
    c.model.init = "torch"
    with pytest.raises(ValueError, match=r"model\.init='torch' is unknown; allowed: default, skipless, mimetic, "
                                         r"timm, mae"):
        models.check_config(c.model, 8)
