"""Token Graying (TG): shrink the spread of a patch-token matrix's spectrum (docs/method/papers.md §4).

Every function maps raw patch tokens of shape (..., n, d_in) to the same shape and dtype,
batched over the leading axes, jit- and vmap-friendly. Compute is float32 at least (bf16 in,
float32 inside, bf16 out). ε ∈ (0, 1]; ε = 1 is the identity.

- `svd_token_graying`: X = U Σ Vᵀ; X̃ = U σ_max (Σ/σ_max)^ε Vᵀ, so κ(X̃) = κ(X)^ε.
- `fast_svd_token_graying`: the same function without a full SVD, from the eigendecomposition
  of the smaller Gram matrix, refined on the small-eigenvalue block so that small singular
  values keep the accuracy of an SVD (a plain float32 Gram resolves σ only down to
  ≈ √eps·σ_max ≈ 2e-4·σ_max, which real photo patches go below).
- `dct_token_graying`: C = DCT-II(X) (orthonormal, both axes); C̃ = sign(C) c_max (|C|/c_max)^ε;
  X̃ = DCT-II⁻¹(C̃), both transforms on real FFTs (`dct2`, `idct2`).

Numerical choice of this project (beyond docs/method/papers.md §4): ratios r = σ/σ_max (or |C|/c_max) below a
noise floor r₀ are mapped by r₀^ε·(r/r₀)³ instead of r^ε. Rounding noise (r ≈ eps) is then
suppressed instead of amplified to eps^ε, so rank-deficient inputs (flat patches, black borders)
give the same result from every algorithm; the map stays continuous and monotone, zero stays
zero, and its slope — hence every gradient — is bounded by 3·r₀^(ε-1). Above r₀ nothing changes,
so κ(X̃) = κ(X)^ε holds for κ(X) < 1/r₀ and ε = 1 is the identity there. r₀ = max(n, d_in)·eps
(numpy's rank tolerance) for the SVD forms; r₀ = eps² for the DCT form, which acts per
coefficient (no rank to protect) and whose small coefficients float32 computes accurately;
eps of the compute dtype.

Gradients: the SVD forms carry a custom JVP (Daleckii–Krein divided differences on the
eigenpairs of XᵀX), so they are exact where the function is smooth and finite everywhere,
including repeated and zero singular values, where differentiating `svd`/`eigh` gives NaN.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from skipless_jax import linalg

# Level-0 Gram eigenvalues below _DEFLATION_TAU·λ_max are recomputed from their own block.
_DEFLATION_TAU = 1e-2
_DEFLATION_LEVELS = 3
# Eigenvalue pairs closer than this (relative) use the derivative instead of a divided difference.
_CLOSE_RTOL = 1e-4


def _mT(x: jax.Array) -> jax.Array:
    return jnp.swapaxes(x, -1, -2)


def _compute_dtype(dtype) -> jnp.dtype:
    # bf16/f16 in → float32 inside; float64 (with x64) stays float64.
    return jnp.promote_types(dtype, jnp.float32)


def _svd_floor(n: int, m: int, dtype) -> float:
    """Relative noise floor r₀ of singular values of an n×m matrix (numpy's rank tolerance)."""
    return max(n, m) * float(jnp.finfo(dtype).eps)


def _power_ratio(r: jax.Array, eps: jax.Array, r0: float) -> jax.Array:
    """g(r) = r^ε for r ≥ r₀, r₀^ε·(r/r₀)³ below: continuous at r₀, g(0) = 0, slope ≤ 3·r₀^(ε-1)."""
    safe = jnp.maximum(r, r0)  # keeps log finite in the unused branch
    return jnp.where(r >= r0, jnp.exp(eps * jnp.log(safe)), r0**eps * (r / r0) ** 3)


def _phi(lam: jax.Array, lam_max: jax.Array, eps: jax.Array, r0: float):
    """φ(λ) = g(r)/r with r = √(λ/λ_max), so X̃ = X·V φ(Λ) Vᵀ; also ∂φ/∂λ, ∂φ/∂λ_max, ∂φ/∂ε.

    Shapes: lam (..., m), lam_max (..., 1). Below the floor φ = r₀^(ε-1)·λ/(r₀²λ_max) is linear
    in λ, so every derivative stays bounded as λ → 0.
    """
    lam_max = jnp.where(lam_max > 0, lam_max, 1.0)
    q = jnp.maximum(lam, 0.0) / lam_max
    q0 = r0 * r0
    in_power = q >= q0
    log_r = 0.5 * jnp.log(jnp.where(in_power, q, 1.0))
    floor_slope = r0 ** (eps - 1.0) / q0
    phi = jnp.where(in_power, jnp.exp((eps - 1.0) * log_r), floor_slope * q)
    safe_lam = jnp.where(in_power, lam, 1.0)
    dphi_dlam = jnp.where(in_power, 0.5 * (eps - 1.0) * phi / safe_lam, floor_slope / lam_max)
    dphi_dlmax = jnp.where(in_power, -0.5 * (eps - 1.0), -1.0) * phi / lam_max
    dphi_deps = phi * jnp.where(in_power, log_r, math.log(r0))
    return phi, dphi_dlam, dphi_dlmax, dphi_deps


def _gram_eigh(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Eigenpairs (λ ascending (..., m), V (..., m, m)) of XᵀX for x (..., n, m), n ≥ m.

    Level 0 is eigh(XᵀX), whose eigenvalues carry an absolute error ≈ eps·λ_max. Each next level
    recomputes the still-small block (λ < τ·its max) from Y = X·V restricted to it, so its
    error scales with that block's own norm. Resolved columns get a marker diagonal ν > ‖block‖
    so eigh sorts them last, then are put back unchanged; shapes stay static.
    """
    m = x.shape[-1]
    idx = jnp.arange(m)
    eye = jnp.eye(m, dtype=x.dtype)
    v = jnp.broadcast_to(eye, x.shape[:-2] + (m, m))
    lam = jnp.zeros(x.shape[:-2] + (m,), x.dtype)
    count = jnp.full(x.shape[:-2] + (1,), m)  # the first `count` columns are unresolved
    for _ in range(_DEFLATION_LEVELS):
        live = idx < count  # (..., m)
        y = (x @ v) * live[..., None, :]
        a = _mT(y) @ y
        marker = 2.0 * jnp.max(jnp.sum(jnp.abs(a), axis=-1), axis=-1, keepdims=True) + 1e-30
        a = a + jnp.where(live, 0.0, marker)[..., None, :] * eye
        mu, w = linalg.eigh(a)
        # Unresolved eigenvectors live in the first `count` coordinates; resolved stay put.
        both = live[..., :, None] & live[..., None, :]
        w = jnp.where(both, w, eye)
        v = v @ w
        lam = jnp.where(live, mu, lam)
        top = jnp.max(jnp.where(live, mu, -jnp.inf), axis=-1, keepdims=True)
        count = jnp.sum(live & (mu < _DEFLATION_TAU * top), axis=-1, keepdims=True)
    return lam, v


def _svd_eigh(x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(σ, U, V) of the thin SVD of x (..., n, m), n ≥ m, ordered ascending like eigh."""
    u, s, vt = linalg.svd(x)
    return s[..., ::-1], u[..., ::-1], _mT(vt)[..., ::-1]


@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def _spectral_tg(x: jax.Array, eps: jax.Array, method: str) -> jax.Array:
    """SVD-TG of x (..., n, m) with n ≥ m, by `method` 'svd' or 'gram'."""
    return _spectral_tg_parts(x, eps, method)[0]


def _spectral_tg_parts(x, eps, method):
    n, m = x.shape[-2:]
    r0 = _svd_floor(n, m, x.dtype)
    if method == "svd":
        s, u, v = _svd_eigh(x)
        smax = s[..., -1:]
        g = _power_ratio(s / jnp.where(smax > 0, smax, 1.0), eps[..., None], r0)
        out = (u * (smax * g)[..., None, :]) @ _mT(v)  # U h(Σ) Vᵀ: zero σ stays exactly zero
        lam, y = s * s, u * s[..., None, :]
    else:
        # A tall X has the eigenpairs of its m×m triangular factor R (XᵀX = RᵀR): refining on R
        # makes every deflation matmul m³ instead of n·m².
        lam, v = _gram_eigh(linalg.qr(x, mode="r") if n >= 2 * m else x)
        y = x @ v
        phi = _phi(lam, lam[..., -1:], eps[..., None], r0)[0]
        out = x @ ((v * phi[..., None, :]) @ _mT(v))  # X·V φ(Λ) Vᵀ, one n×m×m product
    return out, lam, v, y, r0


@_spectral_tg.defjvp
def _spectral_tg_jvp(method, primals, tangents):
    x, eps = primals
    dx, deps = tangents
    out, lam, v, y, r0 = _spectral_tg_parts(x, eps, method)
    lam_max = lam[..., -1:]
    phi, _, dphi_dmax, dphi_deps = _phi(lam, lam_max, eps[..., None], r0)
    # Divided differences K_ij = (φ_i − φ_j)/(λ_i − λ_j), the derivative where λ_i ≈ λ_j.
    li, lj = lam[..., :, None], lam[..., None, :]
    close = jnp.abs(li - lj) <= _CLOSE_RTOL * jnp.maximum(jnp.abs(li), jnp.abs(lj))
    diff = jnp.where(close, 1.0, li - lj)
    mid = _phi(0.5 * (li + lj), lam_max[..., None], eps[..., None, None], r0)[1]
    k = jnp.where(close, mid, (phi[..., :, None] - phi[..., None, :]) / diff)
    dy = dx @ v
    p = _mT(y) @ dy
    p = p + _mT(p)  # Vᵀ dG V, dG = dXᵀX + XᵀdX
    dlam_max = p[..., -1:, -1]  # dλ_max = v_maxᵀ dG v_max
    diag = dphi_dmax * dlam_max + dphi_deps * deps[..., None]  # λ_max and ε enter φ too
    inner = k * p + diag[..., None, :] * jnp.eye(lam.shape[-1], dtype=lam.dtype)
    dout = (dy * phi[..., None, :] + y @ inner) @ _mT(v)
    return out, dout


def _spectral_entry(tokens: jax.Array, eps, method: str) -> jax.Array:
    in_dtype = tokens.dtype
    x = tokens.astype(_compute_dtype(in_dtype))
    eps = jnp.broadcast_to(jnp.asarray(eps, x.dtype), x.shape[:-2])
    tall = x.shape[-2] >= x.shape[-1]  # work on the smaller Gram matrix
    out = _spectral_tg(x if tall else _mT(x), eps, method)
    return (out if tall else _mT(out)).astype(in_dtype)


def svd_token_graying(tokens: jax.Array, eps: float) -> jax.Array:
    """SVD-TG (docs/method/papers.md §4): X̃ = U σ_max (Σ/σ_max)^ε Vᵀ per (n, d_in) matrix.

    Args:
      tokens: (..., n, d_in) raw patch tokens; any float dtype (float32 compute inside).
      eps: ε ∈ (0, 1], a float or an array broadcastable to the batch shape `tokens.shape[:-2]`.
    Returns: (..., n, d_in) in the input dtype, with κ(X̃) = κ(X)^ε while κ(X) < 1/r₀.
    """
    return _spectral_entry(tokens, eps, "svd")


def fast_svd_token_graying(tokens: jax.Array, eps: float) -> jax.Array:
    """SVD-TG without an SVD: X̃ = σ_max^(1-ε)·X (XᵀX)^((ε-1)/2) on the smaller Gram matrix.

    The same function as `svd_token_graying` (docs/method/papers.md §4), computed from a few symmetric
    eigendecompositions of a min(n, d_in)² matrix (see `_gram_eigh`). Shapes as there.
    """
    return _spectral_entry(tokens, eps, "gram")


def _dct_scale(n: int, dtype) -> jax.Array:
    """Orthonormal DCT-II row scales: √(1/n) for k = 0, √(2/n) otherwise."""
    s = np.full(n, math.sqrt(2.0 / n))
    s[0] = math.sqrt(1.0 / n)
    return jnp.asarray(s, dtype)


def _dct_twiddle(n: int, dtype) -> jax.Array:
    """W_k = exp(−iπk/(2n)) for k = 0..n//2 (complex `dtype`)."""
    return jnp.asarray(np.exp(-0.5j * np.pi * np.arange(n // 2 + 1) / n), dtype)


def dct_last_axis(x: jax.Array) -> jax.Array:
    """Orthonormal DCT-II over the last axis (= scipy.fft.dct(x, norm='ortho')), (..., n) → (..., n).

    Makhoul's algorithm: one real FFT of length n of the even-then-reversed-odd reordering v;
    with z_k = W_k·rfft(v)_k, C_k = Re z_k for k ≤ n/2 and C_{n−k} = −Im z_k.
    """
    n = x.shape[-1]
    cdtype = jnp.result_type(x.dtype, jnp.complex64)
    v = jnp.concatenate([x[..., ::2], x[..., 1::2][..., ::-1]], axis=-1)
    z = jnp.fft.rfft(v, axis=-1) * _dct_twiddle(n, cdtype)
    c = jnp.concatenate([z.real, -z.imag[..., 1 : (n + 1) // 2][..., ::-1]], axis=-1)
    return c * _dct_scale(n, x.dtype)


def idct_last_axis(c: jax.Array) -> jax.Array:
    """Inverse of `dct_last_axis` (orthonormal DCT-III), written as the exact algebraic inverse:
    rebuild z_k from (C_k, C_{n−k}), undo the twiddle, one inverse real FFT, undo the reordering."""
    n = c.shape[-1]
    cdtype = jnp.result_type(c.dtype, jnp.complex64)
    y = c / _dct_scale(n, c.dtype)
    re = y[..., : n // 2 + 1]
    im = [jnp.zeros_like(y[..., :1]), -y[..., n // 2 + 1 :][..., ::-1]]  # Im z_0 = 0; Im z_k = −C_{n−k}
    if n % 2 == 0 and n > 1:
        im.append(-y[..., n // 2 : n // 2 + 1])  # rfft(v) is real at k = n/2, so Im z = −Re z there
    im = jnp.concatenate(im, axis=-1)[..., : n // 2 + 1]
    v = jnp.fft.irfft((re + 1j * im).astype(cdtype) * jnp.conj(_dct_twiddle(n, cdtype)), n=n, axis=-1)
    half = (n + 1) // 2
    even, odd = v[..., :half], v[..., half:][..., ::-1]
    if n % 2:
        odd = jnp.concatenate([odd, jnp.zeros_like(v[..., :1])], axis=-1)
    return jnp.stack([even, odd], axis=-1).reshape(*v.shape[:-1], 2 * half)[..., :n]


def dct2(x: jax.Array) -> jax.Array:
    """Orthonormal DCT-II over the last two axes (= scipy.fft.dctn(x, axes=(-2, -1), norm='ortho'))."""
    return _mT(dct_last_axis(_mT(dct_last_axis(x))))


def idct2(c: jax.Array) -> jax.Array:
    """Inverse of `dct2` (= scipy.fft.idctn(c, axes=(-2, -1), norm='ortho'))."""
    return idct_last_axis(_mT(idct_last_axis(_mT(c))))


def dct_token_graying(tokens: jax.Array, eps: float) -> jax.Array:
    """DCT-TG (docs/method/papers.md §4): C = DCT-II_ortho(X) over (n, d_in); C̃ = sign(C)·c_max·(|C|/c_max)^ε.

    Args:
      tokens: (..., n, d_in) raw patch tokens; any float dtype (float32 compute inside).
      eps: ε ∈ (0, 1], a float or an array broadcastable to `tokens.shape[:-2]`.
    Returns: (..., n, d_in) in the input dtype, X̃ = DCT-II⁻¹(C̃).

    The transforms are `dct2`/`idct2` on real FFTs (`jnp.fft.rfft`), O(n·d_in·log): on CPU
    about 3× faster than `jax.scipy.fft.dctn`/`idctn`, which run complex FFTs of twice the work.
    """
    in_dtype = tokens.dtype
    x = tokens.astype(_compute_dtype(in_dtype))
    eps = jnp.broadcast_to(jnp.asarray(eps, x.dtype), x.shape[:-2])[..., None, None]
    c = dct2(x)
    cmax = jnp.max(jnp.abs(c), axis=(-2, -1), keepdims=True)
    r = jnp.abs(c) / jnp.where(cmax > 0, cmax, 1.0)
    c = jnp.sign(c) * cmax * _power_ratio(r, eps, float(jnp.finfo(x.dtype).eps) ** 2)
    return idct2(c).astype(in_dtype)


TOKEN_GRAYING: dict[str, Callable[[jax.Array, float], jax.Array]] = {
    "svd": svd_token_graying,
    "svd_fast": fast_svd_token_graying,
    "dct": dct_token_graying,
}


def validate_token_graying(name: str | None, eps: float) -> None:
    """Raise a one-line ValueError for an unknown TG name or ε outside (0, 1]; None is off."""
    if name is None:
        return
    if name not in TOKEN_GRAYING:
        raise ValueError(
            f"model.token_graying={name!r} is unknown; allowed: None, "
            + ", ".join(repr(k) for k in TOKEN_GRAYING)
        )
    try:
        value = float(eps)
    except (TypeError, ValueError):
        raise ValueError(f"model.tg_eps={eps!r} must be a number in (0, 1]") from None
    if not 0.0 < value <= 1.0:  # also rejects NaN
        raise ValueError(f"model.tg_eps={eps!r} must be in (0, 1] (1 is the identity)")
