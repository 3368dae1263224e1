"""SOAP: Adam in the eigenbasis of Shampoo's preconditioner, as optax transformations (docs/method/papers.md §5).

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
other steps do no factorization; on one device the arrays cross the conds flattened (`cond_1d`),
so the steps that keep the bases transpose nothing. Under a mesh with D > 1 data devices the factorizations are
divided over the devices (each factorizes 1/D of the factors of each shape, `per_factor`);
on one device, factors of equal size and dtype are factorized by one batched call on
accelerators and one call per factor on CPU (it compiles faster there). Factors,
eigenbases and moments are kept in float32 at least (float64 stays float64).
All state leaves are ordinary arrays: moments have the parameter's shape, factors are (s_i, s_i)
((L, s_i, s_i) for a `stacked` leaf of L layers), so the trainer's sharding rules apply to them
like to parameters.
"""

from __future__ import annotations

import functools
import string
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from skipless_jax.checks import is_number, is_positive_int

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
    q: per parameter a tuple of eigenbases Q_i (columns are eigenvectors), (s_i, s_i), aligned
        with `gg`.
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


def state_dtype(dtype: Any) -> jnp.dtype:
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

    eigh(-GG) lists them in that order directly; reversing a sharded axis would need a collective.
    """
    _, vecs = jnp.linalg.eigh(-gg, symmetrize_input=False)  # GG is symmetric by construction
    return vecs


def power_qr_refresh(
    ggs: list[jax.Array], qs: list[jax.Array]
) -> tuple[list[jax.Array], list[jax.Array]]:
    """§5 refresh of every factor: order = argsort of diag(Qᵀ GG Q) descending,
    Q ← QR(GG Q[:, order]).Q. Returns (new bases, orders). With P = GG Q, computed once:
    diag(Qᵀ GG Q) = Σ_rows Q ⊙ P and GG Q[:, order] = P[:, order].
    """
    powers = [jnp.matmul(gg, q, precision=_PRECISION) for gg, q in zip(ggs, qs)]
    # top_k over all s entries: indices by descending value, no negation or reverse needed.
    orders = [jax.lax.top_k(jnp.sum(q * p, axis=0), q.shape[0])[1] for q, p in zip(qs, powers)]
    q_new = per_factor(lambda p, o: jnp.linalg.qr(p[:, o])[0], powers, orders)
    return q_new, orders


def _groups(items: list[jax.Array]) -> list[list[int]]:
    """Indices of `items` grouped by (shape, dtype), in first-seen order."""
    groups: dict[tuple, list[int]] = {}
    for i, x in enumerate(items):
        groups.setdefault((x.shape, jnp.dtype(x.dtype).name), []).append(i)
    return list(groups.values())


def _stacked_map(fn: Callable, stacks: tuple[jax.Array, ...]) -> Any:
    """fn over the leading axis of `stacks`: a loop on CPU (one matrix per LAPACK call: jaxlib's
    batched kernels block on the intra-op pool and deadlock with several host devices, and a loop
    compiles faster there), one vmapped call elsewhere."""

    def loop(*xs):
        outs = [fn(*(x[j] for x in xs)) for j in range(xs[0].shape[0])]
        return jax.tree.map(lambda *r: jnp.stack(r), *outs)

    return jax.lax.platform_dependent(*stacks, cpu=loop, default=lambda *xs: jax.vmap(fn)(*xs))


def _data_axes() -> tuple[tuple[str, ...], int]:
    """(data axes, their number of devices) of the mesh being traced under (`jax.set_mesh`)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return (), 1
    axes = tuple(a for a in ("data", "fsdp") if a in mesh.axis_names)
    return axes, int(np.prod([mesh.shape[a] for a in axes]))


def per_factor(fn: Callable, *factors: list[jax.Array]) -> list[Any]:
    """[fn(*xs) for xs in zip(*factors)] (the factorizations: eigh at call 0, QR on refresh).

    Under a mesh with D > 1 data devices the factors are distributed: the ones of equal shape and
    dtype are stacked, padded to a multiple of D (copies of the first), and each device factorizes
    its 1/D of the stack (`shard_map` over the data axes); the results are gathered where they
    are used. A group of one factor is factorized where it is (padding it would give every
    device a copy to factorize anyway, and D gathered copies to check). Elsewhere: a loop over
    the factors on CPU (see `_stacked_map`), and on accelerators one batched call per group of
    equal shape and dtype.
    """
    if not factors[0]:
        return []
    axes, devices = _data_axes()
    if devices == 1:
        def loop(*lists):
            return [fn(*xs) for xs in zip(*lists)]

        def batched(*lists):
            out: list[Any] = [None] * len(lists[0])
            for idx in _groups(lists[0]):
                res = jax.vmap(fn)(*[jnp.stack([lst[i] for i in idx]) for lst in lists])
                for pos, i in enumerate(idx):
                    out[i] = jax.tree.map(lambda r, pos=pos: r[pos], res)
            return out

        return jax.lax.platform_dependent(*factors, cpu=loop, default=batched)

    out: list[Any] = [None] * len(factors[0])
    spec = jax.sharding.PartitionSpec(axes)
    for idx in _groups(factors[0]):
        if len(idx) == 1:  # one factor: every device would factorize a copy of it anyway
            out[idx[0]] = fn(*(lst[idx[0]] for lst in factors))
            continue
        padded = idx + [idx[0]] * (-len(idx) % devices)
        stacks = tuple(jnp.stack([lst[i] for i in padded]) for lst in factors)
        res = jax.shard_map(lambda *xs: _stacked_map(fn, xs), in_specs=(spec,) * len(stacks), out_specs=spec,
                            check_vma=False)(*stacks)
        for pos, i in enumerate(idx):
            out[i] = jax.tree.map(lambda r, pos=pos: r[pos], res)
    return out


def cond_1d(pred: jax.Array, true_fn: Callable, false_fn: Callable, operand: Any, like: Any) -> Any:
    """`lax.cond(pred, true_fn, false_fn, operand)` with every array crossing the cond flattened to
    1-D (`like`: arrays shaped as the result). XLA gives a cond's result one layout for all branches;
    LAPACK's eigh and QR return column-major matrices, so with matrices crossing it the branch that
    passes the state through would transpose every factor on every step (a transpose kernel per
    array, compiled and run). A 1-D array has one layout: the transposes stay inside the
    factorizing branch, and reshaping a row-major matrix is free. With several devices the cond
    is a plain one (flattening a sharded matrix would lose its sharding)."""
    if jax.device_count() > 1:
        return jax.lax.cond(pred, true_fn, false_fn, operand)
    shapes_in = jax.tree.map(jnp.shape, operand)
    shapes_out = jax.tree.map(jnp.shape, like)
    flat = lambda tree: jax.tree.map(lambda x: jnp.reshape(x, (-1,)), tree)

    def branch(fn: Callable) -> Callable:
        return lambda ops: flat(fn(jax.tree.map(jnp.reshape, ops, shapes_in)))

    out = jax.lax.cond(pred, branch(true_fn), branch(false_fn), flat(operand))
    return jax.tree.map(jnp.reshape, out, shapes_out)


class _Hyper(NamedTuple):
    b1: float
    b2: float
    beta_s: float
    eps: float
    normalize_grads: bool
    correct_bias: bool


def tensor_step(
    g: jax.Array,
    mu: jax.Array,
    nu: jax.Array,
    gg: tuple[jax.Array, ...],
    q: tuple[jax.Array, ...],
    count: jax.Array,
    axes: tuple[int, ...],
    hp: _Hyper,
) -> tuple[jax.Array, jax.Array, jax.Array, tuple[jax.Array, ...]]:
    """One SOAP call for one tensor in its work shape (§5): (direction, m, v, GG).

    g, mu, nu: work shape; gg, q: one (s_i, s_i) per axis in `axes`. The direction
    includes the bias correction √(1-b2^t)/(1-b1^t) (t = count) and is zero on call 0, which
    leaves m, v as they are. GG advances on every call with the raw gradient.
    """
    first = count == 0
    basis = dict(zip(axes, q))
    g_proj = mode_product(g, basis, transpose=True)  # G ×_i Q_iᵀ
    mu_new = hp.b1 * mu + (1 - hp.b1) * g_proj
    nu_new = hp.b2 * nu + (1 - hp.b2) * jnp.square(g_proj)
    direction = mode_product(mu_new / (jnp.sqrt(nu_new) + hp.eps), basis, transpose=False)
    if hp.normalize_grads:
        direction = direction / (1e-30 + jnp.sqrt(jnp.mean(jnp.square(direction))))
    if hp.correct_bias:
        t = count.astype(g.dtype)
        direction = direction * (jnp.sqrt(1 - hp.b2**t) / (1 - hp.b1**t))
    gg_new = tuple(hp.beta_s * f + (1 - hp.beta_s) * mode_gram(g, a) for a, f in zip(axes, gg))
    return (
        jnp.where(first, 0, direction),
        jnp.where(first, mu, mu_new),
        jnp.where(first, nu, nu_new),
        gg_new,
    )


def tensor_rotate(
    mu: jax.Array,
    nu: jax.Array,
    q_old: tuple[jax.Array, ...],
    q_new: tuple[jax.Array, ...],
    orders: tuple[jax.Array, ...],
    axes: tuple[int, ...],
) -> tuple[jax.Array, jax.Array]:
    """After a refresh: m into the new basis (×_i Q_newᵀ Q_old), v permuted by each axis's sort."""
    rot = {a: jnp.matmul(n.T, o, precision=_PRECISION) for a, n, o in zip(axes, q_new, q_old)}
    mu = mode_product(mu, rot, transpose=False)
    for a, order in zip(axes, orders):
        nu = jnp.take(nu, order, axis=a)
    return mu, nu


# ---------------------------------------------------------------------------------------------
# Validation.


def check_unit_interval(name: str, value: float, who: str = "SOAP") -> None:
    if not is_number(value) or not 0.0 <= float(value) < 1.0:
        raise ValueError(f"{who} {name} must be a float in [0, 1), got {value!r}")


def check_positive_int(name: str, value: int, who: str = "SOAP") -> None:
    if not is_positive_int(value):
        raise ValueError(f"{who} {name} must be an integer >= 1, got {value!r}")


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
    check_unit_interval("b1", b1)
    check_unit_interval("b2", b2)
    if shampoo_beta is not None:
        check_unit_interval("shampoo_beta", shampoo_beta)
    if not is_number(eps) or eps < 0:
        raise ValueError(f"SOAP eps must be a float >= 0, got {eps!r}")
    if not is_number(weight_decay) or weight_decay < 0:
        raise ValueError(f"SOAP weight_decay must be a float >= 0, got {weight_decay!r}")
    check_positive_int("precondition_frequency", precondition_frequency)
    check_positive_int("max_precond_dim", max_precond_dim)


def check_mask_type(mask: Any, name: str = "weight_decay_mask", who: str = "SOAP") -> None:
    if mask is None or callable(mask):
        return
    leaves = jax.tree.leaves(mask)
    if not leaves or not all(isinstance(x, (bool, np.bool_)) for x in leaves):
        raise ValueError(
            f"{who} {name} must be None, a callable params -> bool pytree, or a pytree of "
            f"Python bools; got leaves {[type(x).__name__ for x in leaves[:3]]}"
        )


def resolve_mask(mask: Any, params: optax.Params, name: str = "weight_decay_mask", who: str = "SOAP") -> Any:
    """Mask pytree of bools for `params`; one-line ValueError when its structure differs."""
    resolved = mask(params) if callable(mask) else mask
    want, got = jax.tree.structure(params), jax.tree.structure(resolved)
    if want != got:
        raise ValueError(
            f"{who} {name} does not match the parameters: {got.num_leaves} mask leaves "
            f"vs {want.num_leaves} parameter leaves with a different tree structure"
        )
    return resolved


def default_weight_decay_mask(params: optax.Params) -> Any:
    """Decay weights with ≥ 2 dims (kernels, embeddings); not biases, LayerNorm scales, scalars."""
    return jax.tree.map(lambda p: jnp.ndim(p) >= 2, params)


# ---------------------------------------------------------------------------------------------
# Transformations.


def scale_by_soap(
    b1: float = 0.95, b2: float = 0.95, shampoo_beta: float | None = None, eps: float = 1e-8,
    precondition_frequency: int = 10, max_precond_dim: int = 10000, merge_dims: bool = False,
    precondition_1d: bool = False, normalize_grads: bool = False, correct_bias: bool = True, stacked: Any = None,
) -> optax.GradientTransformation:
    """SOAP direction √(1-b2^t)/(1-b1^t)·project_back(m/(√v+eps)) (docs/method/papers.md §5), no lr, no decay.

    The first call returns zeros and only builds the preconditioner. Follow with
    `optax.scale_by_learning_rate` (see `soap`). shampoo_beta=None means shampoo_beta = b2.
    stacked: None, a bool pytree like the parameters or a callable params -> one: leaves whose
    leading axis stacks L independent layers (a scanned encoder). Each layer is its own tensor
    (factors (L, s, s), its own normalization), exactly as if the layers were separate leaves.
    """
    validate_soap_hparams(b1, b2, shampoo_beta, eps, 0.0, precondition_frequency, max_precond_dim)
    check_mask_type(stacked, "stacked")
    beta_s = b2 if shampoo_beta is None else shampoo_beta

    hp = _Hyper(b1, b2, beta_s, eps, normalize_grads, correct_bias)

    def layout(p: jax.Array, is_stacked: bool = False) -> tuple[tuple[int, ...], tuple[int, ...]]:
        shape = jnp.shape(p)[1:] if is_stacked else jnp.shape(p)
        return soap_layout(shape, max_precond_dim, merge_dims, precondition_1d)

    def stacked_flags(tree: Any) -> Any:
        return jax.tree.map(lambda _: False, tree) if stacked is None else resolve_mask(stacked, tree, "stacked")

    def init_fn(params: optax.Params) -> ScaleBySoapState:
        def factors(p: jax.Array, is_stacked: bool, fill: Callable) -> tuple[jax.Array, ...]:
            work, axes = layout(p, is_stacked)
            dtype = state_dtype(p.dtype)
            lead = (p.shape[0],) if is_stacked else ()
            return tuple(jnp.broadcast_to(fill(work[a], dtype), lead + (work[a],) * 2) for a in axes)

        zeros = lambda p: jnp.zeros(jnp.shape(p), state_dtype(p.dtype))
        flags = stacked_flags(params)
        return ScaleBySoapState(
            count=jnp.zeros([], jnp.int32),
            mu=jax.tree.map(zeros, params),
            nu=jax.tree.map(zeros, params),
            gg=jax.tree.map(lambda p, f: factors(p, f, lambda s, d: jnp.zeros((s, s), d)), params, flags),
            q=jax.tree.map(lambda p, f: factors(p, f, lambda s, d: jnp.eye(s, dtype=d)), params, flags),
        )

    def update_fn(
        updates: optax.Updates, state: ScaleBySoapState, params: optax.Params | None = None
    ) -> tuple[optax.Updates, ScaleBySoapState]:
        del params
        grads, treedef = jax.tree.flatten(updates)
        mus, nus = treedef.flatten_up_to(state.mu), treedef.flatten_up_to(state.nu)
        ggs, qs = treedef.flatten_up_to(state.gg), treedef.flatten_up_to(state.q)
        flags = treedef.flatten_up_to(stacked_flags(updates))
        count = state.count
        layouts = [layout(g, f) for g, f in zip(grads, flags)]
        # Layers per leaf: L for a stacked leaf (its per-layer functions vmapped), else 1.
        layers = [g.shape[0] if f else 1 for g, f in zip(grads, flags)]

        def per_layer(fn: Callable, i: int) -> Callable:
            return jax.vmap(fn) if flags[i] else fn

        def work_shape(i: int) -> tuple[int, ...]:
            return ((layers[i],) if flags[i] else ()) + layouts[i][0]

        directions, new_mu, new_nu, new_gg = [], [], [], []
        for i, (g, mu, nu, gg, q) in enumerate(zip(grads, mus, nus, ggs, qs)):
            dtype, axes, work = state_dtype(g.dtype), layouts[i][1], work_shape(i)
            step = lambda g, mu, nu, gg, q, axes=axes: tensor_step(g, mu, nu, gg, q, count, axes, hp)
            d, m, v, f = per_layer(step, i)(
                g.astype(dtype).reshape(work), mu.reshape(work), nu.reshape(work), tuple(gg), tuple(q)
            )
            directions.append(d)
            new_mu.append(m)
            new_nu.append(v)
            new_gg.append(f)

        # Leaves with factors enter the conds: eigh on call 0, power iteration + QR on refresh
        # steps, nothing otherwise. The refresh sees one (s, s) matrix per factor and layer.
        factored = [i for i, (_, axes) in enumerate(layouts) if axes]

        def split(i: int, factors: tuple[jax.Array, ...]) -> list[jax.Array]:
            return [f[layer] for f in factors for layer in range(layers[i])] if flags[i] else list(factors)

        flat_gg = [f for i in factored for f in split(i, new_gg[i])]
        flat_q = [f for i in factored for f in split(i, qs[i])]

        def regroup(flat: list[Any]) -> list[tuple[Any, ...]]:
            out, k = [], 0
            for i in factored:
                n, per = len(layouts[i][1]), layers[i]
                mats = [flat[k + j * per : k + (j + 1) * per] for j in range(n)]
                out.append(tuple(jnp.stack(m) if flags[i] else m[0] for m in mats))
                k += n * per
            return out

        def keep(ops):
            _, q_flat, mu_l, nu_l = ops
            return q_flat, mu_l, nu_l

        def eigh_init(ops):
            gg_flat, q_flat, mu_l, nu_l = ops
            return per_factor(_descending_eigenbasis, gg_flat), mu_l, nu_l

        def qr_refresh(ops):
            gg_flat, q_flat, mu_l, nu_l = ops
            q_new, orders = power_qr_refresh(gg_flat, q_flat)
            orders = regroup(orders)
            mu_out, nu_out = [], []
            for i, mu, nu, q_o, q_n, order in zip(
                factored, mu_l, nu_l, regroup(q_flat), regroup(q_new), orders
            ):
                rotate = functools.partial(tensor_rotate, axes=layouts[i][1])
                mu, nu = per_layer(rotate, i)(mu, nu, q_o, q_n, order)
                mu_out.append(mu)
                nu_out.append(nu)
            return q_new, mu_out, nu_out

        def refresh_or_keep(ops):
            return cond_1d(count % precondition_frequency == 0, qr_refresh, keep, ops, ops[1:])

        if factored:
            ops = (flat_gg, flat_q, [new_mu[i] for i in factored], [new_nu[i] for i in factored])
            q_flat, mu_f, nu_f = cond_1d(count == 0, eigh_init, refresh_or_keep, ops, ops[1:])
            new_q = [tuple(q) for q in qs]
            for i, q, m, v in zip(factored, regroup(q_flat), mu_f, nu_f, strict=True):
                new_q[i], new_mu[i], new_nu[i] = q, m, v
        else:
            new_q = [tuple(q) for q in qs]

        shapes = [g.shape for g in grads]
        new_state = ScaleBySoapState(
            count=optax.safe_increment(count),
            mu=treedef.unflatten([m.reshape(s) for m, s in zip(new_mu, shapes)]),
            nu=treedef.unflatten([v.reshape(s) for v, s in zip(new_nu, shapes)]),
            gg=treedef.unflatten(new_gg),
            q=treedef.unflatten(new_q),
        )
        out = [d.reshape(g.shape).astype(g.dtype) for d, g in zip(directions, grads)]
        return treedef.unflatten(out), new_state

    return optax.GradientTransformation(init_fn, update_fn)


def add_decayed_weights_after_step(
    weight_decay: float, learning_rate: ScalarOrSchedule, mask: Any = None
) -> optax.GradientTransformation:
    """Decoupled decay of the *updated* parameter: u ← u - lr_t·wd·(p + u), so p + u = (p + u₀)(1 - lr_t·wd).

    Place after the learning-rate scaling. lr_t is the schedule at this call's count (as in
    `optax.scale_by_learning_rate`); call 0 (SOAP's zero step) applies no decay. `mask`: None
    (all leaves), a bool pytree matching the parameters, or a callable params -> bool pytree.
    """
    check_mask_type(mask)

    def init_fn(params: optax.Params) -> DecoupledDecayState:
        if mask is not None:
            resolve_mask(mask, params)
        return DecoupledDecayState(count=jnp.zeros([], jnp.int32))

    def update_fn(
        updates: optax.Updates, state: DecoupledDecayState, params: optax.Params | None = None
    ) -> tuple[optax.Updates, DecoupledDecayState]:
        if params is None:
            raise ValueError("SOAP weight decay needs params: call update(grads, state, params)")
        lr = learning_rate(state.count) if callable(learning_rate) else learning_rate
        active = state.count > 0
        masks = resolve_mask(mask, params) if mask is not None else jax.tree.map(lambda _: True, params)

        def decay(u: jax.Array, p: jax.Array, on: bool) -> jax.Array:
            if not on:
                return u
            shrink = jnp.where(active, lr * weight_decay, 0.0)
            return (u - shrink * (p + u)).astype(u.dtype)

        new = jax.tree.map(decay, updates, params, masks)
        return new, DecoupledDecayState(count=optax.safe_increment(state.count))

    return optax.GradientTransformation(init_fn, update_fn)


def soap(
    learning_rate: ScalarOrSchedule, b1: float = 0.95, b2: float = 0.95, shampoo_beta: float | None = None,
    eps: float = 1e-8, weight_decay: float = 0.01, precondition_frequency: int = 10, max_precond_dim: int = 10000,
    merge_dims: bool = False, precondition_1d: bool = False, normalize_grads: bool = False, correct_bias: bool = True,
    weight_decay_mask: Any = None, stacked: Any = None,
) -> optax.GradientTransformation:
    """SOAP with learning rate (float or schedule) and decoupled weight decay (docs/method/papers.md §5).

    Chain: scale_by_soap → scale by -lr_t → u ← u - lr_t·wd·(p + u), reproducing the reference's
    `p ← p - lr·bc·dir; p ← p - lr·wd·p` exactly. weight_decay_mask=None decays ≥2-D parameters.
    Defaults are the reference's (the paper's Cutting-the-Skip runs use b1=0.9, b2=0.95, freq 10).
    stacked: leaves whose leading axis stacks independent layers (see `scale_by_soap`).
    """
    validate_soap_hparams(
        b1, b2, shampoo_beta, eps, weight_decay, precondition_frequency, max_precond_dim
    )
    check_mask_type(weight_decay_mask)
    parts = [
        scale_by_soap(b1, b2, shampoo_beta, eps, precondition_frequency, max_precond_dim, merge_dims,
                      precondition_1d, normalize_grads, correct_bias, stacked),
        optax.scale_by_learning_rate(learning_rate),
    ]
    if weight_decay > 0:
        mask = default_weight_decay_mask if weight_decay_mask is None else weight_decay_mask
        parts.append(add_decayed_weights_after_step(weight_decay, learning_rate, mask))
    return optax.chain(*parts)
