"""shampoo_ec (docs/method/shampoo_ec.md) against an independent float64 numpy reading of
DistributedShampoo's eigenvalue-corrected step, in torch's layout; the trainer; 8 devices."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from skipless_jax import sharding, validate
from skipless_jax.optim import OPTIMIZERS, shampoo_ec
from skipless_jax.optim.shampoo_ec import block_layout
from skipless_jax.trainers import supervised

from util import one_device, single_and_fsdp_start, tiny_config

# --------------------------------------------------------------------------------------------
# The reference, written from docs/method/shampoo_ec.md on torch-layout tensors: a Flax Dense
# kernel (in, out) is torch's weight transposed, a conv kernel (kh, kw, in, out) is torch's
# (out, in, kh, kw) permuted.


def torch_merge(shape, b):
    """merge_small_dims: size-1 dims dropped, left to right while the product stays <= b."""
    dims = [s for s in shape if s != 1] or [1]
    out = [dims[0]]
    for s in dims[1:]:
        if out[-1] * s <= b:
            out[-1] *= s
        else:
            out.append(s)
    return out


def torch_blocks(shape, b):
    """multi_dim_split: index tuples of the blocks, dim 0 outermost."""
    blocks = [()]
    for s in shape:
        blocks = [blk + (slice(a, min(a + b, s)),) for blk in blocks for a in range(0, s, b)]
    return blocks


def rotate(x, qs, back=False):
    """The reference's _precondition_grad: tensordot over dim 0, new dim appended; after ndim
    contractions the order is restored. back: with Q (dims [0], [1]) instead of Qᵀ."""
    for q in qs:
        x = np.tensordot(x, q, axes=([0], [1] if back else [0]))
    return x


class RefShampooEC:
    def __init__(self, lr, b1, b2, eps, wd, freq, b, start, mask, eps_outside=False, descending=False,
                 rotate_v=False):
        """The last three switch on deviations the test must be able to see."""
        self.lr, self.b1, self.b2, self.eps, self.wd = lr, b1, b2, eps, wd
        self.eps_outside, self.descending, self.rotate_v = eps_outside, descending, rotate_v
        self.freq, self.b, self.mask = freq, b, mask
        self.start = freq if start == -1 else start
        self.state, self.t = {}, 0

    def step(self, params, grads):
        self.t += 1
        t, b1, b2 = self.t, self.b1, self.b2
        refresh = (t % self.freq == 0 and t > self.start) or t == self.start
        lr = self.lr(t - 1) if callable(self.lr) else self.lr
        out = {}
        for name, g_flax in grads.items():
            axes = (3, 2, 0, 1) if g_flax.ndim == 4 else None  # torch layout: (out, in, kh, kw) or reversed
            g, w = np.transpose(g_flax, axes), np.transpose(params[name], axes)
            merged = torch_merge(g.shape, self.b)
            gm = g.reshape(merged)
            if name not in self.state:
                blocks = torch_blocks(merged, self.b)
                self.state[name] = dict(
                    m=np.zeros_like(g), blocks=blocks,
                    L=[[np.zeros((gm[blk].shape[k],) * 2) for k in range(gm.ndim)] for blk in blocks],
                    Q=[[np.eye(gm[blk].shape[k]) for k in range(gm.ndim)] for blk in blocks],
                    V=[np.zeros(gm[blk].shape) for blk in blocks])
            st = self.state[name]
            st["m"] = b1 * st["m"] + (1 - b1) * g
            m_hat = (st["m"] / (1 - b1**t)).reshape(merged)
            d = np.zeros(merged)
            for j, blk in enumerate(st["blocks"]):
                gb = gm[blk]
                for k in range(gb.ndim):
                    other = [i for i in range(gb.ndim) if i != k]
                    st["L"][j][k] = b2 * st["L"][j][k] + (1 - b2) * np.tensordot(gb, gb, axes=(other, other))
                if refresh:
                    old = st["Q"][j]
                    st["Q"][j] = [np.linalg.eigh(f)[1][:, ::-1 if self.descending else 1] for f in st["L"][j]]
                    if self.rotate_v:  # rotate V as if it were a tensor in the old basis
                        st["V"][j] = np.abs(rotate(rotate(st["V"][j], old, back=True), st["Q"][j]))
                st["V"][j] = b2 * st["V"][j] + (1 - b2) * rotate(gb, st["Q"][j]) ** 2
                v_hat = st["V"][j] / (1 - b2**t)
                denom = np.sqrt(v_hat) + self.eps if self.eps_outside else np.sqrt(v_hat + self.eps)
                scaled = rotate(m_hat[blk], st["Q"][j]) / denom
                d[blk] = rotate(scaled, st["Q"][j], back=True)
            d = d.reshape(g.shape)
            if self.wd and self.mask[name]:
                d = d + self.wd * w
            out[name] = np.transpose(w - lr * d, None if axes is None else np.argsort(axes))
        return out


# --------------------------------------------------------------------------------------------
# One case = one parameter, its max_preconditioner_dim and start; every factor has full rank at
# every refresh, so the eigenbases are unique up to sign.

CASES = {
    "matrix": ((6, 5), 6, -1, 7),  # torch (5, 6): two factors, 5x5 and 6x6
    "conv": ((3, 3, 2, 4), 8, -1, 7),  # torch (4, 2, 3, 3) -> (8, 3, 3)
    "vector": ((4,), 8192, 4, 9),  # one 4x4 factor; refreshes at steps 4, 6, 8
    "blocked": ((7, 6), 4, -1, 7),  # torch (6, 7): blocks 4x4, 4x3, 2x4, 2x3
}
LR = lambda count: 0.05 / (1 + 0.1 * count)


def run_case(case, wd, b1=0.9, b2=0.95, eps=1e-8, freq=2):
    shape, b, start, steps = CASES[case]
    rng = np.random.default_rng(0)
    p0 = {"w": rng.standard_normal(shape)}
    noises = [{"w": rng.standard_normal(shape)} for _ in range(steps)]
    grad = lambda p, n: {"w": 0.5 * p["w"] + n["w"]}  # depends on p: a wrong step changes later ones
    ref = RefShampooEC(LR, b1, b2, eps, wd, freq, b, start, {"w": True})
    p, ref_traj = dict(p0), []
    for n in noises:
        p = ref.step(p, grad(p, n))
        ref_traj.append(p["w"])
    with jax.enable_x64(True):
        tx = shampoo_ec(LR, b1=b1, b2=b2, eps=eps, weight_decay=wd, precondition_frequency=freq,
                        max_preconditioner_dim=b, start_preconditioning_step=start, weight_decay_mask={"w": True})

        @jax.jit
        def step(p, s, n):
            u, s = tx.update(grad(p, n), s, p)
            return optax.apply_updates(p, u), s

        params = jax.tree.map(jnp.asarray, p0)
        state, traj = tx.init(params), []
        for n in noises:
            params, state = step(params, state, n)
            traj.append(np.asarray(params["w"]))
        assert params["w"].dtype == jnp.float64
    return p0["w"], ref_traj, traj, state


@pytest.mark.parametrize("wd", [0.0, 0.1])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_numpy_reference(case, wd):
    w0, ref_traj, traj, state = run_case(case, wd)
    for t, (r, j) in enumerate(zip(ref_traj, traj), start=1):
        np.testing.assert_allclose(j, r, rtol=1e-9, atol=1e-11, err_msg=f"{case} step {t}")
    assert np.abs(traj[-1] - w0).max() > 0.1  # the trajectory moved
    assert not np.allclose(state[0].bases["w"][0], np.eye(state[0].bases["w"][0].shape[0]))  # refreshed


def run_reference_only(case, eps, **options):
    shape, b, start, steps = CASES[case]
    rng = np.random.default_rng(0)
    p = {"w": rng.standard_normal(shape)}
    noises = [{"w": rng.standard_normal(shape)} for _ in range(steps)]
    ref = RefShampooEC(LR, 0.9, 0.95, eps, 0.0, 2, b, start, {"w": True}, **options)
    for n in noises:
        p = ref.step(p, {"w": 0.5 * p["w"] + n["w"]})
    return p["w"]


def test_reference_is_sensitive_to_the_details():
    """The comparison can fail: ε outside the root (Adam's place), descending eigenvectors, or V
    rotated into each new basis move the trajectory by far more than the tolerance (ε 1e-3 here,
    so that its place matters at these gradient sizes)."""
    _, _, traj, _ = run_case("matrix", 0.0, eps=1e-3)
    np.testing.assert_allclose(run_reference_only("matrix", 1e-3), traj[-1], rtol=1e-9)
    for options in (dict(eps_outside=True), dict(descending=True), dict(rotate_v=True)):
        assert np.abs(run_reference_only("matrix", 1e-3, **options) - traj[-1]).max() > 1e-6, options


def test_before_the_first_refresh_it_is_adam_with_eps_inside_the_root():
    """Steps 1..f-1: identity bases, so D = m̂ / √(v̂ + ε): optax's Adam with eps_root = ε, eps = 0."""
    rng = np.random.default_rng(1)
    shapes = {"w": (3, 4), "b": (4,), "conv": (2, 2, 3, 4)}
    params = {k: jnp.asarray(rng.standard_normal(s), jnp.float32) for k, s in shapes.items()}
    tx = shampoo_ec(1.0, eps=1e-3, precondition_frequency=5)
    adam = optax.chain(optax.scale_by_adam(b1=0.9, b2=0.95, eps=0.0, eps_root=1e-3), optax.scale(-1.0))
    s, sa = tx.init(params), adam.init(params)
    update, adam_update = jax.jit(tx.update), jax.jit(adam.update)
    for _ in range(4):
        g = {k: jnp.asarray(rng.standard_normal(v.shape), jnp.float32) for k, v in params.items()}
        u, s = update(g, s, params)
        ua, sa = adam_update(g, sa)
        for k in shapes:
            np.testing.assert_allclose(u[k], ua[k], rtol=2e-5, atol=1e-6, err_msg=k)
    assert all(np.allclose(q, np.eye(q.shape[0])) for q in jax.tree.leaves(s[0].bases))


def test_merge_and_blocks_follow_the_reference_on_torch_layouts():
    # docs/method/shampoo_ec.md §1: the merged shape in torch's layout, or the parameter's own
    # (size-1 dims dropped) when nothing merges.
    assert block_layout((768,), 8192)[:2] == (None, (768,))
    assert block_layout((384, 1152), 8192)[:2] == (None, (384, 1152))  # Dense (in, out)
    assert block_layout((32, 64), 8192)[:2] == ((1, 0), (2048,))  # a small matrix: one vector
    assert block_layout((16, 16, 3, 384), 8192)[:2] == ((3, 2, 0, 1), (1152, 256))  # conv (kh, kw, in, out)
    assert block_layout((1, 1, 384), 8192)[:2] == (None, (384,))
    assert block_layout((), 8192)[:2] == (None, (1,))
    layout = block_layout((7, 6), 4)
    assert layout.perm is None and layout.work == (7, 6)
    assert [tuple(len(range(*s.indices(n))) for s, n in zip(blk, layout.work)) for blk in layout.blocks] == \
        [(4, 4), (4, 2), (3, 4), (3, 2)]


def test_registered_and_config_fields_reach_it():
    opt = ml_collections.ConfigDict(dict(name="shampoo_ec", b1=0.8, b2=0.9, eps=1e-6, weight_decay=0.05,
                                         precondition_frequency=3, max_preconditioner_dim=4,
                                         start_preconditioning_step=6, weight_decay_rule="deit"))
    tx = OPTIMIZERS["shampoo_ec"](opt, optax.constant_schedule(0.1))
    params = {"dense": {"kernel": jnp.ones((7, 6)), "bias": jnp.ones((6,))}}
    state = tx.init(params)
    assert len(state[0].factors["dense"]["kernel"]) == 8  # 4 blocks x 2 dims: max_preconditioner_dim read
    g = jax.tree.map(jnp.zeros_like, params)
    u, state = jax.jit(tx.update)(g, state, params)
    np.testing.assert_allclose(u["dense"]["kernel"], -0.1 * 0.05, rtol=1e-6)  # zero grad: decay alone
    np.testing.assert_array_equal(u["dense"]["bias"], 0.0)  # 'deit': biases are not decayed


@pytest.mark.parametrize("kwargs, match", [
    (dict(b1=1.0), "shampoo_ec b1 must be a float in \\[0, 1\\), got 1.0"),
    (dict(b2=-0.5), "shampoo_ec b2 must be"),
    (dict(eps=0.0), "shampoo_ec eps must be a float > 0, got 0.0"),
    (dict(weight_decay=-1.0), "shampoo_ec weight_decay must be a float >= 0"),
    (dict(precondition_frequency=0), "shampoo_ec precondition_frequency must be an integer >= 1, got 0"),
    (dict(max_preconditioner_dim=2.5), "shampoo_ec max_preconditioner_dim must be an integer >= 1"),
    (dict(start_preconditioning_step=5), "start_preconditioning_step must be -1 .* >= precondition_frequency=100"),
    (dict(start_preconditioning_step=-2), "start_preconditioning_step"),
    (dict(weight_decay_mask={"w": "yes"}), "shampoo_ec weight_decay_mask must be"),
])
def test_bad_hyperparameters(kwargs, match):
    with pytest.raises(ValueError, match=match) as err:
        shampoo_ec(1e-3, **kwargs)
    assert "\n" not in str(err.value)


def test_bad_config_fails_in_check_config():
    config = tiny_config("opt=shampoo_ec")
    config.optimizer.start_preconditioning_step = 3
    with pytest.raises(ValueError, match="config.optimizer: shampoo_ec start_preconditioning_step"):
        validate.validate_training(config)


@pytest.mark.slow
def test_trains_through_the_supervised_trainer(tmp_path):
    config = tiny_config("opt=shampoo_ec", total_steps=30)
    assert config.optimizer.name == "shampoo_ec" and config.optimizer.precondition_frequency == 100
    # Refreshes at 10, 20, 30; blocks of at most 64 keep the small kernels 2-D (at 8192 a 32x32
    # kernel merges into one 1024-vector with a 1024x1024 factor, as the reference does).
    config.optimizer.update(precondition_frequency=10, max_preconditioner_dim=64, lr=1e-2)
    metrics = supervised.train_and_evaluate(config, str(tmp_path), devices=one_device())
    assert metrics["step"] == 30
    assert metrics["test_loss"] < 2.2 and metrics["test_accuracy"] > 0.2, metrics  # chance: 2.30, 0.1


@pytest.mark.slow
def test_fsdp_sharded_matches_single_device():
    """8 fake devices, parameters and every state leaf FSDP-sharded: the same updates as one device."""
    assert jax.device_count() == 8
    mesh = sharding.make_mesh([("data", 1), ("fsdp", 8)])
    rules = [(".*", "fsdp")]
    shapes = {"q": (24, 24), "up": (24, 48), "bias": (24,), "conv": (2, 2, 6, 24)}
    rng = np.random.default_rng(2)
    params = {k: jnp.asarray(rng.standard_normal(s), jnp.float32) for k, s in shapes.items()}
    grads = [{k: jnp.asarray(rng.standard_normal(s), jnp.float32) for k, s in shapes.items()} for _ in range(40)]
    # max dim 32: `up` is blocked (24x32, 24x16), `conv` merges to (24, 24) in torch's layout;
    # refreshes at 30 and 40, when every factor has full rank.
    tx = shampoo_ec(0.01, weight_decay=0.1, precondition_frequency=10, max_preconditioner_dim=32,
                    start_preconditioning_step=30)

    step, (p1, s1), (p8, s8), (p_sh, s_sh) = single_and_fsdp_start(tx, params, grads, mesh, rules)
    big = s8[0].factors["up"][1]  # (32, 32) factor of `up`'s first block: sharded
    assert big.shape == (32, 32) and not big.sharding.is_fully_replicated
    sharded = jax.jit(step, donate_argnums=(0, 1), out_shardings=(p_sh, s_sh))  # as the trainers jit it
    for g in grads:
        p8, s8 = sharded(p8, s8, jax.device_put(g, p_sh))
    for k in params:
        np.testing.assert_allclose(np.asarray(p8[k]), np.asarray(p1[k]), rtol=1e-4, atol=1e-5, err_msg=k)
