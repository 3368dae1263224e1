"""The references' initializations as `config.model.init` schemes 'timm' and 'mae' (docs/method/families.md §24),
and the `gpt` family's `init='default'`, GPT-2's (docs/method/lm.md §4).

The model initializes as under `init='default'`; `reinitialize` then redraws every parameter by
the rule its family's table gives the parameter's role (models/roles.py: the family's `ROLES`
read on its path 'a/b/c'). A parameter without a role, or whose role the table has no rule for,
is an error (a new parameter needs both). Kernels are (in, out) with a conv's window flattened
into `in` ((kh, kw, in/groups, out) for the 2-D convs).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

import flax
import jax
import jax.numpy as jnp

from skipless_jax.models import init as init_lib
from skipless_jax.models import roles
from skipless_jax.models.common import posemb_sincos_2d_cls

SCHEMES = init_lib.REFERENCE_SCHEMES
# The family of a model class; the MAE pre-training model is 'mae'.
FAMILY_OF = {"ViT": "vit", "CaiT": "cait", "Swin": "swin", "PVTv2": "pvt_v2", "ConvMixer": "convmixer", "MAE": "mae",
             "GPT": "gpt"}

# A rule: (key, shape, the shape of the kernel next to it (a bias's weight; else its own shape)) -> array.
Rule = Callable[[jax.Array, tuple, tuple], Any]


def trunc(std: float) -> Rule:
    """timm `trunc_normal_(std=std)`: N(0, std²) truncated at the absolute bounds ±2."""
    return lambda key, shape, kernel: std * jax.random.truncated_normal(key, -2.0 / std, 2.0 / std, shape)


def normal(std: float) -> Rule:
    return lambda key, shape, kernel: std * jax.random.normal(key, shape)


def _uniform(key: jax.Array, shape: tuple, bound: float) -> jax.Array:
    return jax.random.uniform(key, shape, jnp.float32, -bound, bound)


def torch_default(key: jax.Array, shape: tuple, kernel: tuple) -> jax.Array:
    """torch's Linear/Conv2d default for a weight or its bias: U(±1/√fan_in), fan_in = in·kh·kw/groups."""
    return _uniform(key, shape, 1.0 / math.sqrt(math.prod(kernel[:-1])))


def xavier(fused: int = 1) -> Rule:
    """xavier_uniform on (in, out) kernels; `fused` = 3: as one slice of a fused (d → 3d) Linear."""
    return lambda key, shape, kernel: _uniform(
        key, shape, math.sqrt(6.0 / (math.prod(shape[:-1]) + fused * shape[-1])))


def fan_out_normal(depthwise: bool) -> Rule:
    """PVTv2's conv rule N(0, 2/fan_out), fan_out = kh·kw·out/groups (depthwise: kh·kw)."""
    def rule(key, shape, kernel):
        fan_out = shape[0] * shape[1] * (1 if depthwise else shape[-1])
        return math.sqrt(2.0 / fan_out) * jax.random.normal(key, shape)
    return rule


def zeros(key, shape, kernel):
    return jnp.zeros(shape, jnp.float32)


def ones(key, shape, kernel):
    return jnp.ones(shape, jnp.float32)


def keep(key, shape, kernel):
    """The value as initialized (CaiT's LayerScale γ: the config's `layerscale_init`)."""
    return None


def mae_position_table(key, shape, kernel):
    """The MAE encoder's fixed table [0; sincos2d(g, g)] (`mae.encoder_position_table`) as the
    start of a learned (1, 1 + g², d) table."""
    g = int(round((shape[1] - 1) ** 0.5))
    if len(shape) != 3 or shape[0] != 1 or g * g != shape[1] - 1:
        raise ValueError(f"init='mae' needs a (1, 1 + g², d) position table (a class token), got {shape}")
    return posemb_sincos_2d_cls(g, g, shape[2])


NORMS = {roles.NORM_SCALE: ones, roles.NORM_BIAS: zeros}
LINEAR_TIMM = {role: trunc(0.02) for role in (roles.ATTENTION_QKV, roles.ATTENTION_OUT, roles.TALKING_HEADS,
                                              roles.MLP_OUT, roles.KERNEL, roles.HEAD_KERNEL)}
LINEAR_TIMM.update({role: zeros for role in (roles.ATTENTION_BIAS, roles.BIAS, roles.HEAD_BIAS)})
TOKENS_TIMM = {roles.PATCH_KERNEL: torch_default, roles.PATCH_BIAS: torch_default, roles.CLASS_TOKEN: trunc(0.02),
               roles.POSITION_TABLE: trunc(0.02)}
MAE_ENCODER = {roles.PATCH_KERNEL: xavier(), roles.PATCH_BIAS: torch_default, roles.CLASS_TOKEN: normal(0.02),
               roles.MASK_TOKEN: normal(0.02), roles.ATTENTION_QKV: xavier(fused=3), roles.ATTENTION_OUT: xavier(),
               roles.ATTENTION_BIAS: zeros, roles.MLP_OUT: xavier(), roles.KERNEL: xavier(), roles.BIAS: zeros}
TORCH_DEFAULT = {role: torch_default for role in (roles.PATCH_KERNEL, roles.PATCH_BIAS, roles.DEPTHWISE_KERNEL,
                                                  roles.DEPTHWISE_BIAS, roles.KERNEL, roles.BIAS, roles.HEAD_KERNEL,
                                                  roles.HEAD_BIAS)}

# (scheme, family) -> {role: rule}.
RULES: dict[tuple[str, str], dict[str, Rule]] = {
    ("timm", "vit"): {**NORMS, **TOKENS_TIMM, **LINEAR_TIMM},
    ("timm", "cait"): {**NORMS, **TOKENS_TIMM, roles.LAYER_SCALE: keep, **LINEAR_TIMM},
    ("timm", "swin"): {**NORMS, **TOKENS_TIMM, roles.RELATIVE_POSITION_TABLE: trunc(0.02), **LINEAR_TIMM},
    ("timm", "pvt_v2"): {**NORMS, roles.DEPTHWISE_KERNEL: fan_out_normal(True), roles.DEPTHWISE_BIAS: zeros,
                         roles.PATCH_KERNEL: fan_out_normal(False), roles.PATCH_BIAS: zeros,
                         roles.CONV_KERNEL: fan_out_normal(False), roles.CONV_BIAS: zeros, **LINEAR_TIMM},
    ("timm", "convmixer"): {**NORMS, **TORCH_DEFAULT},
    ("mae", "mae"): {**NORMS, **MAE_ENCODER},
    ("mae", "vit"): {**NORMS, **MAE_ENCODER, roles.HEAD_KERNEL: trunc(2e-5), roles.HEAD_BIAS: zeros,
                     roles.POSITION_TABLE: mae_position_table},
}


def gpt2(depth: int, shaped: bool = False) -> dict[str, Rule]:
    """GPT-2's init of a decoder of `depth` blocks (nanoGPT `GPT._init_weights` and its residual
    rescale; docs/method/lm.md §4): N(0, 0.02²) tables and kernels, the residual output
    projections (attention `out`, the MLP's second kernel) N(0, (0.02/√(2·depth))²), zero
    biases, unit norms. The gains of Value-SkipInit and shaped attention keep their initial
    values, and `shaped` attention (SAS, SAS-P) its own query, key and value draws
    (docs/method/skipless_lm.md §2)."""
    residual = normal(0.02 / math.sqrt(2 * depth))
    return {**NORMS, roles.TOKEN_TABLE: normal(0.02), roles.POSITION_TABLE: normal(0.02),
            roles.ATTENTION_QKV: keep if shaped else normal(0.02), roles.KERNEL: normal(0.02),
            roles.HEAD_KERNEL: normal(0.02), roles.ATTENTION_OUT: residual, roles.MLP_OUT: residual,
            roles.ATTENTION_BIAS: zeros, roles.BIAS: zeros, roles.HEAD_BIAS: zeros, roles.GAIN: keep}


# family -> (model -> {role: rule}): the families whose init='default' is a reference's, redrawn by it.
DEFAULTS: dict[str, Callable[[Any], dict[str, Rule]]] = {
    "gpt": lambda model: gpt2(model.depth, model.attention_shape in ("sas", "sas_p"))}


def redraws(model_config: Any) -> bool:
    """Whether `config.model`'s init redraws every parameter after the module init: a reference
    scheme, or the default of a family in DEFAULTS."""
    scheme = model_config.get("init", "default")
    return scheme in SCHEMES or (scheme == "default" and model_config.get("name") in DEFAULTS)


def check(scheme: str, family: str) -> None:
    """One-line ValueError for a reference scheme the family has no table for."""
    if scheme in SCHEMES and (scheme, family) not in RULES:
        allowed = sorted(f for s, f in RULES if s == scheme)
        raise ValueError(f"config.model.init={scheme!r} is not defined for the {family!r} family; "
                         f"{scheme!r} is defined for: {', '.join(allowed)}")


def family_of(model: Any) -> str:
    name = type(model).__name__
    if name not in FAMILY_OF:
        raise ValueError(f"no reference init for a {name} model; allowed: {', '.join(FAMILY_OF)}")
    return FAMILY_OF[name]


def redraw(params: Any, scheme: str, family: str, key: jax.Array, rules: dict[str, Rule] | None = None) -> Any:
    """`params` (a flax params tree) with every leaf redrawn by `rules` (default the (scheme,
    family) table); leaf i draws from fold_in(key, i) in path order."""
    if rules is None:
        check(scheme, family)
        rules = RULES[scheme, family]
    table = roles.table_of(family)
    flat = flax.traverse_util.flatten_dict(flax.core.unfreeze(params), sep="/")
    out = {}
    for index, (path, value) in enumerate(sorted(flat.items())):
        role = roles.role_of(path, table)
        if role not in rules:
            raise ValueError(f"init={scheme!r} has no rule for the {family} parameter {path!r} (role {role!r})")
        rule = rules[role]
        sibling = flat.get(re.sub(r"(bias|_bias)$", lambda m: "kernel" if m.group(1) == "bias" else "", path))
        kernel = tuple((sibling if sibling is not None else value).shape)
        new = rule(jax.random.fold_in(key, index), tuple(value.shape), kernel)
        out[path] = value if new is None else new.astype(value.dtype)
    return flax.traverse_util.unflatten_dict(out, sep="/")


def reinitialize(model: Any, variables: dict[str, Any], key: jax.Array) -> dict[str, Any]:
    """`variables` of `model.init` with `params` redrawn under the model's reference scheme
    (`model.init_scheme` in SCHEMES) or its family's default (DEFAULTS); anything else is
    returned unchanged."""
    if type(model).__name__ == "DINO":  # the backbone redrawn, DINO's head as DINO draws it
        scheme = getattr(model.backbone, "init_scheme", "default")
        if scheme not in SCHEMES:
            return variables
        params = dict(variables["params"])
        params["backbone"] = redraw(params["backbone"], scheme, family_of(model.backbone), key)
        return {**variables, "params": params}
    scheme = getattr(model, "init_scheme", "default")
    family = FAMILY_OF.get(type(model).__name__)
    if scheme == "default" and family in DEFAULTS:
        return {**variables, "params": redraw(variables["params"], scheme, family, key, DEFAULTS[family](model))}
    if scheme not in SCHEMES:
        return variables
    params = redraw(variables["params"], scheme, family_of(model), key)
    return {**variables, "params": params}


def _reference_qk(scheme: str) -> Callable[[jax.Array, int], tuple[jax.Array, jax.Array]]:
    """The (w_q, w_k) draw of one (d, d) ViT attention layer under `scheme`'s table (init.REFERENCE_QK)."""
    rule = RULES[scheme, "vit"][roles.ATTENTION_QKV]

    def draw(keys: jax.Array, d: int) -> tuple[jax.Array, jax.Array]:
        return tuple(rule(k, (d, d), (d, d)) for k in keys)

    return draw


init_lib.REFERENCE_QK.update({scheme: _reference_qk(scheme) for scheme, family in RULES if family == "vit"})
