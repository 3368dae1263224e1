"""The references' initializations as `config.model.init` schemes 'timm' and 'mae' (docs/method.md §24).

The model initializes as under `init='default'`; `reinitialize` then redraws every parameter by
the first rule of its family's table whose regex matches the parameter's path ('a/b/c'). An
unmatched parameter is an error (a new parameter needs a rule). Kernels are (in, out) with a
conv's window flattened into `in` ((kh, kw, in/groups, out) for the 2-D convs).
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
from skipless_jax.models.common import posemb_sincos_2d

SCHEMES = init_lib.REFERENCE_SCHEMES
# The family of a model class; the MAE pre-training model is 'mae'.
FAMILY_OF = {"ViT": "vit", "CaiT": "cait", "Swin": "swin", "PVTv2": "pvt_v2", "ConvMixer": "convmixer", "MAE": "mae"}

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
    return jnp.concatenate([jnp.zeros((1, 1, shape[2])), posemb_sincos_2d(g, g, shape[2])], axis=1)


ATTENTION = r"/(query|key|value)$"
NORM = r"(^|/)(LayerNorm_\d+|norm\d?|\w*_norm)"
NORMS = [(NORM + "/scale$", ones), (NORM + "/bias$", zeros)]
LINEAR_TIMM = [(r"/(query|key|value|out|proj_l|proj_w)$", trunc(0.02)), (r"_bias$", zeros),
               (r"/kernel$", trunc(0.02)), (r"/bias$", zeros)]
TOKENS_TIMM = [(r"^embedding/(kernel|bias)$", torch_default), (r"^(cls|pos_embedding)$", trunc(0.02))]
MAE_ENCODER = [(r"^embedding/kernel$", xavier()), (r"^embedding/bias$", torch_default),
               (r"(^|/)(cls|mask_token)$", normal(0.02)), (ATTENTION, xavier(fused=3)), (r"/out$", xavier()),
               (r"_bias$", zeros), (r"/kernel$", xavier()), (r"/bias$", zeros)]

RULES: dict[tuple[str, str], list[tuple[str, Rule]]] = {
    ("timm", "vit"): NORMS + TOKENS_TIMM + LINEAR_TIMM,
    ("timm", "cait"): NORMS + TOKENS_TIMM + [(r"/gamma_[12]$", keep)] + LINEAR_TIMM,
    ("timm", "swin"): NORMS + TOKENS_TIMM + [(r"/relative_position_bias$", trunc(0.02))] + LINEAR_TIMM,
    ("timm", "pvt_v2"): NORMS + [(r"/dwconv/kernel$", fan_out_normal(True)),
                                 (r"(/proj|/sr)/kernel$", fan_out_normal(False)),
                                 (r"(/proj|/sr|/dwconv)/bias$", zeros)] + LINEAR_TIMM,
    ("timm", "convmixer"): NORMS + [(r"/(kernel|bias)$", torch_default)],
    ("mae", "mae"): NORMS + MAE_ENCODER,
    ("mae", "vit"): NORMS + [(r"^head/kernel$", trunc(2e-5)), (r"^pos_embedding$", mae_position_table)]
    + MAE_ENCODER,
}


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


def redraw(params: Any, scheme: str, family: str, key: jax.Array) -> Any:
    """`params` (a flax params tree) with every leaf redrawn by the (scheme, family) table; leaf
    i draws from fold_in(key, i) in path order."""
    check(scheme, family)
    rules = [(re.compile(pattern), rule) for pattern, rule in RULES[scheme, family]]
    flat = flax.traverse_util.flatten_dict(flax.core.unfreeze(params), sep="/")
    out = {}
    for index, (path, value) in enumerate(sorted(flat.items())):
        rule = next((r for pattern, r in rules if pattern.search(path)), None)
        if rule is None:
            raise ValueError(f"init={scheme!r} has no rule for the {family} parameter {path!r}")
        sibling = flat.get(re.sub(r"(bias|_bias)$", lambda m: "kernel" if m.group(1) == "bias" else "", path))
        kernel = tuple((sibling if sibling is not None else value).shape)
        new = rule(jax.random.fold_in(key, index), tuple(value.shape), kernel)
        out[path] = value if new is None else new.astype(value.dtype)
    return flax.traverse_util.unflatten_dict(out, sep="/")


def reinitialize(model: Any, variables: dict[str, Any], key: jax.Array) -> dict[str, Any]:
    """`variables` of `model.init` with `params` redrawn under the model's reference scheme
    (`model.init_scheme` in SCHEMES); anything else is returned unchanged."""
    if type(model).__name__ == "DINO":  # the backbone redrawn, DINO's head as DINO draws it
        scheme = getattr(model.backbone, "init_scheme", "default")
        if scheme not in SCHEMES:
            return variables
        params = dict(variables["params"])
        params["backbone"] = redraw(params["backbone"], scheme, family_of(model.backbone), key)
        return {**variables, "params": params}
    scheme = getattr(model, "init_scheme", "default")
    if scheme not in SCHEMES:
        return variables
    params = redraw(variables["params"], scheme, family_of(model), key)
    return {**variables, "params": params}


def _reference_qk(scheme: str) -> Callable[[jax.Array, int], tuple[jax.Array, jax.Array]]:
    """The (w_q, w_k) draw of one (d, d) ViT attention layer under `scheme`'s table (init.REFERENCE_QK)."""
    table = RULES[scheme, "vit"]
    rules = [next(r for pattern, r in table if re.search(pattern, f"block/attention/{name}"))
             for name in ("query", "key")]

    def draw(keys: jax.Array, d: int) -> tuple[jax.Array, jax.Array]:
        return tuple(rule(k, (d, d), (d, d)) for rule, k in zip(rules, keys))

    return draw


init_lib.REFERENCE_QK.update({scheme: _reference_qk(scheme) for scheme, family in RULES if family == "vit"})
