"""Eigenvalue-corrected Shampoo as optax transformations: Meta's `DistributedShampoo` with
`DefaultEigenvalueCorrectedShampooConfig`, as the authors' MAE fork calls it (docs/method/shampoo_ec.md).

Per block G of a parameter (§1: merge small dims from the last axis, split dims above
`max_preconditioner_dim`), at step t = 1, 2, ...:

    L_k ← β2 L_k + (1-β2) G_(k) G_(k)ᵀ                                  (every step, raw gradient)
    if refresh(t): Q_k ← eigh(L_k) (ascending)                          (V kept as it is)
    V ← β2 V + (1-β2) (G ×_k Q_kᵀ)²                                     (new bases)
    M ← β1 M + (1-β1) G;  M̂ = M / (1-β1^t)                              (parameter basis)
    D = ((M̂ ×_k Q_kᵀ) / √(V/(1-β2^t) + ε)) ×_k Q_k
    W ← W - η_t (D + λ W)                                               (`shampoo_ec`)

refresh(t) = (t % f == 0 and t > s) or t == s, s = `start_preconditioning_step` (-1: s = f); Q_k is
the identity before the first refresh, so steps 1..s-1 are Adam with ε inside the root (§3-§4).

The eigendecompositions run inside one `lax.cond` on refresh steps and are divided over the data
devices like SOAP's (`soap.per_factor`). State leaves are plain arrays: M and V have the
parameter's shape, every factor and basis is (s, s) ((L, s, s) for a `stacked` leaf of L layers),
so the trainer's sharding rules apply to them like to the parameters.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from skipless_jax.checks import is_int, is_number
from skipless_jax.optim.soap import (
    ScalarOrSchedule,
    check_mask_type,
    check_positive_int,
    check_unit_interval,
    default_weight_decay_mask,
    mode_gram,
    mode_product,
    per_factor,
    resolve_mask,
    state_dtype,
)

_WHO = "shampoo_ec"


class ScaleByShampooECState(NamedTuple):
    """State of `scale_by_shampoo_ec`.

    count: int32 scalar, calls so far (the reference's step is count + 1).
    mu: first moment M, parameter basis, each leaf shaped like its parameter.
    nu: corrected eigenvalues V of every block, stored in the parameter's shape.
    factors: per parameter a tuple of factors L_k, (s, s), block-major (block 0's dims, block 1's, ...).
    bases: per parameter a tuple of eigenbases Q_k (columns are eigenvectors), aligned with `factors`.
    """

    count: jax.Array
    mu: optax.Updates
    nu: optax.Updates
    factors: Any
    bases: Any


# ---------------------------------------------------------------------------------------------
# Blocks (static, from the parameter's shape): docs/method/shampoo_ec.md §1.


def torch_axes(ndim: int) -> tuple[int, ...]:
    """The permutation taking a Flax parameter to torch's layout: a conv kernel (kh, kw, in, out) ->
    (out, in, kh, kw); any other rank reversed (a Dense kernel (in, out) -> (out, in))."""
    return (3, 2, 0, 1) if ndim == 4 else tuple(reversed(range(ndim)))


def merge_small_dims(shape: tuple[int, ...], max_dim: int) -> tuple[int, ...]:
    """The reference's `merge_small_dims` (torch layout): size-1 dims dropped (all ones or a scalar:
    (1,)); left to right, a dim is multiplied into the last merged one while the product stays ≤ max_dim."""
    dims = [int(s) for s in shape if s != 1] or [1]
    merged = [dims[0]]
    for s in dims[1:]:
        if merged[-1] * s <= max_dim:
            merged[-1] *= s
        else:
            merged.append(s)
    return tuple(merged)


class Layout(NamedTuple):
    """How one layer of a parameter becomes the reference's merged tensor (§1).

    perm: None when no two non-unit dims merge: the work tensor is the parameter with its size-1
    dims dropped, in its own axis order (the update is equivariant under axis permutations);
    else the permutation to torch's layout, applied before merging (the order of elements inside
    a merged dim matters: V is read by position after a refresh). work: the merged shape.
    blocks: `multi_dim_split`, one tuple of slices of `work` per block.
    """

    perm: tuple[int, ...] | None
    work: tuple[int, ...]
    blocks: tuple[tuple[slice, ...], ...]


def block_layout(shape: tuple[int, ...], max_dim: int) -> Layout:
    """The `Layout` of a parameter (one layer) of `shape`: torch's layout, merged, then every merged
    dim cut into chunks of max_dim (the last shorter)."""
    perm = torch_axes(len(shape))
    merged = merge_small_dims(tuple(shape[a] for a in perm), max_dim)
    unit_free = tuple(int(s) for s in shape if s != 1) or (1,)
    if len(merged) == len(unit_free):  # nothing merged: keep the parameter's order
        perm, merged = None, unit_free
    chunks = [[slice(a, min(a + max_dim, s)) for a in range(0, s, max_dim)] for s in merged]
    return Layout(perm, merged, tuple(itertools.product(*chunks)))


def to_work(x: jax.Array, layout: Layout) -> jax.Array:
    """One layer of a parameter-shaped array -> the merged work tensor."""
    return (x if layout.perm is None else jnp.transpose(x, layout.perm)).reshape(layout.work)


def from_work(y: jax.Array, layout: Layout, shape: tuple[int, ...]) -> jax.Array:
    """Inverse of `to_work` for a parameter (one layer) of `shape`."""
    if layout.perm is None:
        return y.reshape(shape)
    torch_shape = tuple(shape[a] for a in layout.perm)
    return jnp.transpose(y.reshape(torch_shape), tuple(int(a) for a in np.argsort(layout.perm)))


def _block_dims(work: tuple[int, ...], block: tuple[slice, ...]) -> tuple[int, ...]:
    return tuple(len(range(*b.indices(s))) for b, s in zip(block, work))


# ---------------------------------------------------------------------------------------------
# Per tensor (one layer of a parameter, in its merged shape).


class _Hyper(NamedTuple):
    b1: float
    b2: float
    eps: float


def update_factors(g: jax.Array, factors: tuple[jax.Array, ...], blocks: tuple, b2: float) -> tuple[jax.Array, ...]:
    """§3.1: L_k ← β2 L_k + (1-β2) G_(k) G_(k)ᵀ for every block G of g and every dim k (block-major)."""
    out, it = [], iter(factors)
    for block in blocks:
        gb = g[block]
        out.extend(b2 * next(it) + (1 - b2) * mode_gram(gb, k) for k in range(gb.ndim))
    return tuple(out)


def precondition(
    g: jax.Array, m_hat: jax.Array, v: jax.Array, bases: tuple[jax.Array, ...], blocks: tuple,
    t: jax.Array, hp: _Hyper,
) -> tuple[jax.Array, jax.Array]:
    """§3.3 and §3.5 for every block: (direction D, new V), each in the merged shape of g.

    V ← β2 V + (1-β2)(G ×_k Q_kᵀ)²; D = ((M̂ ×_k Q_kᵀ) / √(V/(1-β2^t) + ε)) ×_k Q_k.
    """
    bc2 = 1 - hp.b2 ** t.astype(g.dtype)
    d_blocks, v_blocks, it = [], [], iter(bases)
    for block in blocks:
        bases_k = [next(it) for _ in range(g.ndim)]
        # G and M̂ into the eigenbasis by one contraction per dim (stacked on a leading axis).
        g_proj, m_proj = mode_product(jnp.stack([g[block], m_hat[block]]), dict(enumerate(bases_k, start=1)),
                                      transpose=True)
        vb = hp.b2 * v[block] + (1 - hp.b2) * jnp.square(g_proj)
        scaled = m_proj / jnp.sqrt(vb / bc2 + hp.eps)
        d_blocks.append(mode_product(scaled, dict(enumerate(bases_k)), transpose=False))
        v_blocks.append(vb)
    if len(blocks) == 1:
        return d_blocks[0], v_blocks[0]
    d, v_new = jnp.zeros_like(g), v
    for block, db, vb in zip(blocks, d_blocks, v_blocks):
        d, v_new = d.at[block].set(db), v_new.at[block].set(vb)
    return d, v_new


def _ascending_eigenbasis(factor: jax.Array) -> jax.Array:
    """Eigenvectors of a symmetric factor (s, s), columns by ascending eigenvalue (torch.linalg.eigh's order)."""
    return jnp.linalg.eigh(factor, symmetrize_input=False)[1]


def refresh_step(count: jax.Array, precondition_frequency: int, start: int) -> jax.Array:
    """§4: whether call `count` (step t = count + 1) recomputes the bases; start -1 means f."""
    t = count + 1
    s = precondition_frequency if start == -1 else start
    return ((t % precondition_frequency == 0) & (t > s)) | (t == s)


# ---------------------------------------------------------------------------------------------
# Validation.


def validate_shampoo_ec_hparams(
    b1: float = 0.9, b2: float = 0.95, eps: float = 1e-8, weight_decay: float = 0.0, precondition_frequency: int = 100,
    max_preconditioner_dim: int = 8192, start_preconditioning_step: int = -1,
) -> None:
    """One-line ValueError for the first bad hyperparameter (the reference's checks, in its words)."""
    check_unit_interval("b1", b1, _WHO)
    check_unit_interval("b2", b2, _WHO)
    if not is_number(eps) or not eps > 0:
        raise ValueError(f"{_WHO} eps must be a float > 0, got {eps!r}")
    if not is_number(weight_decay) or not weight_decay >= 0:
        raise ValueError(f"{_WHO} weight_decay must be a float >= 0, got {weight_decay!r}")
    check_positive_int("precondition_frequency", precondition_frequency, _WHO)
    check_positive_int("max_preconditioner_dim", max_preconditioner_dim, _WHO)
    start = start_preconditioning_step
    if not is_int(start) or not (start == -1 or start >= precondition_frequency):
        raise ValueError(
            f"{_WHO} start_preconditioning_step must be -1 (= precondition_frequency) or an integer "
            f">= precondition_frequency={precondition_frequency!r}, got {start!r}"
        )


# ---------------------------------------------------------------------------------------------
# Transformations.


def _layers_split(factors: list[tuple[jax.Array, ...]], layers: list[int | None]) -> list[jax.Array]:
    """Every (s, s) matrix of every leaf, a stacked leaf's (L, s, s) cut into its L layers."""
    return [f[j] if n else f for fs, n in zip(factors, layers) for f in fs for j in range(n or 1)]


def _layers_join(flat: list[jax.Array], like: list[tuple[jax.Array, ...]], layers: list[int | None]) -> list[tuple]:
    """Inverse of `_layers_split`: per leaf, its tuple of (s, s) or (L, s, s) matrices."""
    out, it = [], iter(flat)
    for fs, n in zip(like, layers):
        out.append(tuple(jnp.stack([next(it) for _ in range(n)]) if n else next(it) for _ in fs))
    return out


def scale_by_shampoo_ec(
    b1: float = 0.9, b2: float = 0.95, eps: float = 1e-8, precondition_frequency: int = 100,
    max_preconditioner_dim: int = 8192, start_preconditioning_step: int = -1, stacked: Any = None,
) -> optax.GradientTransformation:
    """The direction D of docs/method/shampoo_ec.md §3.5 (no lr, no decay).

    stacked: None, a bool pytree like the parameters or a callable params -> one: leaves whose
    leading axis stacks L independent layers (a scanned encoder), each its own tensor.
    """
    validate_shampoo_ec_hparams(b1, b2, eps, 0.0, precondition_frequency, max_preconditioner_dim,
                                start_preconditioning_step)
    check_mask_type(stacked, "stacked", _WHO)
    hp = _Hyper(b1, b2, eps)

    def flags_of(tree: Any) -> Any:
        if stacked is None:
            return jax.tree.map(lambda _: False, tree)
        return resolve_mask(stacked, tree, "stacked", _WHO)

    def layout(p: jax.Array, is_stacked: bool) -> Layout:
        return block_layout(jnp.shape(p)[1:] if is_stacked else jnp.shape(p), max_preconditioner_dim)

    def init_fn(params: optax.Params) -> ScaleByShampooECState:
        def matrices(p: jax.Array, is_stacked: bool, fill: Callable) -> tuple[jax.Array, ...]:
            _, work, blocks = layout(p, is_stacked)
            lead = (p.shape[0],) if is_stacked else ()
            dims = [s for b in blocks for s in _block_dims(work, b)]
            return tuple(jnp.broadcast_to(fill(s, state_dtype(p.dtype)), lead + (s, s)) for s in dims)

        zeros = lambda p: jnp.zeros(jnp.shape(p), state_dtype(p.dtype))
        flags = flags_of(params)
        return ScaleByShampooECState(
            count=jnp.zeros([], jnp.int32),
            mu=jax.tree.map(zeros, params),
            nu=jax.tree.map(zeros, params),
            factors=jax.tree.map(lambda p, f: matrices(p, f, lambda s, d: jnp.zeros((s, s), d)), params, flags),
            bases=jax.tree.map(lambda p, f: matrices(p, f, lambda s, d: jnp.eye(s, dtype=d)), params, flags),
        )

    def update_fn(
        updates: optax.Updates, state: ScaleByShampooECState, params: optax.Params | None = None
    ) -> tuple[optax.Updates, ScaleByShampooECState]:
        del params
        grads, treedef = jax.tree.flatten(updates)
        mus, nus = treedef.flatten_up_to(state.mu), treedef.flatten_up_to(state.nu)
        factors, bases = treedef.flatten_up_to(state.factors), treedef.flatten_up_to(state.bases)
        flags = treedef.flatten_up_to(flags_of(updates))
        layouts = [layout(g, f) for g, f in zip(grads, flags)]
        layers = [g.shape[0] if f else None for g, f in zip(grads, flags)]
        t = state.count + 1

        def per_layer(fn: Callable, i: int) -> Callable:
            return jax.vmap(fn) if layers[i] else fn

        def work(x: jax.Array, i: int) -> jax.Array:
            return per_layer(lambda y: to_work(y, layouts[i]), i)(x)

        gs = [work(g.astype(state_dtype(g.dtype)), i) for i, g in enumerate(grads)]
        new_factors = [
            per_layer(lambda g, f, blocks=layout.blocks: update_factors(g, f, blocks, b2), i)(gs[i], tuple(factors[i]))
            for i, layout in enumerate(layouts)
        ]
        # §3.2: eigh of every factor on refresh steps only; V is left as it is.
        flat = jax.lax.cond(
            refresh_step(state.count, precondition_frequency, start_preconditioning_step),
            lambda ops: per_factor(_ascending_eigenbasis, ops[0]),
            lambda ops: ops[1],
            (_layers_split(new_factors, layers), _layers_split([tuple(q) for q in bases], layers)),
        )
        new_bases = _layers_join(flat, new_factors, layers)

        directions, new_mu, new_nu = [], [], []
        for i, (g, mu, nu) in enumerate(zip(gs, mus, nus)):
            mu = b1 * mu + (1 - b1) * grads[i].astype(mu.dtype)  # §3.4
            m_hat = mu / (1 - b1 ** t.astype(mu.dtype))
            shape = grads[i].shape[1:] if layers[i] else grads[i].shape

            def step(g, m, v, q, layout=layouts[i], shape=shape):
                d, v = precondition(g, m, v, q, layout.blocks, t, hp)
                return from_work(d, layout, shape), from_work(v, layout, shape)

            d, v = per_layer(step, i)(g, work(m_hat, i), work(nu, i), new_bases[i])
            directions.append(d.astype(grads[i].dtype))
            new_mu.append(mu)
            new_nu.append(v)

        new_state = ScaleByShampooECState(
            count=optax.safe_increment(state.count),
            mu=treedef.unflatten(new_mu),
            nu=treedef.unflatten(new_nu),
            factors=treedef.unflatten(new_factors),
            bases=treedef.unflatten(new_bases),
        )
        return treedef.unflatten(directions), new_state

    return optax.GradientTransformation(init_fn, update_fn)


def shampoo_ec(
    learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.95, eps: float = 1e-8, weight_decay: float = 0.0,
    precondition_frequency: int = 100, max_preconditioner_dim: int = 8192, start_preconditioning_step: int = -1,
    weight_decay_mask: Any = None, stacked: Any = None,
) -> optax.GradientTransformation:
    """Eigenvalue-corrected Shampoo with lr (float or schedule) and decoupled weight decay:
    u = -η_t (D + λ·mask·W), W the parameter before the step (docs/method/shampoo_ec.md §3.6-3.8).

    Defaults are the fork's call (betas 0.9/0.95, ε 1e-8, eigh every 100 steps from step 100,
    max_preconditioner_dim 8192). weight_decay_mask=None decays the leaves with ≥ 2 dims (timm's
    `param_groups_weight_decay`); stacked: see `scale_by_shampoo_ec`.
    """
    validate_shampoo_ec_hparams(b1, b2, eps, weight_decay, precondition_frequency, max_preconditioner_dim,
                                start_preconditioning_step)
    check_mask_type(weight_decay_mask, who=_WHO)
    parts = [scale_by_shampoo_ec(b1, b2, eps, precondition_frequency, max_preconditioner_dim,
                                 start_preconditioning_step, stacked)]
    if weight_decay > 0:
        mask = default_weight_decay_mask if weight_decay_mask is None else weight_decay_mask
        parts.append(optax.add_decayed_weights(weight_decay, mask))
    parts.append(optax.scale_by_learning_rate(learning_rate))
    return optax.chain(*parts)
