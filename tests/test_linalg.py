"""skipless_jax.linalg: batched factorizations equal numpy's, and do not hang on 8 CPU devices."""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from skipless_jax import linalg

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def batch():
    return np.asarray(jax.random.normal(jax.random.key(0), (2, 3, 7, 5)), np.float64)


@pytest.mark.slow
def test_svd_matches_numpy_per_matrix(batch):
    u, s, vt = jax.jit(linalg.svd)(jnp.asarray(batch, jnp.float32))
    assert u.shape == (2, 3, 7, 5) and s.shape == (2, 3, 5) and vt.shape == (2, 3, 5, 5)
    np.testing.assert_allclose(s, np.linalg.svd(batch, compute_uv=False), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(u * s[..., None, :] @ vt), batch, atol=1e-5)
    only_s = jax.jit(lambda x: linalg.svd(x, compute_uv=False))(jnp.asarray(batch, jnp.float32))
    np.testing.assert_allclose(only_s, s, rtol=1e-6)


def test_eigh_and_qr_match_numpy_per_matrix(batch):
    gram = np.swapaxes(batch, -1, -2) @ batch  # (2, 3, 5, 5) symmetric
    lam, v = jax.jit(linalg.eigh)(jnp.asarray(gram, jnp.float32))
    np.testing.assert_allclose(lam, np.linalg.eigvalsh(gram), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(v @ (lam[..., None] * np.swapaxes(v, -1, -2))), gram, atol=1e-4)
    r = jax.jit(lambda x: linalg.qr(x, mode="r"))(jnp.asarray(batch, jnp.float32))
    np.testing.assert_allclose(np.abs(r), np.abs(np.linalg.qr(batch, mode="r")), atol=1e-5)


def test_unbatched_input_and_mismatched_batches():
    x = jnp.eye(3)
    np.testing.assert_allclose(linalg.svd(x, compute_uv=False), np.ones(3))
    with pytest.raises(ValueError, match="map_matrices needs equal batch axes"):
        linalg.map_matrices(lambda a, b: a @ b, jnp.zeros((2, 3, 3)), jnp.zeros((4, 3, 3)))


@pytest.mark.slow
def test_replicated_batched_factorizations_on_8_cpu_devices_finish():
    """A replicated program with several batched SVDs, a skipless-init ViT and Token Graying,
    on 8 host devices: with jnp.linalg's batched SVD this hangs on the first call (jax 0.10.2),
    also with XLA:CPU's concurrency-optimized scheduler off (as importing skipless_jax sets)."""
    script = textwrap.dedent(
        """
        import jax, jax.numpy as jnp
        from jax.sharding import NamedSharding, PartitionSpec as P
        from skipless_jax import linalg, token_graying
        from skipless_jax.models import vit
        mesh = jax.make_mesh((8,), ("data",))
        model = vit.ViT(num_classes=10, width=32, depth=2, num_heads=2, mlp_dim=64, patch_size=4,
                        skip_sab=False, skip_ffn=False, init_scheme="skipless")
        def program(key):
            x = jax.random.normal(key, (64, 16, 8))
            svds = [linalg.svd(x + i)[1] for i in range(4)]
            params = model.init(key, jnp.zeros((1, 8, 8, 1)), train=False)
            return svds, params, token_graying.svd_token_graying(x, 0.5)
        run = jax.jit(program, out_shardings=NamedSharding(mesh, P()))
        for i in range(5):
            jax.block_until_ready(run(jax.random.key(i)))
        print("finished")
        """
    )
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "finished" in proc.stdout
