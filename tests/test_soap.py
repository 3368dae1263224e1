"""SOAP (docs/method/papers.md §5) against an independent float64 numpy reference, Adam, and on 8 devices."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from skipless_jax import sharding
from skipless_jax.optim.soap import merged_shape, scale_by_soap, soap, soap_layout

from util import single_and_fsdp_start

MAX_DIM = 16  # small so the mixed tree has an axis above the limit and merging does something


# --------------------------------------------------------------------------------------------
# Independent numpy reference: a line-by-line reading of the reference optimizer's step().


def ref_merge(shape, max_dim):
    """Greedy merge of consecutive dims while the running product stays <= max_dim."""
    out, cur = [], 1
    for s in shape:
        if cur * s > max_dim:
            if cur > 1:
                out.append(cur)
                cur = s
            else:
                out.append(s)
                cur = 1
        else:
            cur *= s
    if cur > 1 or not out:
        out.append(cur)
    return out


class RefSoap:
    """float64 numpy SOAP on a dict of arrays; grads in, new params out (p updated in place)."""

    def __init__(self, lr, b1, b2, shampoo_beta, eps, wd, freq, max_dim, merge, pre1d,
                 normalize, correct_bias, decay_mask):
        self.lr, self.b1, self.b2, self.eps, self.wd = lr, b1, b2, eps, wd
        self.beta_s = b2 if shampoo_beta is None else shampoo_beta
        self.freq, self.max_dim, self.merge, self.pre1d = freq, max_dim, merge, pre1d
        self.normalize, self.correct_bias, self.decay_mask = normalize, correct_bias, decay_mask
        self.state, self.calls = {}, 0

    def _view(self, x):
        return x.reshape(ref_merge(x.shape, self.max_dim)) if self.merge and x.ndim > 1 else x

    def _project(self, x, qs, back):
        shape = x.shape
        y = self._view(x) if self.merge else x
        for q in qs:  # contract axis 0 and append the new axis last: after ndim steps, order restored
            if q is None:
                y = np.moveaxis(y, 0, -1)
            else:
                y = np.tensordot(y, q, axes=([0], [1] if back else [0]))
        return y.reshape(shape)

    def _update_gg(self, g, st):
        if g.ndim == 1:
            if self.pre1d and g.shape[0] <= self.max_dim:
                st["GG"][0] = self.beta_s * st["GG"][0] + (1 - self.beta_s) * np.outer(g, g)
            return
        gm = self._view(g)
        for i, s in enumerate(gm.shape):
            if s <= self.max_dim:
                other = [k for k in range(gm.ndim) if k != i]
                outer = np.tensordot(gm, gm, axes=(other, other))
                st["GG"][i] = self.beta_s * st["GG"][i] + (1 - self.beta_s) * outer

    def _refresh(self, st):
        v = self._view(st["v"]) if self.merge else st["v"]
        new_q = []
        for i, (gg, q) in enumerate(zip(st["GG"], st["Q"])):
            if gg is None:
                new_q.append(None)
                continue
            est = np.diag(q.T @ gg @ q)
            idx = np.argsort(-est, kind="stable")
            v = np.take(v, idx, axis=i)
            new_q.append(np.linalg.qr(gg @ q[:, idx])[0])
        st["v"] = v.reshape(st["v"].shape)
        st["Q"] = new_q

    def _post(self, g, st):
        if st["Q"] is not None:
            st["m"] = self._project(st["m"], st["Q"], back=True)
        self._update_gg(g, st)
        if st["Q"] is None:
            st["Q"] = [None if gg is None else np.linalg.eigh(gg)[1][:, ::-1] for gg in st["GG"]]
        if st["step"] > 0 and st["step"] % self.freq == 0:
            self._refresh(st)
        if st["step"] > 0:
            st["m"] = self._project(st["m"], st["Q"], back=False)

    def step(self, params, grads):
        lr = self.lr(self.calls) if callable(self.lr) else self.lr
        self.calls += 1
        for name, g in grads.items():
            p = params[name]
            if name not in self.state:
                if g.ndim == 1:
                    dims = [g.shape[0] if self.pre1d and g.shape[0] <= self.max_dim else None]
                else:
                    shape = ref_merge(g.shape, self.max_dim) if self.merge else g.shape
                    dims = [s if s <= self.max_dim else None for s in shape]
                st = self.state[name] = dict(
                    step=0, m=np.zeros_like(g), v=np.zeros_like(g), Q=None,
                    GG=[None if s is None else np.zeros((s, s)) for s in dims])
                self._post(g, st)
                continue  # first call: preconditioner only
            st = self.state[name]
            gp = self._project(g, st["Q"], back=False)
            st["step"] += 1
            st["m"] = self.b1 * st["m"] + (1 - self.b1) * gp
            st["v"] = self.b2 * st["v"] + (1 - self.b2) * gp**2
            step_size = lr
            if self.correct_bias:
                step_size *= np.sqrt(1 - self.b2 ** st["step"]) / (1 - self.b1 ** st["step"])
            d = self._project(st["m"] / (np.sqrt(st["v"]) + self.eps), st["Q"], back=True)
            if self.normalize:
                d = d / (1e-30 + np.sqrt(np.mean(d**2)))
            p -= step_size * d
            if self.wd > 0 and self.decay_mask[name]:
                p -= lr * self.wd * p
            self._post(g, st)
        return params


# --------------------------------------------------------------------------------------------
# Shared pieces.

SHAPES = {
    "vec": (2,),  # 1-D (a 2x2 factor with precondition_1d)
    "bias_long": (20,),  # 1-D above the limit: always Adam
    "sq_a": (5, 5),  # square matrices of equal shape: batched refresh
    "sq_b": (5, 5),
    "sq_c": (6, 6),
    "t3": (2, 3, 6),  # merges to (6, 6)
    "conv": (2, 2, 2, 8),  # (kh, kw, in, out); merges to (8, 8)
    "wide": (3, 40),  # axis 1 above the limit: Adam along it
}


def make_tree(rng, shapes=SHAPES):
    return {k: rng.standard_normal(s) for k, s in shapes.items()}


def grad_fn_np(params, noise):
    # Depends on the parameters, so a wrong update changes every later gradient.
    return {k: 0.5 * params[k] + noise[k] for k in params}


def run_pair(steps=25, lr=None, shampoo_beta=None, normalize=False, correct_bias=True, merge=False,
             pre1d=False, freq=3, wd=0.1, b1=0.9, b2=0.95):
    lr = lr if lr is not None else (lambda c: 0.05 / (1 + 0.1 * c))
    rng = np.random.default_rng(0)
    params0 = make_tree(rng)
    noises = [make_tree(rng) for _ in range(steps)]
    mask = {k: len(s) >= 2 for k, s in SHAPES.items()}
    ref = RefSoap(lr, b1, b2, shampoo_beta, 1e-8, wd, freq, MAX_DIM, merge, pre1d, normalize,
                  correct_bias, mask)
    p_ref = {k: v.copy() for k, v in params0.items()}
    ref_traj = []
    for n in noises:
        p_ref = ref.step(p_ref, grad_fn_np(p_ref, n))
        ref_traj.append({k: v.copy() for k, v in p_ref.items()})

    with jax.enable_x64(True):
        tx = soap(
            lr, b1=b1, b2=b2, shampoo_beta=shampoo_beta, weight_decay=wd,
            precondition_frequency=freq, max_precond_dim=MAX_DIM, merge_dims=merge,
            precondition_1d=pre1d, normalize_grads=normalize, correct_bias=correct_bias)
        params = jax.tree.map(jnp.asarray, params0)
        state = tx.init(params)

        @jax.jit
        def step(params, state, noise):
            grads = jax.tree.map(lambda p, n: 0.5 * p + n, params, noise)
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state

        traj = []
        for n in noises:
            params, state = step(params, state, n)
            traj.append(jax.tree.map(np.asarray, params))
        assert all(x.dtype == np.float64 for x in jax.tree.leaves(params))
    return params0, ref_traj, traj


# --------------------------------------------------------------------------------------------
# Tests.


@pytest.mark.slow
@pytest.mark.parametrize("merge", [False, True])
@pytest.mark.parametrize("pre1d", [False, True])
def test_matches_numpy_reference(merge, pre1d):
    params0, ref_traj, traj = run_pair(merge=merge, pre1d=pre1d)
    for k in params0:  # first call: no update and no weight decay
        np.testing.assert_array_equal(traj[0][k], params0[k])
        np.testing.assert_array_equal(ref_traj[0][k], params0[k])
    for t, (r, j) in enumerate(zip(ref_traj, traj)):
        for k in params0:
            np.testing.assert_allclose(j[k], r[k], rtol=1e-6, atol=1e-9, err_msg=f"step {t} {k}")
    moved = max(np.abs(traj[-1][k] - params0[k]).max() for k in params0)
    assert moved > 0.1  # the trajectory is long enough to mean something


@pytest.mark.slow
def test_matches_reference_other_options():
    """normalize_grads, no bias correction, a separate shampoo_beta, constant lr, freq 4."""
    params0, ref_traj, traj = run_pair(lr=0.02, shampoo_beta=0.8, normalize=True,
                                       correct_bias=False, merge=True, pre1d=True, freq=4)
    for r, j in zip(ref_traj, traj):
        for k in params0:
            np.testing.assert_allclose(j[k], r[k], rtol=1e-6, atol=1e-9, err_msg=k)


@pytest.mark.slow
def test_reference_is_sensitive_to_pitfalls():
    """The comparison can fail: a reference without the v re-sort or m rotation drifts > 1e-6."""
    _, ref_traj, traj = run_pair(steps=10)

    class NoResort(RefSoap):
        def _refresh(self, st):
            v = st["v"].copy()
            super()._refresh(st)
            st["v"] = v

    rng = np.random.default_rng(0)
    p = make_tree(rng)
    noises = [make_tree(rng) for _ in range(10)]
    bad = NoResort(lambda c: 0.05 / (1 + 0.1 * c), 0.9, 0.95, None, 1e-8, 0.1, 3, MAX_DIM,
                   False, False, False, True, {k: len(s) >= 2 for k, s in SHAPES.items()})
    for n in noises:
        p = bad.step(p, grad_fn_np(p, n))
    err = max(np.abs(p[k] - traj[-1][k]).max() / np.abs(traj[-1][k]).max() for k in p)
    assert err > 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("eps", [0.0, 1e-8])
def test_identity_eigenbasis_is_adam(eps):
    """With every Q_i = I (and no refresh), SOAP's calls 1.. equal Adam on the same grads.

    The reference adds eps before the bias correction: √(1-b2^t)/(1-b1^t)·m/(√v+eps) is Adam
    m̂/(√v̂+eps_t) with eps_t = eps/√(1-b2^t), so that is the eps given to optax at step t.
    """
    rng = np.random.default_rng(1)
    grads = [make_tree(rng) for _ in range(12)]
    b1, b2 = 0.9, 0.99
    with jax.enable_x64(True):
        params = jax.tree.map(jnp.asarray, make_tree(rng))
        tx = scale_by_soap(b1=b1, b2=b2, eps=eps, precondition_frequency=10**6,
                                    max_precond_dim=MAX_DIM, precondition_1d=True)
        update = jax.jit(tx.update)
        adam_update = jax.jit(
            lambda g, s, e: optax.scale_by_adam(b1=b1, b2=b2, eps=e).update(g, s))
        state, a_state = tx.init(params), optax.scale_by_adam(b1=b1, b2=b2).init(params)
        u0, state = update(grads[0], state)
        assert all(float(jnp.abs(u).max()) == 0.0 for u in jax.tree.leaves(u0))
        assert len(jax.tree.leaves(state.q)) == 15  # vec 1, squares 3x2, t3 3, conv 4, wide 1
        assert not np.allclose(state.q["sq_a"][0], np.eye(5))  # call 0 built a real eigenbasis
        state = state._replace(q=jax.tree.map(lambda q: jnp.eye(q.shape[0]), state.q))
        for t, g in enumerate(grads[1:], start=1):
            u, state = update(g, state)
            ua, a_state = adam_update(g, a_state, eps / np.sqrt(1 - b2**t))
            for k in g:
                np.testing.assert_allclose(u[k], ua[k], rtol=1e-12, atol=0, err_msg=k)


def ill_conditioned_quadratic(d=16, kappa=1e4, seed=0):
    """f(W) = ½ tr(ΔᵀAΔB), Δ = W - W*, A and B rotated (non-axis-aligned) SPD, κ(A ⊗ B) = κ."""
    rng = np.random.default_rng(seed)

    def spd():
        q, _ = np.linalg.qr(rng.standard_normal((d, d)))
        return (q * np.geomspace(1.0, 1.0 / np.sqrt(kappa), d)) @ q.T

    a, b, target = spd(), spd(), rng.standard_normal((d, d))
    loss = lambda w: 0.5 * jnp.sum((w - target) * (a @ (w - target) @ b))
    return loss, jnp.zeros((d, d), jnp.float32), target


def steps_to_reach(tx, loss, w0, target, frac=1e-2, max_steps=450):
    """First step at which ‖W - W*‖ < frac·‖W₀ - W*‖ (max_steps + 1 if never)."""
    def body(carry, _):
        w, state = carry
        u, state = tx.update(jax.grad(loss)(w), state, w)
        w = optax.apply_updates(w, u)
        return (w, state), jnp.linalg.norm(w - target)

    _, dist = jax.jit(lambda w: jax.lax.scan(body, (w, tx.init(w)), length=max_steps))(w0)
    hit = np.nonzero(np.asarray(dist) < frac * float(jnp.linalg.norm(w0 - target)))[0]
    return int(hit[0]) + 1 if hit.size else max_steps + 1


@pytest.mark.slow
def test_faster_than_adam_on_ill_conditioned_quadratic():
    loss, w0, target = ill_conditioned_quadratic()
    lrs = [0.3, 0.1, 0.03]  # best of a small grid for each
    adam = min(steps_to_reach(optax.adam(lr, b1=0.9, b2=0.95), loss, w0, target) for lr in lrs)
    ours = min(
        steps_to_reach(soap(lr, b1=0.9, b2=0.95, weight_decay=0.0), loss, w0, target)
        for lr in lrs
    )
    assert ours < 0.5 * adam, (ours, adam)  # measured: 124 vs 375


@pytest.mark.slow
def test_fsdp_sharded_matches_single_device():
    assert jax.device_count() == 8
    # The trainer's mesh and rule: every leaf (parameters and optimizer state) FSDP-sharded on
    # its largest dimension divisible by 8.
    mesh = sharding.make_mesh([("data", 1), ("fsdp", 8)])
    rules = [(".*", "fsdp")]

    # Every factor full rank from call 0, so eigenbases are unique up to sign (a degenerate
    # eigenspace may legitimately be spanned differently by the sharded computation).
    shapes = {"emb": (40, 16), "q": (24, 24), "k": (24, 24), "up": (24, 48), "down": (48, 24),
              "bias": (48,), "conv": (2, 2, 6, 24)}
    rng = np.random.default_rng(2)
    params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), make_tree(rng, shapes))
    grads = [jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), make_tree(rng, shapes))
             for _ in range(5)]
    tx = soap(0.01, precondition_frequency=2, max_precond_dim=32)

    # One device, and FSDP: params, grads and every state leaf sharded by the same rule.
    step, (p1, s1), (p8, s8), (p_sh, s_sh) = single_and_fsdp_start(tx, params, grads, mesh, rules)
    big = s8[0].gg["up"][0]  # (24, 24) factor: sharded, not replicated on every device
    assert big.shape == (24, 24) and not big.sharding.is_fully_replicated
    sharded = jax.jit(step, donate_argnums=(0, 1))
    for i, g in enumerate(grads):
        p8, s8 = sharded(p8, s8, jax.device_put(g, p_sh))
        if i == 2:  # shardings after 3 steps: exactly those the state started with
            for want, leaf in zip(jax.tree.leaves(s_sh), jax.tree.leaves(s8)):
                assert leaf.sharding.is_equivalent_to(want, leaf.ndim), (leaf.shape, leaf.sharding)
            for want, leaf in zip(jax.tree.leaves(p_sh), jax.tree.leaves(p8)):
                assert leaf.sharding.is_equivalent_to(want, leaf.ndim)
    for k in params:
        np.testing.assert_allclose(np.asarray(p8[k]), np.asarray(p1[k]), rtol=1e-5, atol=1e-6)
    for a, b in zip(jax.tree.leaves(s8[0].gg), jax.tree.leaves(s1[0].gg)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    # v lives in a float32 eigenbasis refreshed twice: close, at eigenvector-perturbation level.
    for a, b in zip(jax.tree.leaves(s8[0].nu), jax.tree.leaves(s1[0].nu)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-3, atol=1e-4)


def test_one_device_flattened_conds_are_bitwise_the_plain_conds(monkeypatch):
    """`cond_1d` on one device (the arrays cross the conds flattened) gives bitwise the updates of
    the plain conds the 8-device test session takes, through call 0 and three refreshes."""
    rng = np.random.default_rng(3)
    params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), make_tree(rng))
    grads = [jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), make_tree(rng)) for _ in range(7)]
    tx = soap(0.01, precondition_frequency=2, max_precond_dim=MAX_DIM, merge_dims=True, precondition_1d=True)

    def run():
        step = jax.jit(lambda p, s, g: (lambda u, s: (optax.apply_updates(p, u), s))(*tx.update(g, s, p)))
        p, s = params, tx.init(params)
        for g in grads:
            p, s = step(p, s, g)
        return jax.tree.leaves((p, s))

    plain = run()
    monkeypatch.setattr(jax, "device_count", lambda *a: 1)
    flat = run()
    for a, b in zip(plain, flat, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_dtypes_bf16_params_float32_state():
    params = {"w": jnp.ones((4, 4), jnp.bfloat16), "b": jnp.ones((4,), jnp.bfloat16)}
    tx = soap(1e-3, precondition_1d=True)
    state = tx.init(params)
    for leaf in jax.tree.leaves(state[0]._replace(count=jnp.zeros([], jnp.float32))):
        assert leaf.dtype == jnp.float32
    g = jax.tree.map(lambda p: jnp.full_like(p, 0.1) * jnp.arange(1, 5, dtype=p.dtype), params)
    for _ in range(3):
        u, state = jax.jit(tx.update)(g, state, params)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(u))


def test_works_with_clipping_and_multisteps():
    rng = np.random.default_rng(3)
    params = jax.tree.map(jnp.asarray, make_tree(rng, {"w": (4, 4), "b": (4,)}))
    grads = [jax.tree.map(jnp.asarray, make_tree(rng, {"w": (4, 4), "b": (4,)})) for _ in range(8)]
    inner = lambda: optax.chain(optax.clip_by_global_norm(1.0), soap(0.01))
    multi = optax.MultiSteps(inner(), every_k_schedule=2)
    plain = inner()
    ms, ps = multi.init(params), plain.init(params)
    pm, pp = params, params
    multi_update, plain_update = jax.jit(multi.update), jax.jit(plain.update)
    for i in range(0, 8, 2):
        for g in grads[i:i + 2]:
            u, ms = multi_update(g, ms, pm)
            pm = optax.apply_updates(pm, u)
        mean = jax.tree.map(lambda a, b: (a + b) / 2, grads[i], grads[i + 1])
        u, ps = plain_update(mean, ps, pp)
        pp = optax.apply_updates(pp, u)
    for k in params:
        np.testing.assert_allclose(pm[k], pp[k], rtol=1e-5, atol=1e-6)
    assert float(jnp.abs(pm["w"] - params["w"]).max()) > 1e-3


@pytest.mark.parametrize("kwargs, match", [
    (dict(b1=1.0), "b1 must be a float in \\[0, 1\\)"),
    (dict(b1=-0.1), "b1"),
    (dict(b2=1.5), "b2 must be"),
    (dict(shampoo_beta=1.0), "shampoo_beta"),
    (dict(precondition_frequency=0), "precondition_frequency must be an integer >= 1, got 0"),
    (dict(precondition_frequency=2.5), "precondition_frequency"),
    (dict(max_precond_dim=0), "max_precond_dim must be an integer >= 1"),
    (dict(weight_decay=-1.0), "weight_decay"),
    (dict(weight_decay_mask={"w": "yes"}), "weight_decay_mask must be"),
])
def test_bad_hyperparameters(kwargs, match):
    with pytest.raises(ValueError, match=match) as err:
        soap(1e-3, **kwargs)
    assert "\n" not in str(err.value)


def test_mask_mismatch_raises_at_init():
    tx = soap(1e-3, weight_decay_mask={"w": True})
    with pytest.raises(ValueError, match="weight_decay_mask does not match the parameters"):
        tx.init({"w": jnp.ones((2, 2)), "b": jnp.ones((2,))})


def test_merge_and_layout():
    assert merged_shape((2, 2, 2, 8), 16) == (8, 8)
    assert merged_shape((3, 40), 16) == (3, 40)
    assert merged_shape((40, 3), 16) == (40, 3)
    assert merged_shape((3, 3, 64, 128), 10000) == (576, 128)
    assert soap_layout((20,), 16, True, True) == ((20,), ())
    assert soap_layout((8,), 16, False, True) == ((8,), (0,))
    assert soap_layout((3, 40), 16, False, False) == ((3, 40), (0,))
