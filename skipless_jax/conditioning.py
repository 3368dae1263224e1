"""Condition numbers of embeddings and Jacobians (docs/method/papers.md §2). Pure functions.

κ(M) = σ_max(M) / σ_min(M) over the thin SVD of the last two axes; everything is reported as
natural log. Three measurements:

- Embedding κ (`embedding_log_kappa`): per layer, for each of ① SAB output, ①+②, ③ FFN output
  and ③+④, the mean over images of log κ of the (n_tokens, d) token matrix. Jittable; the
  trainer calls it on a fixed probe batch.
- Jacobian κ (`attention_jacobian`, `block_jacobian`): κ of K_ℓ = ∂SA(X)/∂X (nd × nd) at a
  given X, and of a whole block (`encoder_block`, the model's block restated in float64), by
  `jax.jacfwd`, in float64 on small n·d. Without the attention skip the block's Jacobian has a
  LayerNorm null space of dimension 2n (`block_null_dim`), removed before taking κ.
  `attention_kronecker` builds B_ℓ = Σ_h A_h ⊗ (Wⱽ_h Wᴼ_h)ᵀ, the Jacobian with the softmax
  held fixed; with one head it is the paper's (WⱽWᴼ)ᵀ ⊗ A_ℓ (up to the vec ordering).
- Prop. 4.1 of "Always Skip Attention" (`cube_bound_check`): for linear attention
  X Wᵠ Wᴷᵀ Xᵀ X Wⱽ, κ(out) ≤ κ(X)³ κ(WᵠWᴷᵀ) κ(Wⱽ), vs κ(X) κ(W_up W_down) for the linear FFN.

Flattening convention: an (n, d) matrix X is flattened row-major to vec(X) ∈ R^{nd}, so
Jacobians are indexed [(i, a), (j, b)] and vec(A X M) = (A ⊗ Mᵀ) vec(X). Singular values do not
depend on this choice.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from skipless_jax import linalg

EMBEDDING_POINTS = ("sab", "sab_skip", "ffn", "ffn_skip")
POINT_LABELS = {
    "sab": "① SAB output",
    "sab_skip": "①+② SAB output + skip",
    "ffn": "③ FFN output",
    "ffn_skip": "③+④ FFN output + skip",
}
ATTENTION_KERNELS = ("query", "key", "value", "out")
Params = Mapping[str, Any]


def analysis_dtype() -> jnp.dtype:
    """float64 when 64-bit is enabled and the backend is CPU (cheap there), else float32."""
    if jax.config.jax_enable_x64 and jax.default_backend() == "cpu":
        return jnp.dtype(jnp.float64)
    return jnp.dtype(jnp.float32)


def log_condition_number(m: jax.Array) -> jax.Array:
    """Natural log of κ(m) = σ_max/σ_min over the last two axes: (..., r, c) -> (...).

    Computed as log σ_max − log σ_min so that huge κ does not overflow; a singular matrix
    gives +inf. Float64 where `analysis_dtype()` allows, else float32 (never lower).
    """
    if m.ndim < 2:
        raise ValueError(f"log_condition_number needs a matrix (>= 2 axes), got shape {m.shape}")
    s = linalg.svd(m.astype(analysis_dtype()), compute_uv=False)
    return jnp.log(s[..., 0]) - jnp.log(s[..., -1])


def embedding_log_kappa(out: Mapping[str, Any]) -> dict[str, jax.Array]:
    """Per-layer mean-over-batch log κ of the token matrices at ①, ①+②, ③, ③+④ (docs/method/papers.md §2).

    Args:
      out: the ViT's intermediates; `out['blocks'][l][point]` is (B, n_tokens, d).
    Returns:
      {point: (L,) array} for point in EMBEDDING_POINTS.
    """
    blocks = out["blocks"]
    if not blocks:
        raise ValueError("embedding_log_kappa needs out['blocks'] with at least one layer")
    result = {}
    for point in EMBEDDING_POINTS:
        mats = [block[point] for block in blocks]
        if len({m.shape for m in mats}) == 1:  # one batched factorisation: (L, B, n, d)
            result[point] = log_condition_number(jnp.stack(mats)).mean(axis=-1)
        else:  # hierarchical families (Swin, PVTv2): token count and width change by stage
            result[point] = jnp.stack([log_condition_number(m).mean(axis=-1) for m in mats])
    return result


# ------------------------------------------------------------------ attention


def _heads(w: jax.Array, num_heads: int) -> jax.Array:
    """(d, d) kernel with heads as column groups -> (h, d, d_h)."""
    d = w.shape[0]
    return jnp.transpose(w.reshape(d, num_heads, -1), (1, 0, 2))


def _bias(params: Params, name: str, d: int, dtype: Any) -> jax.Array:
    return jnp.asarray(params.get(f"{name}_bias", jnp.zeros((d,))), dtype)


def attention_probs(params: Params, x: jax.Array, num_heads: int) -> jax.Array:
    """A_h = softmax(Q_h K_hᵀ / √d_h) for one image: x (n, d) -> (h, n, n)."""
    n, d = x.shape
    dt = x.dtype
    q = x @ jnp.asarray(params["query"], dt) + _bias(params, "query", d, dt)
    k = x @ jnp.asarray(params["key"], dt) + _bias(params, "key", d, dt)
    q = jnp.transpose(q.reshape(n, num_heads, -1), (1, 0, 2))
    k = jnp.transpose(k.reshape(n, num_heads, -1), (1, 0, 2))
    logits = q @ jnp.swapaxes(k, 1, 2) / jnp.sqrt(jnp.asarray(d // num_heads, dt))
    return jax.nn.softmax(logits, axis=-1)


def self_attention(params: Params, x: jax.Array, num_heads: int) -> jax.Array:
    """SA(X) = Σ_h A_h (X Wⱽ_h + bⱽ_h) Wᴼ_h + bᴼ for one image (docs/method/papers.md §1): (n, d) -> (n, d).

    `params` is a `MultiHeadAttention` param dict: (d, d) kernels query/key/value/out and
    optional `<name>_bias` vectors.
    """
    n, d = x.shape
    dt = x.dtype
    a = attention_probs(params, x, num_heads)
    v = x @ jnp.asarray(params["value"], dt) + _bias(params, "value", d, dt)
    v = jnp.transpose(v.reshape(n, num_heads, -1), (1, 0, 2))  # (h, n, d_h)
    heads = jnp.transpose(a @ v, (1, 0, 2)).reshape(n, d)
    return heads @ jnp.asarray(params["out"], dt) + _bias(params, "out", d, dt)


def value_output_products(params: Params, num_heads: int) -> jax.Array:
    """Per-head Wⱽ_h Wᴼ_h, (h, d, d); their sum over heads is the layer's WⱽWᴼ."""
    w_v = _heads(jnp.asarray(params["value"]), num_heads)  # (h, d, d_h)
    w_o = jnp.asarray(params["out"]).reshape(num_heads, -1, params["out"].shape[1])  # (h, d_h, d)
    return w_v @ w_o


def to_float64(tree: Any) -> Any:
    """Every leaf as a float64 jax array; call inside `jax.enable_x64(True)`."""
    return jax.tree.map(lambda a: jnp.asarray(np.asarray(a, np.float64)), tree)


def jacobian_matrix(fn: Callable[[jax.Array], jax.Array], x: jax.Array) -> jax.Array:
    """∂fn(X)/∂X for fn: (n, d) -> (n', d') as an (n'd', nd) matrix (row-major vec)."""
    jac = jax.jacfwd(fn)(x)
    return jac.reshape(int(np.prod(jac.shape[: jac.ndim - x.ndim])), x.size)


# The float64 Jacobians below are one compiled program each per shape (not hundreds of eager
# ops, each compiled on its own): called inside `jax.enable_x64(True)`.
@functools.partial(jax.jit, static_argnums=2)
def _attention_jacobian(p: Params, x: jax.Array, num_heads: int) -> jax.Array:
    return jacobian_matrix(lambda y: self_attention(p, y, num_heads), x)


@functools.partial(jax.jit, static_argnums=2)
def _attention_kronecker(p: Params, x: jax.Array, num_heads: int) -> jax.Array:
    a = attention_probs(p, x, num_heads)
    m = value_output_products(p, num_heads)
    return sum(jnp.kron(a[h], m[h].T) for h in range(num_heads))


def attention_jacobian(params: Params, x: jax.Array, num_heads: int) -> np.ndarray:
    """K_ℓ = ∂SA(X)/∂X at X (n, d), in float64: (nd, nd) (docs/method/papers.md §2)."""
    with jax.enable_x64(True):
        return np.asarray(_attention_jacobian(to_float64(dict(params)), to_float64(x), num_heads))


def attention_kronecker(params: Params, x: jax.Array, num_heads: int) -> np.ndarray:
    """B_ℓ = Σ_h A_h ⊗ (Wⱽ_h Wᴼ_h)ᵀ at X, in float64: (nd, nd).

    The Jacobian of X ↦ Σ_h A_h X Wⱽ_h Wᴼ_h with A_h frozen. With one head this is the
    paper's B_ℓ = (WⱽWᴼ)ᵀ ⊗ A_ℓ written for row-major vec.
    """
    with jax.enable_x64(True):
        return np.asarray(_attention_kronecker(to_float64(dict(params)), to_float64(x), num_heads))


def matrix_log_kappa(m: Any, null_dim: int = 0) -> float:
    """log κ of one matrix in float64 numpy (for analysis, not for jit).

    `null_dim` > 0 drops that many smallest singular values first: κ on the complement of a
    known structural null space (see `block_null_dim`).
    """
    s = np.linalg.svd(np.asarray(m, np.float64), compute_uv=False)
    return float(np.log(s[0]) - np.log(s[len(s) - 1 - null_dim]))


def block_null_dim(n: int, skip_sab: bool) -> int:
    """Structural nullity of a block's Jacobian at its input: 2n without the attention skip.

    The block starts with LayerNorm, which per token ignores the all-ones direction (mean) and
    the token's own centred direction (scale), so ∂Block/∂X has rank ≤ n(d − 2) unless the
    identity of ② is added. Its κ is reported on the complement of that null space.
    """
    return 0 if skip_sab else 2 * n


def compare_attention_jacobian(params: Params, x: jax.Array, num_heads: int) -> dict[str, float]:
    """κ(K_ℓ) vs κ(B_ℓ) at X (n, d): log κ of both, of WⱽWᴼ, and ‖K − B‖_F / ‖K‖_F."""
    k = attention_jacobian(params, x, num_heads)
    b = attention_kronecker(params, x, num_heads)
    w_vo = np.asarray(params["value"], np.float64) @ np.asarray(params["out"], np.float64)
    return dict(
        log_kappa_K=matrix_log_kappa(k),
        log_kappa_B=matrix_log_kappa(b),
        log_kappa_WvWo=matrix_log_kappa(w_vo),
        rel_diff_K_B=float(np.linalg.norm(k - b) / np.linalg.norm(k)),
    )


def layer_norm(params: Params, x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """flax `nn.LayerNorm` (eps 1e-6) over the last axis with its `scale`/`bias` params."""
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / jnp.sqrt(var + eps) * params["scale"] + params["bias"]


def mlp(params: Params, x: jax.Array, gelu_approximate: bool = True) -> jax.Array:
    """Dense_0 – GELU – Dense_1 of an `MlpBlock` param dict.

    GELU in tanh form (flax's default), or exact erf with gelu_approximate=False.
    """
    h = jax.nn.gelu(x @ params["Dense_0"]["kernel"] + params["Dense_0"]["bias"], approximate=gelu_approximate)
    return h @ params["Dense_1"]["kernel"] + params["Dense_1"]["bias"]


def encoder_block(
    params: Params, x: jax.Array, num_heads: int, skip_sab: bool = False, skip_ffn: bool = False,
    gelu_approximate: bool = True,
) -> jax.Array:
    """One pre-LN block (docs/method/papers.md §1) for one image, (n, d) -> (n, d), from `EncoderBlock` params.

    The same computation as `models.vit.EncoderBlock` (tests hold them equal), written with
    `self_attention` so that it is float64 throughout: `jax.nn.dot_product_attention`, which
    the model uses, takes its softmax in float32 even for float64 inputs.
    """
    y = self_attention(params["MultiHeadAttention_0"], layer_norm(params["LayerNorm_0"], x), num_heads)
    x = x + y if skip_sab else y  # ②
    z = mlp(params["MlpBlock_0"], layer_norm(params["LayerNorm_1"], x), gelu_approximate)
    return x + z if skip_ffn else z  # ④


@functools.partial(jax.jit, static_argnums=(2, 3, 4, 5))
def _block_jacobian(p: Params, x: jax.Array, num_heads: int, skip_sab: bool, skip_ffn: bool,
                    gelu_approximate: bool) -> jax.Array:
    return jacobian_matrix(lambda y: encoder_block(p, y, num_heads, skip_sab, skip_ffn, gelu_approximate), x)


def block_jacobian(
    block_params: Params,
    x: jax.Array,
    *,
    num_heads: int,
    skip_sab: bool = False,
    skip_ffn: bool = False,
    gelu_approximate: bool = True,
) -> np.ndarray:
    """∂Block(X)/∂X of one block (skipless by default) at X (n, d), in float64: (nd, nd).

    Without the attention skip it has 2n structural zero singular values (`block_null_dim`).
    """
    with jax.enable_x64(True):
        return np.asarray(_block_jacobian(to_float64(dict(block_params)), to_float64(x), num_heads, skip_sab,
                                          skip_ffn, gelu_approximate))


def block_inputs(out: Mapping[str, Any]) -> list[jax.Array]:
    """The input x of each block, recovered as (①+②) − ① from the ViT's intermediates."""
    return [block["sab_skip"] - block["sab"] for block in out["blocks"]]


def jacobian_report(
    params: Params, out: Mapping[str, Any], *, num_heads: int, image: int = 0,
    layers: Sequence[int] | None = None, skip_sab: bool = False, skip_ffn: bool = False,
    gelu_approximate: bool = True,
) -> list[dict[str, float]]:
    """Per layer at one image: log κ(K_ℓ), log κ(B_ℓ), ‖K−B‖/‖K‖, log κ(WⱽWᴼ), log κ(block).

    `params` are the ViT params (blocks named `block_{l}`), `out` its intermediates on a batch
    (only the block inputs x_ℓ = (①+②) − ① are read). K_ℓ is taken at X = LN1(x_ℓ), the
    attention's own input; the
    block Jacobian (with the given skips) at x_ℓ, with its LayerNorm null space removed.
    """
    xs = block_inputs(out)
    layers = range(len(xs)) if layers is None else layers
    rows = []
    for layer in layers:
        bp = params[f"block_{layer}"]
        with jax.enable_x64(True):
            x = to_float64(xs[layer][image])
            x_attn = layer_norm(to_float64(dict(bp["LayerNorm_0"])), x)
            row = dict(layer=layer)
            row.update(compare_attention_jacobian(bp["MultiHeadAttention_0"], x_attn, num_heads))
            jac = block_jacobian(bp, x, num_heads=num_heads, skip_sab=skip_sab, skip_ffn=skip_ffn,
                                 gelu_approximate=gelu_approximate)
            row["log_kappa_block"] = matrix_log_kappa(jac, block_null_dim(x.shape[0], skip_sab))
        rows.append(row)
    return rows


# ------------------------------------------------------------------ Prop. 4.1


def matrix_with_log_kappa(key: jax.Array, n: int, d: int, log_kappa: float) -> np.ndarray:
    """A random (n, d) float64 matrix with singular values log-spaced from 1 to e^log_kappa."""
    k1, k2 = jax.random.split(key)
    u = np.linalg.qr(np.asarray(jax.random.normal(k1, (n, min(n, d))), np.float64))[0]
    v = np.linalg.qr(np.asarray(jax.random.normal(k2, (d, min(n, d))), np.float64))[0]
    s = np.exp(np.linspace(log_kappa, 0.0, min(n, d)))
    return (u * s) @ v.T


def linear_attention(x: Any, w_q: Any, w_k: Any, w_v: Any) -> np.ndarray:
    """X Wᵠ Wᴷᵀ Xᵀ X Wⱽ (Prop. 4.1 of "Always Skip Attention"): (n, d) -> (n, d), float64."""
    x, w_q, w_k, w_v = (np.asarray(a, np.float64) for a in (x, w_q, w_k, w_v))
    return x @ w_q @ w_k.T @ x.T @ x @ w_v


def cube_bound_check(x: Any, w_q: Any, w_k: Any, w_v: Any, w_up: Any, w_down: Any) -> dict[str, float]:
    """Prop. 4.1 numerically (all log κ, float64), for X (n, d) with n ≥ d and full-rank weights.

    attn  = log κ(X Wᵠ Wᴷᵀ Xᵀ X Wⱽ),  attn_bound = 3 log κ(X) + log κ(WᵠWᴷᵀ) + log κ(Wⱽ);
    ffn   = log κ(X W_up W_down),     ffn_bound  = log κ(X) + log κ(W_up W_down).
    Both bounds follow from σ_min(PQ) ≥ σ_min(P) σ_min(Q) for full-column-rank P.
    """
    x = np.asarray(x, np.float64)
    if x.shape[0] < x.shape[1]:
        raise ValueError(f"cube_bound_check needs n >= d (tall X), got X of shape {x.shape}")
    w_q, w_k, w_v, w_up, w_down = (np.asarray(a, np.float64) for a in (w_q, w_k, w_v, w_up, w_down))
    log_x = matrix_log_kappa(x)
    return dict(
        x=log_x,
        attn=matrix_log_kappa(linear_attention(x, w_q, w_k, w_v)),
        attn_bound=3 * log_x + matrix_log_kappa(w_q @ w_k.T) + matrix_log_kappa(w_v),
        ffn=matrix_log_kappa(x @ w_up @ w_down),
        ffn_bound=log_x + matrix_log_kappa(w_up @ w_down),
    )
