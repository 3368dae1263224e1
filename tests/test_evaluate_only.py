"""`evaluate --only` (the named evaluators, one file each) and the persistent compilation cache."""

import json
import os
import subprocess
import sys

import ml_collections
import numpy as np
import pytest

from skipless_jax import compilation_cache, evaluate
from skipless_jax.trainers import supervised

from util import tiny_config


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("only")
    config = tiny_config(total_steps=2)
    config.evals = ml_collections.ConfigDict(dict(
        test=dict(type="classification"), knn=dict(type="knn", k=5, prefix="bank"),
    ))
    supervised.train_and_evaluate(config, str(workdir))
    return workdir


@pytest.mark.slow
def test_only_runs_the_named_evaluators_and_writes_each_file(finished):
    everything = evaluate.evaluate(str(finished))
    assert sorted(os.listdir(finished / "eval")) == ["knn.json", "test.json"]
    combined = json.loads((finished / "evaluation.json").read_text())
    (finished / "evaluation.json").write_text("{}")
    only = evaluate.evaluate(str(finished), only=["knn"])
    assert sorted(only) == ["bank_knn_accuracy", "step"]
    np.testing.assert_allclose(only["bank_knn_accuracy"], everything["bank_knn_accuracy"], rtol=1e-6)
    written = json.loads((finished / "eval" / "knn.json").read_text())
    assert written == {"step": 2, "bank_knn_accuracy": only["bank_knn_accuracy"]}
    assert json.loads((finished / "eval" / "test.json").read_text())["test_accuracy"] == combined["test_accuracy"]
    assert (finished / "evaluation.json").read_text() == "{}"  # --only leaves the combined file alone


@pytest.mark.slow
def test_only_with_a_name_the_config_lacks_is_one_line(finished):
    with pytest.raises(ValueError, match=r"^--only=knn,nope: 'nope' is not an evaluator of the config; "
                                         r"available: \['knn', 'test'\]$"):
        evaluate.evaluate(str(finished), only=["knn", "nope"])


def test_compilation_cache_folder_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    assert compilation_cache.cache_dir(None) == str(tmp_path / "xdg" / "skipless_jax" / "xla")
    assert compilation_cache.cache_dir({"compilation_cache_dir": None}) == compilation_cache.cache_dir(None)
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "env"))
    assert compilation_cache.cache_dir(None) == str(tmp_path / "env")
    assert compilation_cache.cache_dir({"compilation_cache_dir": str(tmp_path / "mine")}) == str(tmp_path / "mine")
    assert compilation_cache.cache_dir({"compilation_cache_dir": ""}) == ""
    with pytest.raises(ValueError, match=r"^config\.compilation_cache_dir=3 must be a folder path"):
        compilation_cache.cache_dir({"compilation_cache_dir": 3})
    assert tiny_config().compilation_cache_dir is None  # every recipe has the field (overridable)


@pytest.mark.slow  # three subprocesses
def test_setup_makes_a_second_process_read_the_program_back(tmp_path):
    """A program compiled by one process is written to the folder and loaded by the next."""
    code = (
        "import sys, jax, jax.numpy as jnp; from jax import monitoring; "
        "from skipless_jax import compilation_cache as cc; hits = []; "
        "monitoring.register_event_listener(lambda e, **_: hits.append(e) if e.endswith('/cache_hits') else None); "
        "cc.setup({'compilation_cache_dir': sys.argv[1]}); "
        "print(float(jax.jit(lambda x: jnp.sin(x) @ x.T)(jnp.ones((64, 64))).sum()), len(hits) > 0)"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    env.update(JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PLATFORMS="cpu")
    folder = tmp_path / "xla"
    first = subprocess.run([sys.executable, "-c", code, str(folder)], env=env, capture_output=True, text=True,
                           timeout=300)
    assert first.returncode == 0 and first.stdout.split()[1] == "False", first.stderr
    entries = sorted(os.listdir(folder))
    assert entries  # written
    second = subprocess.run([sys.executable, "-c", code, str(folder)], env=env, capture_output=True, text=True,
                            timeout=300)
    assert second.returncode == 0, second.stderr
    assert second.stdout.split() == [first.stdout.split()[0], "True"]  # the same value, read back
    off = subprocess.run([sys.executable, "-c", code.replace("sys.argv[1]", "''"), str(folder)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert off.returncode == 0 and off.stdout.split()[1] == "False" and sorted(os.listdir(folder)) == entries
