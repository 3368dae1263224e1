"""`python -m skipless_jax.analyze`: table, plot and JSON from init or the latest checkpoint."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from skipless_jax import analyze, checkpoint, conditioning
from skipless_jax.models import init

from util import ROOT, one_device, tiny_config

NUM_IMAGES = 8


def _np_embedding_kappa(model, params, images):
    """Independent reference: the same jitted forward, then numpy SVD per image, mean over images."""
    _, out = jax.jit(lambda p, x: model.apply({"params": p}, x, train=False))(params, images)
    result = {}
    for point in conditioning.EMBEDDING_POINTS:
        per_layer = []
        for block in out["blocks"]:
            s = np.linalg.svd(np.asarray(block[point], np.float64), compute_uv=False)
            per_layer.append(np.log(s[:, 0] / s[:, -1]).mean())
        result[point] = np.array(per_layer)
    return result


@pytest.mark.slow
def test_analyze_at_init_writes_table_plot_and_json(tmp_path, capsys):
    arg = "skip_sab=False,init=skipless"
    config = tiny_config("depth=2," + arg)
    result = analyze.analyze(config, output_dir=str(tmp_path), num_images=NUM_IMAGES,
                             config_name=f"quickstart.py:{arg}")
    assert result["source"] == "init" and result["step"] == 0
    with open(tmp_path / "log_kappa.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert json.loads((tmp_path / "log_kappa.json").read_text())["log_kappa"] == result["log_kappa"]
    table = capsys.readouterr().out
    assert f"quickstart.py:{arg}" in table and "①" in table and "③+④" in table
    assert len([line for line in table.splitlines() if line.strip()[:1].isdigit()]) == config.model.depth
    share = init.self_attention_share(config.model, 16)  # docs/method/papers.md §3, 16 tokens of 2×2 pixels
    assert result["self_attention_share"] == share and result["num_tokens"] == 16
    assert f"Self-attention share at init: {share:.4f} (" in table and "16 N(0, I) tokens" in table

    model, shape = analyze.build(config)
    want = _np_embedding_kappa(model, analyze.init_params(model, config, shape),
                               analyze.probe_images(config, NUM_IMAGES))
    for point in conditioning.EMBEDDING_POINTS:
        np.testing.assert_allclose(result["log_kappa"][point], want[point], rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_analyze_reads_the_latest_checkpoint(tmp_path):
    config = tiny_config("depth=2,skip_sab=False")
    model, shape = analyze.build(config)
    params = analyze.init_params(model, config, shape)
    mngr = checkpoint.manager(str(tmp_path), async_save=False)
    later = None
    for step in (3, 7):  # different weights per step; the newest must be read
        key = jax.random.key(step)
        later = jax.tree.map(lambda p, key=key: p + 0.3 * jax.random.normal(key, p.shape), params)
        checkpoint.save(mngr, step, {"step": jnp.int32(step), "params": later}, {"step": step})
    mngr.wait_until_finished()
    mngr.close()

    result = analyze.analyze(config, workdir=str(tmp_path), num_images=NUM_IMAGES)
    assert (result["source"], result["step"]) == ("checkpoint", 7)
    assert os.path.exists(tmp_path / "analysis" / "log_kappa.png")
    images = analyze.probe_images(config, NUM_IMAGES)
    want = _np_embedding_kappa(model, later, images)
    at_init = _np_embedding_kappa(model, params, images)
    np.testing.assert_allclose(result["log_kappa"]["sab"], want["sab"], rtol=1e-4)
    assert np.abs(np.array(result["log_kappa"]["sab"]) - at_init["sab"]).max() > 1e-2


@pytest.mark.slow
def test_analyze_uses_the_config_saved_in_the_workdir(tmp_path, capsys):
    """A --config with another skip switch or depth than the run's: the saved config is analysed
    (it used to print a plausible table for the wrong model, or a 77-line traceback)."""
    from skipless_jax.trainers import supervised

    saved = tiny_config("depth=2,skip_sab=False", total_steps=2)
    supervised.train_and_evaluate(saved, str(tmp_path), devices=one_device())
    right = analyze.analyze(saved, workdir=str(tmp_path), num_images=NUM_IMAGES, output_dir=str(tmp_path / "a"))
    capsys.readouterr()
    flipped = analyze.analyze(tiny_config("depth=2,skip_sab=True", total_steps=2), workdir=str(tmp_path),
                              num_images=NUM_IMAGES, output_dir=str(tmp_path / "b"))
    assert "analysing with the saved config" in capsys.readouterr().out
    assert flipped["log_kappa"] == right["log_kappa"] and flipped["model"]["skip_sab"] is False
    deeper = analyze.analyze(tiny_config("depth=3", total_steps=2), workdir=str(tmp_path), num_images=NUM_IMAGES,
                             output_dir=str(tmp_path / "c"))
    assert len(deeper["log_kappa"]["sab"]) == 2
    no_config = analyze.analyze(None, workdir=str(tmp_path), num_images=NUM_IMAGES, output_dir=str(tmp_path / "d"))
    assert no_config["log_kappa"] == right["log_kappa"]


@pytest.mark.slow
def test_jacobian_columns(tmp_path, capsys):
    config = tiny_config("depth=2,skip_sab=False,skip_ffn=False,init=skipless")
    result = analyze.analyze(config, output_dir=str(tmp_path), num_images=2, jacobian=True)
    rows = result["jacobian"]
    assert [r["layer"] for r in rows] == list(range(config.model.depth))
    for r in rows:
        assert all(np.isfinite(v) for v in r.values())
        assert r["log_kappa_WvWo"] < 1e-4  # the skipless init's κ(WⱽWᴼ) = 1
        assert 0.0 <= r["rel_diff_K_B"] < 1.0
    assert "|K-B|/|K|" in capsys.readouterr().out

    config.model.width, config.model.num_heads = 320, 4  # n·d = 16·320 > 4096
    with pytest.raises(ValueError, match="--jacobian needs n·d <= 4096"):
        analyze.analyze(config, output_dir=str(tmp_path), num_images=1, jacobian=True)


def test_bad_inputs_are_one_line_errors(tmp_path):
    config = tiny_config()
    config.model.init = "glorot"
    with pytest.raises(ValueError, match="model.init='glorot' is unknown; allowed: default, skipless, mimetic"):
        analyze.analyze(config, output_dir=str(tmp_path))
    with pytest.raises(ValueError, match=r"--num_images=100000 must be in \[1, 360\]"):
        analyze.probe_images(tiny_config(), 100000)
    with pytest.raises(ValueError, match="--workdir='.*missing' is not a directory"):
        analyze.analyze(tiny_config(), workdir=str(tmp_path / "missing"))


@pytest.mark.slow
def test_cli_error_is_one_line(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "skipless_jax.analyze", "--config=configs/quickstart.py:init=bogus",
         f"--output_dir={tmp_path}"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: --config=configs/quickstart.py:init=bogus: config arg init='bogus' is not allowed; "
        "allowed: default | skipless | mimetic | timm | mae | orthogonal")


@pytest.mark.slow
def test_analyze_a_dino_run_reads_the_teacher_backbone(tmp_path, tiny_dino_run):
    """A DINO workdir: the EMA teacher's ViT backbone from the checkpoint (what DINO evaluates)."""
    config, workdir = tiny_dino_run  # no skips, skipless init, 3 steps (conftest.py)

    result = analyze.analyze(config, workdir=workdir, output_dir=str(tmp_path / "trained"), num_images=NUM_IMAGES)
    assert (result["source"], result["step"]) == ("checkpoint", 3)
    model, shape = analyze.build(config)
    state = checkpoint.load_raw(workdir)[1]
    teacher, student = state["teacher"]["backbone"], state["params"]["backbone"]
    assert not np.allclose(teacher["embedding"]["kernel"], student["embedding"]["kernel"])
    want = _np_embedding_kappa(model, teacher, analyze.probe_images(config, NUM_IMAGES))
    for point in conditioning.EMBEDDING_POINTS:
        np.testing.assert_allclose(result["log_kappa"][point], want[point], rtol=1e-8)
    # After 3 steps the EMA teacher (momentum 0.996) has moved a little from the init.
    at_init = analyze.analyze(config, output_dir=str(tmp_path / "init"), num_images=NUM_IMAGES)
    assert at_init["source"] == "init"
    assert np.abs(np.array(at_init["log_kappa"]["sab"]) - want["sab"]).max() > 1e-5
