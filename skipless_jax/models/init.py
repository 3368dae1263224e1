"""Initializations for skipless Transformers (docs/method/papers.md §3, "Cutting the Skip").

Dense kernels are (in, out): y = x W. Attention kernels are (d, d) with heads as column groups
(query/key/value) or row groups (out). All functions are pure in `key`; validation happens on
Python floats before anything is traced.

- `scaled_orthogonal_vo`: value/output of a whole layer with W^V W^O = c² U Vᵀ (κ = 1), or the
  authors' fork's c² U V (`vo='fork'`, docs/method/authors_init.md §2).
- `mimetic_qk`: per-head W^Q_h W^K_hᵀ = rank-d_h truncation of α Z_h + β I, Z_h Gaussian or
  uniform (`dist`, docs/method/authors_init.md §1).
- `mimetic_vo`: the plain mimetic baseline W^V W^O = α Z − β I (Trockman & Kolter).
- `scaled_uniform_orthogonal`: the DKS/TAT MLP kernel initializer (flax `kernel_init` style),
  built on `haar_orthogonal`.
- `attention_kernels`: the four attention kernels for a method name, as `vit.py` consumes them.
- `self_attention_share`: the mean attention of a token on itself at init (docs/method/papers.md §3),
  and `self_share_beta`, the β that sets it (`config.model.init_self_share`).
"""

from __future__ import annotations

import functools
import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp

from skipless_jax import linalg

# 'timm' / 'mae': the references' inits (docs/method/families.md §24, models/init_schemes.py); modules
# build under them as under 'default' (PLAIN_SCHEMES), then every parameter is redrawn.
REFERENCE_SCHEMES = ("timm", "mae")
PLAIN_SCHEMES = ("default", *REFERENCE_SCHEMES)
INIT_METHODS = ("default", "skipless", "mimetic", *REFERENCE_SCHEMES, "orthogonal")
# The inits without α, β, c: 'orthogonal' draws every kernel Haar orthogonal (docs/method/skipless_lm.md §4).
NO_CONSTANTS = (*PLAIN_SCHEMES, "orthogonal")

# config.model.init_qk_dist / init_vo / init_mlp (docs/method/authors_init.md §2): the paper's
# text first (the default), the authors' fork second.
QK_DISTS = ("normal", "uniform")
VO_FORMS = ("polar", "fork")
MLP_INITS = ("suo", "default")

# Plain mimetic V/O constants of docs/method/papers.md §3 (α₂ = β₂ = 0.4); Q/K take the configured α, β.
MIMETIC_VO_ALPHA = 0.4
MIMETIC_VO_BETA = 0.4


def _check_positive(name: str, value: float) -> None:
    if not (isinstance(value, numbers.Real) and math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


def _check_nonnegative(name: str, value: float) -> None:
    if not (isinstance(value, numbers.Real) and math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


def _check_heads(d: int, num_heads: int) -> None:
    if not (isinstance(d, int) and d > 0):
        raise ValueError(f"width d must be a positive int, got {d!r}")
    if not (isinstance(num_heads, int) and num_heads > 0) or d % num_heads:
        raise ValueError(f"num_heads={num_heads!r} must be a positive int dividing width d={d}")


def validate_init(
    method: str, d: int, num_heads: int, alpha: float, beta: float, c: float
) -> None:
    """Raises a one-line ValueError for an unknown method or bad constants (before any compile)."""
    if method not in INIT_METHODS:
        raise ValueError(f"model.init={method!r} is unknown; allowed: {', '.join(INIT_METHODS)}")
    _check_heads(d, num_heads)
    if method in NO_CONSTANTS:
        return
    _check_positive("model.init_alpha", alpha)
    _check_nonnegative("model.init_beta", beta)
    if method == "skipless":
        _check_positive("model.init_c", c)


def _check_choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    """`config.model.<name>` is None (the default, allowed[0]) or one of `allowed`."""
    if value is not None and value not in allowed:
        raise ValueError(f"config.model.{name}={value!r} is unknown; allowed: {', '.join(allowed)}")


def validate_init_config(model_config: Any) -> None:
    """Validates `config.model`'s init fields: init, init_alpha, init_beta, init_c, init_self_share
    (a target in (0, 1) of init='skipless' or 'mimetic', or None), init_qk_dist, init_vo, init_mlp
    (docs/method/authors_init.md), width, num_heads.

    Width/heads are checked only without a `variant` (whose standard sizes replace them).
    """
    get = model_config.get if hasattr(model_config, "get") else (
        lambda k, v=None: getattr(model_config, k, v))
    method = get("init", "default")
    if method not in INIT_METHODS:
        raise ValueError(f"model.init={method!r} is unknown; allowed: {', '.join(INIT_METHODS)}")
    d, h = get("width", None), get("num_heads", None)
    if not get("variant", None) and d is not None and h is not None:
        _check_heads(d, h)
    if method not in NO_CONSTANTS:
        _check_positive("model.init_alpha", get("init_alpha", None))
        _check_nonnegative("model.init_beta", get("init_beta", None))
    if method == "skipless":
        _check_positive("model.init_c", get("init_c", None))
    for name, allowed in (("init_qk_dist", QK_DISTS), ("init_vo", VO_FORMS), ("init_mlp", MLP_INITS)):
        _check_choice(name, get(name, None), allowed)
    if get("init_self_share", None) is not None:
        check_self_share(get("init_self_share", None))
        if method not in SHARE_METHODS:
            raise ValueError(f"config.model.init_self_share sets the β of init="
                             f"{' or '.join(map(repr, SHARE_METHODS))}; config.model.init={method!r} has none")


def scaled_orthogonal_vo(key: jax.Array, d: int, c: float, vo: str = "polar") -> tuple[jax.Array, jax.Array]:
    """Whole-layer value/output init (docs/method/papers.md §3): G ~ N(0,1)^{d×d} = U S Vᵀ, W^V = cU, W^O = cVᵀ.

    Returns (w_v, w_o), both (d, d) float32; w_v's columns are grouped by head, w_o's rows.
    The full product W^V W^O = c² U Vᵀ has every singular value equal to c².
    `vo='fork'` (the authors' fork, docs/method/authors_init.md §2): W^O = cV, W^V W^O = c² U V,
    each singular pair (u_i, v_i) signed so that u_i's entry of largest magnitude is positive.
    """
    _check_positive("c", c)
    _check_choice("init_vo", vo, VO_FORMS)
    g = jax.random.normal(key, (d, d), jnp.float32)
    u, _, vt = jnp.linalg.svd(g, full_matrices=False)
    if vo == "polar":
        return c * u, c * vt
    rows = jnp.arange(d)
    sign = jnp.where(u[jnp.argmax(jnp.abs(u), axis=0), rows] < 0, -1.0, 1.0)  # (d,), one per pair
    return c * u * sign[None, :], c * (vt * sign[:, None]).T


def mimetic_qk_targets(
    key: jax.Array, d: int, num_heads: int, alpha: float, beta: float, dist: str = "normal"
) -> jax.Array:
    """Per-head targets M_h = α Z_h + β I_d (docs/method/papers.md §3). Returns (h, d, d).

    Head h draws Z_h from `jax.random.split(key, num_heads)[h]`: 'normal' Z_h ~ N(0, 1/d);
    'uniform' (the authors' fork, docs/method/authors_init.md §1) Z_h = −b + 2b·U, U ~ U[0, 1),
    b = √3/√d (the same variance 1/d).
    """
    keys = jax.random.split(key, num_heads)
    if dist == "normal":
        z = jax.vmap(lambda k: jax.random.normal(k, (d, d), jnp.float32))(keys) / math.sqrt(d)
    else:
        _check_choice("init_qk_dist", dist, QK_DISTS)
        bound = math.sqrt(3.0) / math.sqrt(d)
        z = -bound + 2.0 * bound * jax.vmap(lambda k: jax.random.uniform(k, (d, d), jnp.float32))(keys)
    return alpha * z + beta * jnp.eye(d, dtype=jnp.float32)


def mimetic_qk(
    key: jax.Array, d: int, num_heads: int, alpha: float, beta: float, dist: str = "normal"
) -> tuple[jax.Array, jax.Array]:
    """Mimetic query/key init per head (docs/method/papers.md §3).

    M_h = U S Vᵀ; W^Q_h = U[:, :d_h] √S[:d_h], W^K_h = V[:, :d_h] √S[:d_h], so W^Q_h W^K_hᵀ is
    the rank-d_h truncation of M_h. Returns (w_q, w_k), both (d, d), head h in columns
    [h·d_h, (h+1)·d_h).
    """
    _check_heads(d, num_heads)
    _check_positive("alpha", alpha)
    _check_nonnegative("beta", beta)
    return _truncated_qk(mimetic_qk_targets(key, d, num_heads, alpha, beta, dist))


def _truncated_qk(m: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(h, d, d) targets M_h -> (w_q, w_k), both (d, d): each head the rank-d_h factors of M_h."""
    h, d, _ = m.shape
    dh = d // h
    u, s, vt = linalg.svd(m)  # (h, d, d), (h, d), (h, d, d)
    root = jnp.sqrt(s[:, None, :dh])  # (h, 1, d_h)
    w_q = u[:, :, :dh] * root  # (h, d, d_h)
    w_k = jnp.swapaxes(vt[:, :dh, :], 1, 2) * root  # (h, d, d_h)
    # Heads become column groups: (h, d, d_h) -> (d, h·d_h).
    return tuple(jnp.transpose(w, (1, 0, 2)).reshape(d, d) for w in (w_q, w_k))


def mimetic_vo(key: jax.Array, d: int, alpha: float, beta: float) -> tuple[jax.Array, jax.Array]:
    """Plain mimetic value/output baseline: W^V W^O = α Z − β I, Z ~ N(0, 1/d) (Trockman & Kolter).

    M = U S Vᵀ, W^V = U √S, W^O = √S Vᵀ. Returns (w_v, w_o), both (d, d).
    """
    _check_positive("alpha", alpha)
    _check_nonnegative("beta", beta)
    z = jax.random.normal(key, (d, d), jnp.float32) / math.sqrt(d)
    m = alpha * z - beta * jnp.eye(d, dtype=jnp.float32)
    u, s, vt = jnp.linalg.svd(m, full_matrices=False)
    root = jnp.sqrt(s)
    return u * root[None, :], root[:, None] * vt


def haar_orthogonal(key: jax.Array, shape: tuple[int, int]) -> jax.Array:
    """Haar-distributed (in, out) matrix with orthonormal columns (tall) or rows (wide).

    QR of a Gaussian (max × min) with the sign fix Q ← Q·sign(diag R) that makes it Haar.
    """
    n_in, n_out = shape
    big, small = max(n_in, n_out), min(n_in, n_out)
    q, r = jnp.linalg.qr(jax.random.normal(key, (big, small), jnp.float32))
    q = q * jnp.where(jnp.diagonal(r) < 0, -1.0, 1.0)[None, :]
    return q if n_in >= n_out else q.T


def scaled_uniform_orthogonal(
    key: jax.Array, shape: tuple[int, ...], dtype: Any = jnp.float32
) -> jax.Array:
    """DKS/TAT MLP kernel init (docs/method/papers.md §3): Haar orthogonal (in, out) × max(√(out/in), 1).

    Usable as a flax `kernel_init`. Leading axes of an N-D shape are flattened into `in`.
    For d→4d every singular value is 2; for 4d→d it is 1.
    """
    if len(shape) < 2:
        raise ValueError(f"scaled_uniform_orthogonal needs a kernel shape with >= 2 axes, got {shape}")
    n_in, n_out = math.prod(shape[:-1]), shape[-1]
    scale = max(math.sqrt(n_out / n_in), 1.0)
    return (scale * haar_orthogonal(key, (n_in, n_out))).reshape(shape).astype(dtype)


def attention_kernels(
    key: jax.Array, method: str, d: int, num_heads: int, alpha: float, beta: float, c: float,
    qk_dist: str = "normal", vo: str = "polar",
) -> dict[str, jax.Array]:
    """The four (d, d) attention kernels {query, key, value, out} for `method` (docs/method/papers.md §3).

    'skipless': mimetic Q/K with (alpha, beta) and scaled-orthogonal V/O with c; `qk_dist` and
                `vo` choose the text's or the authors' fork's draw (docs/method/authors_init.md).
    'mimetic':  mimetic Q/K with (alpha, beta) and mimetic V/O with the fixed
                (MIMETIC_VO_ALPHA, MIMETIC_VO_BETA) = (0.4, 0.4); c is unused. The plain
                mimetic baseline of docs/method/papers.md §3 sets alpha = beta = 0.7 in the config.
    """
    if method not in ("skipless", "mimetic"):
        raise ValueError(f"attention_kernels method={method!r} is unknown; allowed: skipless, mimetic")
    validate_init(method, d, num_heads, alpha, beta, c)
    k_qk, k_vo = jax.random.split(key)
    w_q, w_k = mimetic_qk(k_qk, d, num_heads, alpha, beta, qk_dist)
    if method == "skipless":
        w_v, w_o = scaled_orthogonal_vo(k_vo, d, c, vo)
    else:
        w_v, w_o = mimetic_vo(k_vo, d, MIMETIC_VO_ALPHA, MIMETIC_VO_BETA)
    return dict(query=w_q, key=w_k, value=w_v, out=w_o)


# `self_share_beta` searches β in [0, SHARE_BETA_MAX] to SHARE_BETA_TOL (docs/method/papers.md §3).
SHARE_BETA_MAX = 1024.0
SHARE_BETA_TOL = 1e-4
SHARE_METHODS = ("skipless", "mimetic")  # the inits whose β `init_self_share` sets


# The reference inits' query/key draws, `keys (2,) -> (w_q, w_k)` for one (d, d) ViT layer, by
# init name: models/init_schemes.py registers 'timm' and 'mae' from its tables when it is
# imported (the package models/__init__.py imports it), so this module imports nothing above it.
REFERENCE_QK: dict[str, Any] = {}


def query_key_kernels(
    key: jax.Array, method: str, d: int, num_heads: int, alpha: float, beta: float, dist: str = "normal"
) -> tuple[jax.Array, jax.Array]:
    """(w_q, w_k), both (d, d), of one attention layer drawn from the layer's `key` as `method`
    draws them (docs/method/papers.md §3): the Q/K half of `attention_kernels` for 'skipless' and
    'mimetic' (traceable in alpha, beta); Xavier uniform for 'default'; the reference table's
    rule (models/init_schemes.py) for 'timm' and 'mae'."""
    if method in SHARE_METHODS:
        return _truncated_qk(mimetic_qk_targets(jax.random.split(key)[0], d, num_heads, alpha, beta, dist))
    keys = jax.random.split(key)
    if method == "default":
        draw = jax.nn.initializers.xavier_uniform()
        return draw(keys[0], (d, d), jnp.float32), draw(keys[1], (d, d), jnp.float32)
    if method not in REFERENCE_QK:
        raise ValueError(f"init={method!r}: no query/key rule registered; known: "
                         f"{sorted((*SHARE_METHODS, 'default', *REFERENCE_QK))}")
    return REFERENCE_QK[method](keys, d)


@functools.partial(jax.jit, static_argnames=("method", "d", "num_heads", "depth", "num_tokens", "num_samples", "dist"))
def _share(key: jax.Array, alpha: jax.Array, beta: jax.Array, *, method: str, d: int, num_heads: int,
           depth: int, num_tokens: int, num_samples: int, dist: str = "normal") -> jax.Array:
    """The mean of diag softmax(X Wᵠ_h (X Wᴷ_h)ᵀ/√d_h) over samples, tokens, heads and layers
    (docs/method/papers.md §3); split(key, depth + 1): [0] the tokens X, [1 + l] layer l's kernels."""
    keys = jax.random.split(key, depth + 1)
    x = jax.random.normal(keys[0], (num_samples, num_tokens, d), jnp.float32)
    dh = d // num_heads

    def layer_share(layer_key: jax.Array) -> jax.Array:
        w_q, w_k = query_key_kernels(layer_key, method, d, num_heads, alpha, beta, dist)
        q, k = ((x @ w).reshape(num_samples, num_tokens, num_heads, dh) for w in (w_q, w_k))
        attention = jax.nn.softmax(jnp.einsum("sqhe,skhe->shqk", q, k) / math.sqrt(dh), axis=-1)
        return jnp.diagonal(attention, axis1=-2, axis2=-1).mean()

    return jax.lax.map(layer_share, keys[1:]).mean()


def _share_fields(model_config: Any) -> dict[str, Any]:
    """The init method, sizes and α, β of a ViT `config.model` (its variant resolved), validated."""
    from skipless_jax.models import variants

    name = model_config.get("name", "vit") or "vit"
    if name != "vit":
        raise ValueError(f"the self-attention share is defined for the 'vit' family; config.model.name={name!r}")
    sizes = variants.resolve_sizes(model_config)
    get = lambda k, v: v if sizes.get(k) is None else sizes[k]
    fields = dict(method=get("init", "default"), d=sizes.get("width"), num_heads=sizes.get("num_heads"),
                  depth=sizes.get("depth"), alpha=get("init_alpha", 1.0), beta=get("init_beta", 1.0),
                  dist=get("init_qk_dist", "normal"))
    validate_init(fields["method"], fields["d"], fields["num_heads"], fields["alpha"], fields["beta"], 1.0)
    if not (isinstance(fields["depth"], int) and fields["depth"] > 0):
        raise ValueError(f"config.model.depth={fields['depth']!r} must be a positive int")
    return fields


def _share_of_beta(model_config: Any, num_tokens: int, num_samples: int, seed: int) -> Any:
    """(beta -> the share with that β, the config's fields), computed on the host CPU in float32
    whatever the default backend, so that every process and platform finds the same numbers."""
    for name, value in (("num_tokens", num_tokens), ("num_samples", num_samples)):
        if not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
            raise ValueError(f"{name}={value!r} must be a positive int")
    fields = _share_fields(model_config)
    static = dict(method=fields["method"], d=fields["d"], num_heads=fields["num_heads"], depth=fields["depth"],
                  num_tokens=num_tokens, num_samples=num_samples, dist=fields["dist"])
    cpu = jax.devices("cpu")[0]

    def share(beta: float) -> float:
        with jax.default_device(cpu):
            return float(_share(jax.random.PRNGKey(seed), jnp.float32(fields["alpha"]), jnp.float32(beta), **static))

    return share, fields


def self_attention_share(model_config: Any, num_tokens: int, *, num_samples: int = 64, seed: int = 0) -> float:
    """The mean attention weight of a token on itself at init (docs/method/papers.md §3), over the heads
    and blocks of the ViT `config.model` (its init, α, β; biases zero as at init), for
    `num_samples` draws of `num_tokens` N(0, I_d) tokens (what LayerNorm feeds the attention).

    Layer l's kernels are drawn by `query_key_kernels` from split(PRNGKey(seed), depth + 1)[1 + l],
    the tokens from [0], the same tokens for every layer. 1/num_tokens is uniform attention.
    """
    share, fields = _share_of_beta(model_config, num_tokens, num_samples, seed)
    return share(fields["beta"])


def check_self_share(target: Any) -> None:
    """One-line ValueError unless `config.model.init_self_share` is a number in (0, 1)."""
    if not (isinstance(target, numbers.Real) and not isinstance(target, bool) and 0.0 < target < 1.0):
        raise ValueError(f"config.model.init_self_share={target!r} must be a number in (0, 1) (None: the config's β)")


def self_share_beta(model_config: Any, num_tokens: int, target: float, *, num_samples: int = 64,
                    seed: int = 0) -> float:
    """The β (rounded to 4 decimals) at which `self_attention_share` of `config.model` equals
    `target` at `num_tokens` tokens (docs/method/papers.md §3, this project's `init_self_share`): the
    upper end doubles from 1 until its share exceeds the target, then bisection to SHARE_BETA_TOL.
    One-line ValueError for a target outside (0, 1), an init without β, or a target the shares at
    β = 0 and β = SHARE_BETA_MAX do not bracket."""
    validate_init_config({**dict(model_config), "init_self_share": target})
    share, _ = _share_of_beta(model_config, num_tokens, num_samples, seed)
    lo, hi = 0.0, 1.0
    low, high = share(lo), share(hi)
    while high < target and hi < SHARE_BETA_MAX:
        lo, hi = hi, 2 * hi
        high = share(hi)
    if not low < target <= high:
        raise ValueError(f"config.model.init_self_share={target!r} is not reachable at {num_tokens} tokens: "
                         f"β in [0, {SHARE_BETA_MAX:g}] gives shares from {low:.4f} to {high:.4f}")
    while hi - lo > SHARE_BETA_TOL:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if share(mid) < target else (lo, mid)
    return round((lo + hi) / 2, 4)
