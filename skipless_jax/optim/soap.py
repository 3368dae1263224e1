"""SOAP: Adam in the eigenbasis of Shampoo's preconditioner, as optax transformations (METHOD.md §5).

Semantics are those of the reference implementation (Vyas et al., ICLR 2025, `main` branch):

    call 0:   GG_i = (1-β_s)·G_(i) G_(i)ᵀ;  Q_i = eigh(GG_i) (descending);  update = 0
    call t≥1: G' = G ×_i Q_iᵀ;  m ← b1 m + (1-b1) G';  v ← b2 v + (1-b2) G'²     (m, v in the eigenbasis)
              u = √(1-b2^t)/(1-b1^t) · (m / (√v + eps)) ×_i Q_i                   (emitted by scale_by_soap)
              p ← p - lr_t·u;  p ← p - lr_t·wd·p                                 (soap: lr and decoupled decay)
              GG_i ← β_s GG_i + (1-β_s) G_(i) G_(i)ᵀ                             (every call, raw gradient)
              if t % precondition_frequency == 0: sort by diag(Q_iᵀGG_iQ_i) descending, permute v along
              axis i, Q_i ← QR(GG_i Q_i[:, order]).Q, rotate m into the new basis.

`x ×_i A` applies the matrix A along axis i of x. G_(i) is the mode-i unfolding (axis i first).
Axes longer than `max_precond_dim` (and 1-D tensors unless `precondition_1d`) have no factor: Adam
along that axis. With `merge_dims`, consecutive axes are merged greedily (left to right) while their
product stays ≤ `max_precond_dim`; axes are taken in the parameter's order (Flax conv kernels are
(kh, kw, in, out), so the spatial and fan-in axes merge first).

Efficiency: the eigendecomposition (call 0) and the QR refresh run inside `lax.cond`s, so the
other steps do no factorization; factors of equal size and dtype are stacked and factorized by one
batched call. Factors, eigenbases and moments are kept in float32 at least (float64 stays float64).
All state leaves are ordinary arrays: moments have the parameter's shape, factors are (s_i, s_i),
so the trainer's sharding rules apply to them like to parameters.
"""

from __future__ import annotations

import string
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

Schedule = Callable[[jax.Array], jax.Array]
ScalarOrSchedule = float | jax.Array | Schedule

# Factor statistics and projections are sensitive to reduced-precision matmuls (TPU/GPU defaults).
_PRECISION = jax.lax.Precision.HIGHEST
_LETTERS = string.ascii_lowercase


class ScaleBySoapState(NamedTuple):
    """State of `scale_by_soap`.

    count: int32 scalar, number of calls so far (call 0 only initializes the preconditioner).
    mu, nu: first and second moments in the eigenbasis, each leaf shaped like its parameter.
    gg: per parameter a tuple of factors GG_i, (s_i, s_i), one per preconditioned (merged) axis.
    q: per parameter a tuple of eigenbases Q_i, (s_i, s_i), aligned with `gg`.
    """

    count: jax.Array
    mu: optax.Updates
    nu: optax.Updates
    gg: Any
    q: Any


class DecoupledDecayState(NamedTuple):
    """State of the decoupled weight decay: count of calls (the learning-rate schedule's step)."""

    count: jax.Array


# ---------------------------------------------------------------------------------------------
# Shapes: merging and which axes get a factor (static, from the parameter's shape).


def merged_shape(shape: tuple[int, ...], max_precond_dim: int) -> tuple[int, ...]:
    """Greedy left-to-right merge of axes while the product stays ≤ max_precond_dim (reference)."""
    new_shape: list[int] = []
    current = 1
    for size in shape:
        if current * size > max_precond_dim:
            if current > 1:
                new_shape.append(current)
                current = size
            else:
                new_shape.append(size)
                current = 1
        else:
            current *= size
    if current > 1 or not new_shape:
        new_shape.append(current)
    return tuple(new_shape)


def soap_layout(
    shape: tuple[int, ...], max_precond_dim: int, merge_dims: bool, precondition_1d: bool
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(work shape, axes of the work shape that carry a factor) for a parameter of `shape`.

    A 1-D parameter gets a factor only with `precondition_1d` (and size ≤ max_precond_dim); it is
    never merged. A scalar gets none. Otherwise every (merged) axis of size ≤ max_precond_dim gets one.
    """
    shape = tuple(int(s) for s in shape)
    if len(shape) == 0:
        return shape, ()
    if len(shape) == 1:
        has_factor = precondition_1d and shape[0] <= max_precond_dim
        return shape, ((0,) if has_factor else ())
    work = merged_shape(shape, max_precond_dim) if merge_dims else shape
    return work, tuple(i for i, s in enumerate(work) if s <= max_precond_dim)


def _state_dtype(dtype: Any) -> jnp.dtype:
    """Factors, eigenbases and moments: at least float32; float64 stays float64."""
    return jnp.promote_types(dtype, jnp.float32)


# ---------------------------------------------------------------------------------------------
# Per-tensor math.


def mode_product(x: jax.Array, mats: dict[int, jax.Array], transpose: bool) -> jax.Array:
    """Apply A (or Aᵀ if transpose) along each axis i in `mats`: y[..j..] = Σ_a A[j, a] x[..a..].

    x: any shape; mats[i]: (x.shape[i], x.shape[i]). project = mode_product(x, Q, transpose=True)
    gives x ×_i Q_iᵀ (G' = Q_Lᵀ G Q_R for 2-D); transpose=False projects back.
    """
    if not mats:
        return x
    letters = _LETTERS[: x.ndim]
    out = list(letters)
    operands, subs = [x], [letters]
    for axis, mat in mats.items():
        new = _LETTERS[x.ndim + len(operands) - 1]
        out[axis] = new
        subs.append(letters[axis] + new if transpose else new + letters[axis])
        operands.append(mat)
    spec = ",".join(subs) + "->" + "".join(out)
    return jnp.einsum(spec, *operands, precision=_PRECISION)


def mode_gram(x: jax.Array, axis: int) -> jax.Array:
    """G_(i) G_(i)ᵀ: contract every axis but `axis`. x: any shape -> (x.shape[axis],) * 2."""
    letters = _LETTERS[: x.ndim]
    other = letters.replace(letters[axis], "Z")
    spec = f"{letters},{other}->{letters[axis]}Z"
    return jnp.einsum(spec, x, x, precision=_PRECISION)


def _descending_eigenbasis(gg: jax.Array) -> jax.Array:
    """Eigenvectors of symmetric GG (s, s), columns by descending eigenvalue (call 0).

    eigh(-GG) lists them in that order directly; reversing a sharded axis would need a
    collective-permute inside the refresh branch.
    """
    _, vecs = jnp.linalg.eigh(-gg, symmetrize_input=True)
    return vecs


def _power_qr_refresh(gg: jax.Array, q: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One power-iteration step + QR: returns (new Q (s, s), sort order (s,)) — §5 refresh."""
    est = jnp.einsum("ij,ik,kj->j", q, gg, q, precision=_PRECISION)  # diag(Qᵀ GG Q)
    order = jnp.argsort(-est)  # descending without a reverse (see _descending_eigenbasis)
    q_new, _ = jnp.linalg.qr(jnp.matmul(gg, q[:, order], precision=_PRECISION))
    return q_new, order


def _keep_if_finite(new: jax.Array, old: jax.Array) -> jax.Array:
    """A failed factorization (non-finite output) keeps the previous basis instead of poisoning m, v."""
    return jnp.where(jnp.all(jnp.isfinite(new)), new, old)


def _map_stack(fn: Callable, *stack: jax.Array) -> Any:
    """fn over the leading (factor) axis: one batched call on accelerators, a loop on CPU.

    jaxlib's batched CPU LAPACK kernels fan the batch out to the intra-op thread pool and block on
    it; with several host devices blocked the same way they deadlock. A scan keeps batch 1 and
    still compiles fn once.
    """
    return jax.lax.platform_dependent(
        *stack,
        cpu=lambda *s: jax.lax.map(lambda xs: fn(*xs), s),
        default=jax.vmap(fn),
    )


def _batched(fn: Callable, *stacks: dict) -> dict:
    """Run `fn` once per group of equally shaped factors, over the group's stack."""
    return {key: _map_stack(fn, *[s[key] for s in stacks]) for key in stacks[0]}


def _group_factors(factor_lists: list[tuple[jax.Array, ...]]) -> dict:
    """Map (size, dtype) -> list of (leaf index, factor index) for batching same-shape factors."""
    groups: dict = {}
    for leaf, factors in enumerate(factor_lists):
        for k, f in enumerate(factors):
            groups.setdefault((f.shape[0], jnp.dtype(f.dtype).name), []).append((leaf, k))
    return groups


def _stack(groups: dict, factor_lists: list[tuple[jax.Array, ...]]) -> dict:
    return {key: jnp.stack([factor_lists[l][k] for l, k in idx]) for key, idx in groups.items()}


def _unstack(groups: dict, stacked: dict, like: list[tuple[jax.Array, ...]]) -> list[list]:
    out = [list(factors) for factors in like]
    for key, idx in groups.items():
        for j, (l, k) in enumerate(idx):
            out[l][k] = stacked[key][j]
    return out


# ---------------------------------------------------------------------------------------------
# Validation.


def _check_unit_interval(name: str, value: float) -> None:
    if not isinstance(value, (int, float)) or not 0.0 <= float(value) < 1.0:
        raise ValueError(f"SOAP {name} must be a float in [0, 1), got {value!r}")


def _check_positive_int(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"SOAP {name} must be an integer >= 1, got {value!r}")


def validate_soap_hparams(
    b1: float = 0.95,
    b2: float = 0.95,
    shampoo_beta: float | None = None,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    precondition_frequency: int = 10,
    max_precond_dim: int = 10000,
) -> None:
    """One-line ValueError for the first bad SOAP hyperparameter (called at construction)."""
    _check_unit_interval("b1", b1)
    _check_unit_interval("b2", b2)
    if shampoo_beta is not None:
        _check_unit_interval("shampoo_beta", shampoo_beta)
    if not isinstance(eps, (int, float)) or eps < 0:
        raise ValueError(f"SOAP eps must be a float >= 0, got {eps!r}")
    if not isinstance(weight_decay, (int, float)) or weight_decay < 0:
        raise ValueError(f"SOAP weight_decay must be a float >= 0, got {weight_decay!r}")
    _check_positive_int("precondition_frequency", precondition_frequency)
    _check_positive_int("max_precond_dim", max_precond_dim)


def _check_mask_type(mask: Any) -> None:
    if mask is None or callable(mask):
        return
    leaves = jax.tree.leaves(mask)
    if not leaves or not all(isinstance(x, (bool, np.bool_)) for x in leaves):
        raise ValueError(
            "SOAP weight_decay_mask must be None, a callable params -> bool pytree, or a pytree of "
            f"Python bools; got leaves {[type(x).__name__ for x in leaves[:3]]}"
        )


def _resolve_mask(mask: Any, params: optax.Params) -> Any:
    """Mask pytree of bools for `params`; one-line ValueError when its structure differs."""
    resolved = mask(params) if callable(mask) else mask
    want, got = jax.tree.structure(params), jax.tree.structure(resolved)
    if want != got:
        raise ValueError(
            f"SOAP weight_decay_mask does not match the parameters: {got.num_leaves} mask leaves "
            f"vs {want.num_leaves} parameter leaves with a different tree structure"
        )
    return resolved


def default_weight_decay_mask(params: optax.Params) -> Any:
    """Decay weights with ≥ 2 dims (kernels, embeddings); not biases, LayerNorm scales, scalars."""
    return jax.tree.map(lambda p: jnp.ndim(p) >= 2, params)


# ---------------------------------------------------------------------------------------------
# Transformations.


def scale_by_soap(
    b1: float = 0.95,
    b2: float = 0.95,
    shampoo_beta: float | None = None,
    eps: float = 1e-8,
    precondition_frequency: int = 10,
    max_precond_dim: int = 10000,
    merge_dims: bool = False,
    precondition_1d: bool = False,
    normalize_grads: bool = False,
    correct_bias: bool = True,
) -> optax.GradientTransformation:
    """SOAP direction √(1-b2^t)/(1-b1^t)·project_back(m/(√v+eps)) (METHOD.md §5), no lr, no decay.

    The first call returns zeros and only builds the preconditioner. Follow with
    `optax.scale_by_learning_rate` (see `soap`). shampoo_beta=None means shampoo_beta = b2.
    """
    validate_soap_hparams(b1, b2, shampoo_beta, eps, 0.0, precondition_frequency, max_precond_dim)
    beta_s = b2 if shampoo_beta is None else shampoo_beta

    def layout(p: jax.Array) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return soap_layout(jnp.shape(p), max_precond_dim, merge_dims, precondition_1d)

    def init_fn(params: optax.Params) -> ScaleBySoapState:
        def factors(p: jax.Array, fill: Callable) -> tuple[jax.Array, ...]:
            work, axes = layout(p)
            dtype = _state_dtype(p.dtype)
            return tuple(fill(work[a], dtype) for a in axes)

        zeros = lambda p: jnp.zeros(jnp.shape(p), _state_dtype(p.dtype))
        return ScaleBySoapState(
            count=jnp.zeros([], jnp.int32),
            mu=jax.tree.map(zeros, params),
            nu=jax.tree.map(zeros, params),
            gg=jax.tree.map(lambda p: factors(p, lambda s, d: jnp.zeros((s, s), d)), params),
            q=jax.tree.map(lambda p: factors(p, lambda s, d: jnp.eye(s, dtype=d)), params),
        )

    def update_fn(
        updates: optax.Updates, state: ScaleBySoapState, params: optax.Params | None = None
    ) -> tuple[optax.Updates, ScaleBySoapState]:
        del params
        grads, treedef = jax.tree.flatten(updates)
        mus, nus = treedef.flatten_up_to(state.mu), treedef.flatten_up_to(state.nu)
        ggs, qs = treedef.flatten_up_to(state.gg), treedef.flatten_up_to(state.q)
        count = state.count
        first = count == 0

        new_updates, new_mu, new_nu, new_gg = [], [], [], []
        for g, mu, nu, gg, q in zip(grads, mus, nus, ggs, qs):
            work, axes = layout(g)
            dtype = _state_dtype(g.dtype)
            g32 = g.astype(dtype).reshape(work)
            basis = dict(zip(axes, q))
            g_proj = mode_product(g32, basis, transpose=True)
            mu_w = b1 * mu.reshape(work) + (1 - b1) * g_proj
            nu_w = b2 * nu.reshape(work) + (1 - b2) * jnp.square(g_proj)
            direction = mode_product(mu_w / (jnp.sqrt(nu_w) + eps), basis, transpose=False)
            if normalize_grads:
                direction = direction / (1e-30 + jnp.sqrt(jnp.mean(jnp.square(direction))))
            if correct_bias:
                t = count.astype(dtype)
                direction = direction * (jnp.sqrt(1 - b2**t) / (1 - b1**t))
            # Call 0 only builds the preconditioner: zero update, moments untouched (still zero).
            new_updates.append(jnp.where(first, 0, direction).reshape(g.shape).astype(g.dtype))
            new_mu.append(jnp.where(first, mu.reshape(work), mu_w))
            new_nu.append(jnp.where(first, nu.reshape(work), nu_w))
            new_gg.append(
                tuple(beta_s * f + (1 - beta_s) * mode_gram(g32, a) for a, f in zip(axes, gg))
            )

        q_list = [tuple(x) for x in qs]
        axes_list = [layout(g)[1] for g in grads]
        groups = _group_factors(new_gg)

        def keep(gg_l, q_l, mu_l, nu_l):
            return q_l, mu_l, nu_l

        def eigh_init(gg_l, q_l, mu_l, nu_l):
            stacked = _batched(_descending_eigenbasis, _stack(groups, gg_l))
            new_q = _unstack(groups, stacked, q_l)
            eye = [[jnp.eye(f.shape[0], dtype=f.dtype) for f in fs] for fs in q_l]
            new_q = [
                tuple(_keep_if_finite(n, e) for n, e in zip(ns, es)) for ns, es in zip(new_q, eye)
            ]
            return new_q, mu_l, nu_l

        def qr_refresh(gg_l, q_l, mu_l, nu_l):
            out = _batched(_power_qr_refresh, _stack(groups, gg_l), _stack(groups, q_l))
            q_new = _unstack(groups, {k: v[0] for k, v in out.items()}, q_l)
            orders = _unstack(groups, {k: v[1] for k, v in out.items()}, q_l)
            q_res, mu_res, nu_res = [], [], []
            for (work_axes, q_old, q_n, order, mu_w, nu_w) in zip(
                axes_list, q_l, q_new, orders, mu_l, nu_l
            ):
                q_n = [_keep_if_finite(n, o) for n, o in zip(q_n, q_old)]
                rot = {
                    a: jnp.matmul(n.T, o, precision=_PRECISION)
                    for a, n, o in zip(work_axes, q_n, q_old)
                }
                mu_res.append(mode_product(mu_w, rot, transpose=False))  # m into the new basis
                for a, idx in zip(work_axes, order):
                    nu_w = jnp.take(nu_w, idx, axis=a)  # v follows the eigenvector sort
                nu_res.append(nu_w)
                q_res.append(tuple(q_n))
            return q_res, mu_res, nu_res

        refresh = count % precondition_frequency == 0

        def refresh_or_keep(*args):
            return jax.lax.cond(refresh, qr_refresh, keep, *args)

        operands = (new_gg, q_list, new_mu, new_nu)
        if groups:
            q_out, mu_out, nu_out = jax.lax.cond(first, eigh_init, refresh_or_keep, *operands)
        else:
            q_out, mu_out, nu_out = q_list, new_mu, new_nu

        new_state = ScaleBySoapState(
            count=optax.safe_increment(count),
            mu=treedef.unflatten([m.reshape(g.shape) for m, g in zip(mu_out, grads)]),
            nu=treedef.unflatten([n.reshape(g.shape) for n, g in zip(nu_out, grads)]),
            gg=treedef.unflatten([tuple(x) for x in new_gg]),
            q=treedef.unflatten([tuple(x) for x in q_out]),
        )
        return treedef.unflatten(new_updates), new_state

    return optax.GradientTransformation(init_fn, update_fn)


def add_decayed_weights_after_step(
    weight_decay: float, learning_rate: ScalarOrSchedule, mask: Any = None
) -> optax.GradientTransformation:
    """Decoupled decay of the *updated* parameter: u ← u - lr_t·wd·(p + u), so p + u = (p + u₀)(1 - lr_t·wd).

    Place after the learning-rate scaling. lr_t is the schedule at this call's count (as in
    `optax.scale_by_learning_rate`); call 0 (SOAP's zero step) applies no decay. `mask`: None
    (all leaves), a bool pytree matching the parameters, or a callable params -> bool pytree.
    """
    _check_mask_type(mask)

    def init_fn(params: optax.Params) -> DecoupledDecayState:
        if mask is not None:
            _resolve_mask(mask, params)
        return DecoupledDecayState(count=jnp.zeros([], jnp.int32))

    def update_fn(
        updates: optax.Updates, state: DecoupledDecayState, params: optax.Params | None = None
    ) -> tuple[optax.Updates, DecoupledDecayState]:
        if params is None:
            raise ValueError("SOAP weight decay needs params: call update(grads, state, params)")
        lr = learning_rate(state.count) if callable(learning_rate) else learning_rate
        active = state.count > 0
        masks = _resolve_mask(mask, params) if mask is not None else jax.tree.map(lambda _: True, params)

        def decay(u: jax.Array, p: jax.Array, on: bool) -> jax.Array:
            if not on:
                return u
            shrink = jnp.where(active, lr * weight_decay, 0.0)
            return (u - shrink * (p + u)).astype(u.dtype)

        new = jax.tree.map(decay, updates, params, masks)
        return new, DecoupledDecayState(count=optax.safe_increment(state.count))

    return optax.GradientTransformation(init_fn, update_fn)


def soap(
    learning_rate: ScalarOrSchedule,
    b1: float = 0.95,
    b2: float = 0.95,
    shampoo_beta: float | None = None,
    eps: float = 1e-8,
    weight_decay: float = 0.01,
    precondition_frequency: int = 10,
    max_precond_dim: int = 10000,
    merge_dims: bool = False,
    precondition_1d: bool = False,
    normalize_grads: bool = False,
    correct_bias: bool = True,
    weight_decay_mask: Any = None,
) -> optax.GradientTransformation:
    """SOAP with learning rate (float or schedule) and decoupled weight decay (METHOD.md §5).

    Chain: scale_by_soap → scale by -lr_t → u ← u - lr_t·wd·(p + u), reproducing the reference's
    `p ← p - lr·bc·dir; p ← p - lr·wd·p` exactly. weight_decay_mask=None decays ≥2-D parameters.
    Defaults are the reference's (the paper's Cutting-the-Skip runs use b1=0.9, b2=0.95, freq 10).
    """
    validate_soap_hparams(
        b1, b2, shampoo_beta, eps, weight_decay, precondition_frequency, max_precond_dim
    )
    _check_mask_type(weight_decay_mask)
    parts = [
        scale_by_soap(
            b1=b1,
            b2=b2,
            shampoo_beta=shampoo_beta,
            eps=eps,
            precondition_frequency=precondition_frequency,
            max_precond_dim=max_precond_dim,
            merge_dims=merge_dims,
            precondition_1d=precondition_1d,
            normalize_grads=normalize_grads,
            correct_bias=correct_bias,
        ),
        optax.scale_by_learning_rate(learning_rate),
    ]
    if weight_decay > 0:
        mask = default_weight_decay_mask if weight_decay_mask is None else weight_decay_mask
        parts.append(add_decayed_weights_after_step(weight_decay, learning_rate, mask))
    return optax.chain(*parts)
