"""Initializations for skipless Transformers (docs/method.md §3, "Cutting the Skip").

Dense kernels are (in, out): y = x W. Attention kernels are (d, d) with heads as column groups
(query/key/value) or row groups (out). All functions are pure in `key`; validation happens on
Python floats before anything is traced.

- `scaled_orthogonal_vo`: value/output of a whole layer with W^V W^O = c² U Vᵀ (κ = 1).
- `mimetic_qk`: per-head W^Q_h W^K_hᵀ = rank-d_h truncation of α Z_h + β I.
- `mimetic_vo`: the plain mimetic baseline W^V W^O = α Z − β I (Trockman & Kolter).
- `scaled_uniform_orthogonal`: the DKS/TAT MLP kernel initializer (flax `kernel_init` style),
  built on `haar_orthogonal`.
- `attention_kernels`: the four attention kernels for a method name, as `vit.py` consumes them.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp

from skipless_jax import linalg

# 'timm' / 'mae': the references' inits (docs/method.md §24, models/init_schemes.py); modules
# build under them as under 'default' (PLAIN_SCHEMES), then every parameter is redrawn.
REFERENCE_SCHEMES = ("timm", "mae")
PLAIN_SCHEMES = ("default", *REFERENCE_SCHEMES)
INIT_METHODS = ("default", "skipless", "mimetic", *REFERENCE_SCHEMES)

# Plain mimetic V/O constants of docs/method.md §3 (α₂ = β₂ = 0.4); Q/K take the configured α, β.
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
    if method in PLAIN_SCHEMES:
        return
    _check_positive("model.init_alpha", alpha)
    _check_nonnegative("model.init_beta", beta)
    if method == "skipless":
        _check_positive("model.init_c", c)


def validate_init_config(model_config: Any) -> None:
    """Validates `config.model`'s init fields: init, init_alpha, init_beta, init_c, width, num_heads.

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
    if method not in PLAIN_SCHEMES:
        _check_positive("model.init_alpha", get("init_alpha", None))
        _check_nonnegative("model.init_beta", get("init_beta", None))
    if method == "skipless":
        _check_positive("model.init_c", get("init_c", None))


def scaled_orthogonal_vo(key: jax.Array, d: int, c: float) -> tuple[jax.Array, jax.Array]:
    """Whole-layer value/output init (docs/method.md §3): G ~ N(0,1)^{d×d} = U S Vᵀ, W^V = cU, W^O = cVᵀ.

    Returns (w_v, w_o), both (d, d) float32; w_v's columns are grouped by head, w_o's rows.
    The full product W^V W^O = c² U Vᵀ has every singular value equal to c².
    """
    _check_positive("c", c)
    g = jax.random.normal(key, (d, d), jnp.float32)
    u, _, vt = jnp.linalg.svd(g, full_matrices=False)
    return c * u, c * vt


def mimetic_qk_targets(
    key: jax.Array, d: int, num_heads: int, alpha: float, beta: float
) -> jax.Array:
    """Per-head targets M_h = α Z_h + β I_d, Z_h ~ N(0, 1/d) (docs/method.md §3). Returns (h, d, d).

    Head h draws Z_h from `jax.random.split(key, num_heads)[h]`.
    """
    keys = jax.random.split(key, num_heads)
    z = jax.vmap(lambda k: jax.random.normal(k, (d, d), jnp.float32))(keys) / math.sqrt(d)
    return alpha * z + beta * jnp.eye(d, dtype=jnp.float32)


def mimetic_qk(
    key: jax.Array, d: int, num_heads: int, alpha: float, beta: float
) -> tuple[jax.Array, jax.Array]:
    """Mimetic query/key init per head (docs/method.md §3).

    M_h = U S Vᵀ; W^Q_h = U[:, :d_h] √S[:d_h], W^K_h = V[:, :d_h] √S[:d_h], so W^Q_h W^K_hᵀ is
    the rank-d_h truncation of M_h. Returns (w_q, w_k), both (d, d), head h in columns
    [h·d_h, (h+1)·d_h).
    """
    _check_heads(d, num_heads)
    _check_positive("alpha", alpha)
    _check_nonnegative("beta", beta)
    dh = d // num_heads
    m = mimetic_qk_targets(key, d, num_heads, alpha, beta)
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
    """DKS/TAT MLP kernel init (docs/method.md §3): Haar orthogonal (in, out) × max(√(out/in), 1).

    Usable as a flax `kernel_init`. Leading axes of an N-D shape are flattened into `in`.
    For d→4d every singular value is 2; for 4d→d it is 1.
    """
    if len(shape) < 2:
        raise ValueError(f"scaled_uniform_orthogonal needs a kernel shape with >= 2 axes, got {shape}")
    n_in, n_out = math.prod(shape[:-1]), shape[-1]
    scale = max(math.sqrt(n_out / n_in), 1.0)
    return (scale * haar_orthogonal(key, (n_in, n_out))).reshape(shape).astype(dtype)


def attention_kernels(
    key: jax.Array, method: str, d: int, num_heads: int, alpha: float, beta: float, c: float
) -> dict[str, jax.Array]:
    """The four (d, d) attention kernels {query, key, value, out} for `method` (docs/method.md §3).

    'skipless': mimetic Q/K with (alpha, beta) and scaled-orthogonal V/O with c.
    'mimetic':  mimetic Q/K with (alpha, beta) and mimetic V/O with the fixed
                (MIMETIC_VO_ALPHA, MIMETIC_VO_BETA) = (0.4, 0.4); c is unused. The plain
                mimetic baseline of docs/method.md §3 sets alpha = beta = 0.7 in the config.
    """
    if method not in ("skipless", "mimetic"):
        raise ValueError(f"attention_kernels method={method!r} is unknown; allowed: skipless, mimetic")
    validate_init(method, d, num_heads, alpha, beta, c)
    k_qk, k_vo = jax.random.split(key)
    w_q, w_k = mimetic_qk(k_qk, d, num_heads, alpha, beta)
    if method == "skipless":
        w_v, w_o = scaled_orthogonal_vo(k_vo, d, c)
    else:
        w_v, w_o = mimetic_vo(k_vo, d, MIMETIC_VO_ALPHA, MIMETIC_VO_BETA)
    return dict(query=w_q, key=w_k, value=w_v, out=w_o)
