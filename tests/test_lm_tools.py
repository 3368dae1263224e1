"""The tools on a language model's run (evaluate, export, analyze, report, sweep) and its
measures (docs/method/lm_measures.md): excess kurtosis against scipy, fake quantization against
a numpy quantizer, the logit lens at the last block against the model's own loss, the exported
artifact against the validation loss with jax alone, one-line errors.
"""
# ruff: noqa: F811  (the fixtures `environ` and `reference` come from tests/test_lm.py: one finished run, shared)

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
import scipy.stats
from test_lm import _model, environ, reference, tiny_config  # noqa: F401

from skipless_jax import lm_measures
from skipless_jax.data import text
from skipless_jax.models import roles
from skipless_jax.trainers import lm

from util import ROOT, init_params

TABLE = roles.table_of("gpt")
TIMEOUT = 300


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def tiny(request):
    """(model, params, batch, tied): a random depth-2 gpt (width 16, context 8), tied head or not,
    and a batch of 3 windows of which two are short (masked)."""
    tied = request.param
    model = _model(tiny_config(width=16, depth=2, mlp_dim=32, seq_len=8, tied_head=tied))
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, text.VOCAB_SIZE, (3, 9)), jnp.int32)
    mask = jnp.asarray(np.arange(8)[None, :] < np.array([[8], [5], [2]]), jnp.float32)
    params = init_params(model, jax.random.PRNGKey(1), tokens[:, :-1])
    return model, params, {"tokens": tokens, "mask": mask}, tied


def _np_quantize(w: np.ndarray, bits: int, axis: int) -> np.ndarray:
    q = 2 ** (bits - 1) - 1
    scale = np.abs(w).max(axis=axis, keepdims=True) / q
    return np.clip(np.round(w / scale), -q, q) * scale


@pytest.mark.slow
def test_kurtosis_equals_scipy_and_the_logit_lens_at_the_last_block_is_the_models_loss(tiny):
    model, params, batch, tied = tiny
    got = lm_measures.make_measures(model, [batch, batch], TABLE, tied, kurtosis=True, logit_lens=True,
                                    quantize=("int8", "int4"))(params)
    _, out = model.apply({"params": params}, batch["tokens"][:, :-1])
    keep = np.asarray(batch["mask"], bool)
    for layer, block in enumerate(out["blocks"]):
        x = np.asarray(block["output"], np.float64)[keep]  # (positions, d): every feature of a counted position
        want = scipy.stats.kurtosis(np.concatenate([x, x]).ravel(), fisher=True, bias=True)
        assert got[f"kurtosis_layer_{layer}"] == pytest.approx(want, rel=1e-4, abs=1e-5)
    assert got["logit_lens_loss_layer_1"] == pytest.approx(got["loss"], rel=1e-6)
    assert abs(got["logit_lens_loss_layer_0"] - got["loss"]) > 1e-4  # an earlier block reads otherwise
    assert got["int8_loss"] == pytest.approx(got["loss"], rel=1e-3) and got["int8_loss"] != got["loss"]
    bpb = lm_measures.bits_per_byte_of(got, got["loss"], 3.0)
    assert bpb["logit_lens_bits_per_byte_layer_1"] == pytest.approx(3.0, rel=1e-6)
    if tied:  # activations int8 too: another small change of the loss
        both = lm_measures.make_measures(model, [batch], TABLE, tied, quantize=("int8",), activations=True)(params)
        assert both["int8_loss"] == pytest.approx(got["loss"], rel=2e-2) and both["int8_loss"] != got["int8_loss"]


def test_excess_kurtosis_of_power_sums_and_int8_rows_equal_scipy_and_numpy():
    heavy = np.random.default_rng(2).standard_t(5, 4000)
    sums = np.array([heavy.size, *(np.sum(heavy**k) for k in (1, 2, 3, 4))])
    assert lm_measures.excess_kurtosis(sums) == pytest.approx(scipy.stats.kurtosis(heavy), rel=1e-10)
    rows = np.random.default_rng(3).normal(size=(4, 16)).astype(np.float32)  # activations: int8 per token
    np.testing.assert_allclose(lm_measures.fake_quantize(jnp.asarray(rows), 8, -1), _np_quantize(rows, 8, -1),
                               rtol=1e-6, atol=1e-7)


def test_fake_quantized_weights_equal_a_numpy_quantizer(tiny):
    _, params, _, tied = tiny
    trained = {jax.tree_util.keystr(p): np.asarray(v) for p, v in jax.tree_util.tree_leaves_with_path(params)}
    quantize = jax.jit(lm_measures.quantize_params, static_argnums=(1, 2, 3))
    for bits in (8, 4):
        changed = 0
        for path, got in jax.tree_util.tree_leaves_with_path(quantize(params, bits, TABLE, tied)):
            name = jax.tree_util.keystr(path)
            w = trained[name]
            # The position table, biases, norms and an untied head's lookup table: as trained.
            if "pos_embedding" in name or w.ndim < 2 or ("token_embedding" in name and not tied):
                np.testing.assert_array_equal(np.asarray(got), w)
                continue
            axis = -1 if "token_embedding" in name else 0  # a table per vocabulary row, a kernel per output column
            np.testing.assert_allclose(np.asarray(got), _np_quantize(w, bits, axis), rtol=1e-6, atol=1e-7)
            changed += 1
        assert changed == 2 * 6 + 1  # 2 blocks × (query, key, value, out, two MLP kernels) + the head


def test_lm_evals_config_errors_are_one_line():
    lm.check_config(tiny_config())
    for field, value, message in [
        ("lm_evals", dict(kurtosis="yes"), "config.lm_evals.kurtosis='yes' must be True or False"),
        ("lm_evals", dict(quantize="int8,int3"), "'int3' is unknown; allowed: int8, int4"),
        ("lm_evals", dict(quantize_activations=True), "set config.lm_evals.quantize too"),
        ("lm_evals", dict(logits=True), "config.lm_evals.logits is unknown; allowed: ['kurtosis', 'logit_lens'"),
        ("evals", dict(test=dict(type="classification")), "the lm trainer's measures are config.lm_evals"),
    ]:
        bad = tiny_config()
        bad[field] = ml_collections.ConfigDict(value)
        with pytest.raises(ValueError, match=re.escape(message)) as err:
            lm.check_config(bad)
        assert "\n" not in str(err.value)


@pytest.mark.slow
@pytest.mark.parametrize("packing", ["windows", "documents"])
def test_validation_adds_the_measures_config_lm_evals_turns_on(packing):
    c = tiny_config(depth=2, seq_len=8)
    c.dataset.packing = packing
    c.lm_evals.update(dict(kurtosis=True, logit_lens=True, quantize="int4"))
    model = _model(c)
    mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:1])
    params = init_params(model, jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))
    with jax.set_mesh(mesh):
        results = {metric: value for prefix, metric, value in lm.make_validation(model, c, mesh)(params)}
    assert {"loss", "bits_per_byte", "kurtosis_layer_0", "kurtosis_layer_1", "logit_lens_bits_per_byte_layer_0",
            "int4_bits_per_byte"} <= set(results)
    # the measures' pass reads the windows as make_evaluate does (packed documents: their segments)
    assert results["logit_lens_bits_per_byte_layer_1"] == pytest.approx(results["bits_per_byte"], rel=1e-5)


def test_segments_and_positions_inside_the_export_equal_the_pipelines():
    tokens = np.random.default_rng(4).integers(0, 4, (3, 12)).astype(np.int32)  # END_OF_DOCUMENT = 3 here
    got = lm.segments_and_positions(jnp.asarray(tokens), 3)
    for a, b in zip(got, text.segments_and_positions(tokens, 3)):
        np.testing.assert_array_equal(np.asarray(a), b)


# ------------------------------------------------------------------------------------------
# The CLI on the shared finished run (tests/test_lm.py's `reference`: depth 1, 12 steps).


def _tool(name: str, environ: dict[str, str], *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", f"skipless_jax.{name}", *flags], env=environ, cwd=ROOT,
                          capture_output=True, text=True, timeout=TIMEOUT)


def _final(workdir: str) -> dict[str, float]:
    with open(os.path.join(workdir, "final_metrics.json")) as f:
        return json.load(f)


@pytest.mark.slow
def test_evaluate_an_lm_run_with_quantized_weights_and_its_errors(reference, environ, tmp_path):
    run = str(tmp_path / "run")
    subprocess.run(["cp", "-r", reference, run], check=True)  # evaluate writes into the workdir
    ok = _tool("evaluate", environ, f"--workdir={run}", "--quantize=int8,int4")
    assert ok.returncode == 0, ok.stderr[-2000:]
    with open(os.path.join(run, "evaluation.json")) as f:
        got = json.load(f)
    final = _final(reference)
    assert got["val_loss"] == pytest.approx(final["val_loss"], rel=1e-6)
    assert got["val_bits_per_byte"] == pytest.approx(final["val_bits_per_byte"], rel=1e-6)
    assert got["val_int8_bits_per_byte"] == pytest.approx(got["val_bits_per_byte"], rel=1e-3)
    assert got["val_int4_bits_per_byte"] > 0 and math.isfinite(got["val_int4_bits_per_byte"])
    bad = _tool("evaluate", environ, f"--workdir={run}", "--params=ema")  # the lm trainer keeps no EMA
    lines = [line for line in bad.stderr.splitlines() if line.strip()]
    assert bad.returncode != 0 and len(lines) == 1 and "keeps no model EMA" in lines[0], bad.stderr[-2000:]
    with pytest.raises(ValueError, match=re.escape("--quantize='int3': 'int3' is unknown; allowed: int8, int4")):
        lm.with_quantize(tiny_config(), "int3")


@pytest.mark.slow
def test_exported_lm_reproduces_the_validation_loss_with_jax_alone(reference, environ, tmp_path):
    run = str(tmp_path / "run")
    subprocess.run(["cp", "-r", reference, run], check=True)
    ok = _tool("export", environ, f"--workdir={run}", "--examples=all", "--platforms=cpu")
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert ok.stdout.startswith(f"wrote {run}/export: step 12, logits [None, 16, 257] for int32 (B, 16)")
    with open(os.path.join(run, "export", "model.jax"), "rb") as f:
        exported = jax.export.deserialize(bytearray(f.read()))
    examples = np.load(os.path.join(run, "export", "examples.npz"))
    tokens, mask = examples["tokens"], examples["mask"]
    assert tokens.shape == (4, 17) and tokens.dtype == np.int32  # config.dataset.eval_windows
    log_probs = jax.nn.log_softmax(exported.call(tokens[:, :-1]), axis=-1)
    nll = -np.take_along_axis(np.asarray(log_probs, np.float64), tokens[:, 1:, None], axis=-1)[..., 0]
    assert (nll * mask).sum() / mask.sum() == pytest.approx(_final(reference)["val_loss"], abs=1e-5)


@pytest.mark.slow
def test_analyze_an_lm_run_gives_kappa_and_the_measures(reference, environ, tmp_path):
    out = str(tmp_path / "analysis")
    ok = _tool("analyze", environ, f"--workdir={reference}", f"--output_dir={out}", "--num_images=4")
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "mean over 4 validation windows" in ok.stdout and "kurtosis" in ok.stdout
    with open(os.path.join(out, "log_kappa.json")) as f:
        result = json.load(f)
    final, measures = _final(reference), result["measures"]
    assert result["step"] == 12 and len(result["log_kappa"]["sab"]) == 1
    assert np.isfinite(result["log_kappa"]["ffn"]).all()
    assert measures["logit_lens_bits_per_byte_layer_0"] == pytest.approx(final["val_bits_per_byte"], rel=1e-5)
    assert {"kurtosis_layer_0", "int8_bits_per_byte", "int4_bits_per_byte"} <= set(measures)
    bad = _tool("analyze", environ, f"--workdir={reference}", "--jacobian", f"--output_dir={out}")
    lines = [line for line in bad.stderr.splitlines() if line.strip()]
    assert bad.returncode != 0 and len(lines) == 1 and "--jacobian is implemented for image models" in lines[0]


@pytest.mark.slow
def test_report_and_sweep_take_lm_runs(reference, environ, tmp_path):
    runs = tmp_path / "runs"
    runs.mkdir()
    subprocess.run(["cp", "-r", reference, str(runs / "seed=0")], check=True)
    table = _tool("report", environ, str(runs), "--format=csv", "--metrics=val_bits_per_byte")
    assert table.returncode == 0, table.stderr[-2000:]
    header, row = table.stdout.splitlines()[:2]
    assert header.split(",")[-1] == "val_bits_per_byte" and row.startswith("seed=0,")
    assert float(row.split(",")[-1]) == pytest.approx(_final(reference)["val_bits_per_byte"], rel=1e-3)
    plan = _tool("sweep", environ, f"--config={os.path.join(ROOT, 'configs', 'lm_quickstart.py')}", "--grid=claims",
                 f"--root={tmp_path / 'sweep'}", "--launcher=slurm")
    assert plan.returncode == 0, plan.stderr[-2000:]
    assert "runs as an array job" in plan.stdout + plan.stderr and (tmp_path / "sweep" / "sweep_slurm.sh").exists()


def test_evaluate_only_names_the_lm_trainers_own_evaluator():
    from skipless_jax import evaluate

    config = tiny_config()
    assert evaluate.select(config, ["val"]) is config  # the validation (with config.lm_evals' measures)
    with pytest.raises(ValueError, match=re.escape("--only=knn: 'knn' is not an evaluator of the config; "
                                                   "available: ['val']")):
        evaluate.select(config, ["knn"])


def test_the_kappa_probe_attends_within_documents_when_packed_as_documents(monkeypatch):
    """Packed as documents, the κ probe's forward gets the windows' segments and positions (a
    numpy restatement: segment = END_OF_DOCUMENT count so far, position = t − its segment's
    start), as training does; packed as windows, none."""
    from skipless_jax import conditioning

    assert lm.probe_kwargs(tiny_config(), np.zeros((2, 16), np.int32)) == {}
    c = tiny_config()
    c.dataset.packing = "documents"
    c.analysis.every_steps, c.analysis.probe_size = 1, 4
    end = text.segment_end(c)
    windows = np.random.default_rng(0).integers(0, 256, (4, 17)).astype(np.int32)
    windows[0, 5], windows[2, 9], windows[2, 12] = end, end, end  # documents ending inside windows
    monkeypatch.setattr(lm.text, "eval_batches", lambda *args, **kwargs: ([{"tokens": windows}], None))
    mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:1])
    model = _model(c)
    params = init_params(model, jax.random.PRNGKey(0), jnp.zeros((1, 16), jnp.int32))
    inputs = windows[:, :-1]
    segments = np.cumsum(inputs == end, axis=1)
    starts = np.maximum.accumulate(np.where(inputs == end, np.arange(16), 0), axis=1)
    kwargs = lm.probe_kwargs(c, inputs)
    np.testing.assert_array_equal(kwargs["segments"], segments)
    np.testing.assert_array_equal(kwargs["positions"], np.arange(16) - starts)
    with jax.set_mesh(mesh):
        got = lm.make_kappa_probe(model, c, mesh)(params)

    def probe(**kw):
        out = model.apply({"params": params}, jnp.asarray(inputs), train=False, **kw)[1]
        return {f"log_kappa/{n}/layer_{i}": float(v) for n, vals in
                jax.device_get(conditioning.embedding_log_kappa(out)).items() if n in ("sab", "ffn")
                for i, v in enumerate(vals)}

    assert got == probe(segments=jnp.asarray(segments), positions=jnp.asarray(np.arange(16) - starts))
    assert got != probe()  # attending across the documents is another probe
