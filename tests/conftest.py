"""Test setup: 8 fake CPU devices, set before JAX initializes its backends."""

import os

from subprocess_runs import XLA_TEST_FLAGS  # stdlib only: imports nothing of JAX

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
# The tests' XLA flags (subprocess_runs.XLA_TEST_FLAGS, shared with the processes the tests start).
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count=8 {XLA_TEST_FLAGS}"
).strip()

# One compilation cache for the session's workers and the processes the tests start: the same
# tiny programs are compiled by many tests (and by each process of the multi-process tests).
# It lives in the checkout (git-ignored), not in /tmp: delete `.xla_test_cache/` to start cold.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".xla_test_cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax
import pytest

jax.config.update("jax_num_cpu_devices", 8)


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "slow: over ~3 s in a measured run; the edit loop's fast subset is -m 'not slow' (docs/testing.md)"
    )
    config.addinivalue_line(
        "markers", "multiprocess: starts several trainer processes on 127.0.0.1 (deselect: -m 'not multiprocess')"
    )


def pytest_collection_finish(session):
    """The imported libraries (JAX, TensorFlow, torch: millions of objects) leave the cyclic
    garbage collector's scans, and its youngest generation is collected 14× less often: tracing
    makes short-lived objects by the million, and each full scan walked every library object
    (about 6 % of the suite's CPU time). Nothing a test computes depends on when garbage goes."""
    import gc

    gc.collect()
    gc.freeze()
    gc.set_threshold(10_000, 50, 100)


def pytest_collection_modifyitems(config, items):
    import pytest

    for item in items:  # every multi-process test starts processes that compile their own steps
        if item.get_closest_marker("multiprocess") is not None:
            item.add_marker(pytest.mark.slow)


def _tiny_dino_config():
    """configs/dino_digits.py, no skips, skipless init, shrunk: width 32, depth 1, 3 steps, kNN only."""
    import ml_collections

    from util import load_config

    config = load_config("dino_digits", "skip_sab=False,skip_ffn=False,init=skipless")
    config.model.width, config.model.mlp_dim, config.model.num_heads, config.model.depth = 32, 64, 2, 1
    config.dino.update(dict(out_dim=32, hidden_dim=32, bottleneck_dim=16))
    config.total_epochs, config.total_steps = None, 3
    config.schedule.warmup_epochs = 0
    config.eval_at_start, config.eval_every_steps = False, 0
    config.evals = ml_collections.ConfigDict({"knn": config.evals.knn.to_dict()})
    return config


@pytest.fixture(scope="session")
def tiny_dino_run(tmp_path_factory):
    """(config, workdir) of a tiny DINO run on one device, trained once per session (xdist workers
    share it): for the tests that read a DINO checkpoint (its teacher), not how DINO trains."""
    from skipless_jax.trainers import dino

    import subprocess_runs as sr
    from util import one_device

    config = _tiny_dino_config()
    workdir = os.path.join(sr.session_dir(tmp_path_factory), "tiny_dino")
    with sr.file_lock(workdir + ".lock"):
        if not os.path.exists(workdir + ".done"):
            dino.train_and_evaluate(config, workdir, devices=one_device())
            open(workdir + ".done", "w").close()
    return config, workdir
