"""The causal language model: the gpt family's causality and KV cache, the byte corpus and its
packing, the lm trainer's loss and bits per byte against hand and float64 references, its step's
scaling over 8 fake devices, exact resume after SIGKILL, one-line config errors, generation's CLI.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from test_scaling import scaling

from skipless_jax import losses, models
from skipless_jax.data import text
from skipless_jax.trainers import lm

import subprocess_runs as sr
from util import ROOT, init_params, load_config, one_device, read_scalars

QUICKSTART = os.path.join(ROOT, "configs", "lm_quickstart.py")


def tiny_config(arg: str = "", **model: object) -> ml_collections.ConfigDict:
    """configs/lm_quickstart.py shrunk: width 32, depth 1, 2 heads, context 16, batch 8, 4 windows of validation."""
    c = load_config("lm_quickstart", "opt=adamw,steps=6" + ("," + arg if arg else ""))
    c.model.update({**dict(width=32, depth=1, num_heads=2, mlp_dim=64, seq_len=16), **model})
    c.input.batch_size, c.input.eval_batch_size = 8, 8
    c.dataset.eval_windows = 4
    c.schedule.warmup_steps = 2
    c.log_every_steps, c.checkpoint_every_steps, c.profile_steps = 2, 0, 0
    return c


def _model(c, **fields):
    cfg = ml_collections.ConfigDict(c.model.to_dict())
    cfg.update(fields)
    return models.build(cfg, text.VOCAB_SIZE)


# ------------------------------------------------------------------------------------------
# The model.


@pytest.mark.slow
@pytest.mark.parametrize("impl", [None, "xla"])  # the implementations XLA:CPU has (cudnn: NVIDIA GPUs only)
@pytest.mark.parametrize("init", ["skipless", "default"])
def test_logits_at_t_do_not_depend_on_later_tokens(impl, init):
    c = tiny_config(f"init={init}", attention_impl=impl)
    model = _model(c)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 257, (2, 16)), jnp.int32)
    params = init_params(model, jax.random.PRNGKey(0), tokens)
    apply = jax.jit(lambda p, x: model.apply({"params": p}, x)[0])
    base = np.asarray(apply(params, tokens))
    for t in (0, 5, 14):
        changed = tokens.at[:, t + 1:].set((tokens[:, t + 1:] + 7) % 257)
        other = np.asarray(apply(params, changed))
        np.testing.assert_allclose(other[:, : t + 1], base[:, : t + 1], rtol=0, atol=1e-5)
        assert np.abs(other[:, t + 1:] - base[:, t + 1:]).max() > 1e-4  # later positions do see the change


@pytest.mark.slow
def test_scan_and_untied_head_build_and_are_causal():
    c = tiny_config(scan=True, tied_head=False, remat="full")
    model = _model(c)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 257, (1, 16)), jnp.int32)
    params = init_params(model, jax.random.PRNGKey(0), tokens)
    assert "head" in params and "encoder_layers" in params
    base = model.apply({"params": params}, tokens)[0]
    other = model.apply({"params": params}, tokens.at[:, 9].set(3))[0]
    np.testing.assert_allclose(other[:, :9], base[:, :9], atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("temperature, top_k", [(0.0, 0), (0.8, 5)])
def test_generation_with_the_cache_equals_recomputing_the_prefix(temperature, top_k):
    from skipless_jax import generate

    c = tiny_config()
    full, cached = _model(c), generate.decoder(c.model, text.VOCAB_SIZE)
    context = [text.END_OF_DOCUMENT, *text.encode("def ").tolist()]
    params = init_params(full, jax.random.PRNGKey(3), jnp.zeros((1, 16), jnp.int32))
    new = generate.generate(cached, params, context, 8, temperature, top_k, seed=1)
    again = generate.generate_by_recompute(full, params, context, 8, temperature, top_k, seed=1)
    assert new == again and len(new) == 8


def test_describe_and_check_config_errors():
    c = tiny_config(depth=2)  # two blocks: the layer ids of both
    d = models.describe(c.model)
    assert (d.family, d.depth, d.width, d.prefix_tokens, d.grid_tokens) == ("gpt", 2, 32, 0, False)
    assert d.layer_id("token_embedding/embedding") == 0 and d.layer_id("block_1/x") == 2
    assert d.layer_id("encoder_norm/scale") == 3
    cases = {
        "model.token_graying": ("svd", r"Token Graying pre-conditions image patches"),
        "model.num_heads": (3, r"config.model.num_heads=3 does not divide config.model.width=32"),
        "model.init": ("timm", r"config.model.init='timm' is not defined for the 'gpt' family"),
        "model.attention_impl": ("flash", r"config.model.attention_impl='flash' is unknown"),
        "model.causal": (False, r"config.model.causal=False: the decoder is causal"),
        "model.name": ("vit", r"config.model.name='vit': the lm trainer trains a causal decoder"),
        "dataset.name": ("", r"config.dataset.name='' must name a text corpus"),
        "dataset.tokenizer": ("/no/such.model", r"config.dataset.tokenizer='/no/such.model': no such SentencePiece"),
        "dataset.max_documents": (0, r"config.dataset.max_documents=0 must be a positive integer"),
        "dataset.eval_split": ("test", r"config.dataset.eval_split='test' is unknown"),
        "total_epochs": (3, r"config.total_epochs=3: the lm trainer counts steps"),
        "input.batch_size": (6, r"config.input.batch_size=6 is not divisible by the 8 data-parallel devices"),
        "grad_accum_steps": (3, r"config.grad_accum_steps=3 must be a positive integer dividing"),
        "optimizer.lr": (-1.0, r"config.optimizer.lr=-1.0 must be a finite number > 0"),
    }
    for field, (value, message) in cases.items():
        bad = tiny_config()
        holder, *_ = [bad]
        *parents, leaf = field.split(".")
        for parent in parents:
            holder = holder[parent]
        holder[leaf] = value
        with pytest.raises(ValueError, match=message) as err:
            lm.check_config(bad)
        assert "\n" not in str(err.value)
    lm.check_config(tiny_config())


# ------------------------------------------------------------------------------------------
# The corpus and its packing.


def test_corpus_files_split_by_file_and_streams_end_documents():
    files = text.stdlib_files()
    assert list(files) == sorted(files) and all(f.endswith(".py") for f in files)
    assert not any(part in f.split("/") for f in files for part in text.EXCLUDED_DIRS)
    train, val = text.split_files(files, "train"), text.split_files(files, "validation")
    assert not set(train) & set(val) and len(train) + len(val) == len(files)
    assert len(val) == len(files) // text.VALIDATION_EVERY
    c = tiny_config()
    for split, names in (("train", train), ("validation", val)):
        stream = text.stream(c, split)
        assert int((stream == text.END_OF_DOCUMENT).sum()) == len(names) + 1  # each document after one
    facts = text.corpus_facts(c)
    assert facts["corpus_python"] == sys.version.split()[0] and facts["corpus_files"] == len(files)
    assert facts["corpus_bytes"] == sum(os.path.getsize(os.path.join(text.stdlib_root(), f)) for f in files)
    assert len(facts["corpus_sha256"]) == 64


def test_packing_windows_depend_on_seed_and_position_and_split_over_processes():
    tokens = np.arange(1000, dtype=np.uint16) % 257
    seq, batch = 10, 8
    whole = text.train_batches(tokens, seq, batch, seed=3)
    first = [next(whole)["tokens"] for _ in range(20)]  # 160 positions: more than one epoch of 99 windows
    for b in first:
        assert b.shape == (batch, seq + 1)
        for row in b:  # a window of the stream: consecutive tokens
            np.testing.assert_array_equal(np.diff(row.astype(int)) % 257, 1)
    resumed = text.train_batches(tokens, seq, batch, seed=3, start_step=7)
    np.testing.assert_array_equal(next(resumed)["tokens"], first[7])
    halves = [text.train_batches(tokens, seq, batch, seed=3, start_step=5, process_index=p, process_count=2)
              for p in range(2)]
    np.testing.assert_array_equal(np.concatenate([next(h)["tokens"] for h in halves]), first[5])
    epoch = np.concatenate(first)[:99, 0]
    assert sorted(epoch.tolist()) == sorted(((np.arange(99) * seq) % 257).tolist())  # every window once per epoch
    other = next(text.train_batches(tokens, seq, batch, seed=4))["tokens"]
    assert not np.array_equal(other, first[0])


def test_eval_batches_count_every_target_once():
    tokens = np.arange(95, dtype=np.uint16)
    batches, targets = text.eval_batches(tokens, 10, 4)
    assert targets == 94  # every token but the first is a target
    masked = [int(t) for b in batches for row, m in zip(b["tokens"], b["mask"]) for t in row[1:][m > 0]]
    assert masked == list(range(1, 95))
    two = [text.eval_batches(tokens, 10, 4, process_index=p, process_count=2)[0] for p in range(2)]
    for b, (x, y) in zip(batches, zip(*two)):
        np.testing.assert_array_equal(np.concatenate([x["mask"], y["mask"]]), b["mask"])
    capped, n = text.eval_batches(tokens, 10, 4, max_windows=3)
    assert n == 30 and sum(b["mask"].sum() for b in capped) == 30


# ------------------------------------------------------------------------------------------
# Loss, bits per byte, perplexity.


def test_the_loss_equals_a_float64_cross_entropy():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((3, 5, 257)) * 3
    tokens = rng.integers(0, 257, (3, 6))
    mask = (rng.random((3, 5)) < 0.7).astype(np.float32)
    total, count = losses.next_token_loss(jnp.asarray(logits, jnp.float32), jnp.asarray(tokens), jnp.asarray(mask))
    z = logits - logits.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    nll = -np.take_along_axis(logp, tokens[:, 1:, None], -1)[..., 0]
    np.testing.assert_allclose(float(total), (nll * mask).sum(), rtol=1e-5)
    assert float(count) == mask.sum()


def test_bits_per_byte_by_hand():
    # Two targets with probabilities 1/2 and 1/4: 1 and 2 bits, 1.5 bits per byte.
    logits = np.full((1, 2, 257), -1e9, np.float32)
    logits[0, 0, [7, 8]] = math.log(0.5)
    logits[0, 1, [9, 10, 11, 12]] = math.log(0.25)
    total, count = losses.next_token_loss(jnp.asarray(logits), jnp.asarray([[0, 7, 9]]))
    loss = float(total / count)
    assert lm.bits_per_byte(loss) == pytest.approx(1.5, abs=1e-6)
    assert math.exp(loss) == pytest.approx(math.sqrt(8), rel=1e-6)  # perplexity 2^1.5
    assert lm.bits_per_byte(math.log(257)) == pytest.approx(math.log2(257))
    assert text.unigram_entropy_bits(np.array([0, 0, 1, 2])) == pytest.approx(1.5)


# ------------------------------------------------------------------------------------------
# Scale over 8 fake devices.


def _lm_scaling_config(opt: str = "adamw"):
    c = tiny_config(f"opt={opt}")
    c.model.update(dict(width=128, depth=1, num_heads=4, mlp_dim=512, seq_len=64))
    # SOAP's factor refreshes (eigh, QR) run whole on every device: a batch big enough that the
    # model's work, which divides, dominates them; refreshed every step so that they are compiled.
    c.input.batch_size = 256 if opt == "soap" else 64
    if opt == "soap":
        c.optimizer.precondition_frequency = 1
    return c


def _flops(program) -> float:
    cost = program.compile().cost_analysis()
    return float((cost[0] if isinstance(cost, (list, tuple)) else cost)["flops"])


@pytest.mark.slow
@pytest.mark.parametrize("opt, mesh", [("adamw", {"data": 8}), ("adamw", {"fsdp": 8}), ("soap", {"data": 8})])
def test_lm_step_flops_per_device_fall_eightfold(opt, mesh):
    c = _lm_scaling_config(opt)
    one = _flops(scaling.lm_program(c, {"data": 1}))
    eight = _flops(scaling.lm_program(c, mesh))
    assert eight <= 0.13 * one, (opt, mesh, eight / one)


@pytest.mark.slow
def test_accumulated_micro_batches_equal_the_whole_batch_and_a_nonfinite_step_is_held():
    """The lm step with grad_accum_steps=2 gives the loss and update of one step on the whole
    batch (dropout off: equal micro-batches' mean of means is the batch mean); a step whose
    loss is NaN keeps the parameters and optimizer state and counts itself."""
    c = tiny_config()
    c.total_steps, c.skip_nonfinite_steps = 10, True
    one = scaling.lm_program(c, {"data": 1})
    accumulated = c.copy_and_resolve_references()
    accumulated.grad_accum_steps = 2
    two = scaling.lm_program(accumulated, {"data": 1})
    batch = scaling.random_batch(one)
    (s1, m1), (s2, m2) = one.run(one.init(), one.batch(batch)), two.run(two.init(), two.batch(batch))
    assert float(m2["loss"]) == pytest.approx(float(m1["loss"]), rel=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7),
                 s1.params, s2.params)

    state = one.init()
    before = jax.tree.map(np.asarray, {"params": state.params, "opt_state": state.opt_state})
    state = state.replace(params=jax.tree.map(lambda x: x.at[(0,) * x.ndim].set(jnp.nan) if x.ndim else x,
                                              state.params))
    poisoned = jax.tree.map(np.asarray, state.params)
    held, metrics = one.run(state, one.batch(batch))
    assert not np.isfinite(float(metrics["loss"])) and int(metrics["nonfinite_steps"]) == 1
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), held.params, poisoned)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), held.opt_state, before["opt_state"])
    assert int(held.step) == 1


# ------------------------------------------------------------------------------------------
# The trainer's runs (CLI in subprocesses).

STEPS, EVERY = 12, 4
RUN = [f"--config.total_steps={STEPS}", f"--config.checkpoint_every_steps={EVERY}", "--config.keep_checkpoints=2",
       "--config.model.width=32", "--config.model.depth=1", "--config.model.num_heads=2", "--config.model.mlp_dim=64",
       "--config.model.seq_len=16", "--config.input.batch_size=8", "--config.input.eval_batch_size=8",
       "--config.dataset.eval_windows=4", "--config.schedule.warmup_steps=2", "--config.log_every_steps=4",
       "--config.profile_steps=0"]
CONFIG = f"{QUICKSTART}:opt=adamw"
TIMEOUT = 300


@pytest.fixture(scope="module")
def environ(tmp_path_factory):
    return sr.env(1, cache_dir=os.path.join(sr.session_dir(tmp_path_factory), "jax_cache"))


@pytest.fixture(scope="module")
def reference(tmp_path_factory, environ):
    workdir = os.path.join(sr.session_dir(tmp_path_factory), "lm_uninterrupted")
    with sr.file_lock(workdir + ".lock"):
        if not os.path.exists(workdir + ".done"):
            sr.run(sr.command(workdir, RUN, config=CONFIG), environ, workdir + ".log", TIMEOUT)
            open(workdir + ".done", "w").close()
    return workdir


@pytest.mark.slow
def test_a_run_records_validation_metrics_and_the_corpus(reference):
    import json

    with open(os.path.join(reference, "final_metrics.json")) as f:
        final = json.load(f)
    assert final["step"] == STEPS
    assert final["val_bits_per_byte"] == pytest.approx(final["val_loss"] / math.log(2))
    assert final["val_perplexity"] == pytest.approx(math.exp(final["val_loss"]))
    assert final["val_loss"] < math.log(257)  # below a uniform guess after 12 steps
    assert final["corpus_python"] == sys.version.split()[0] and len(final["corpus_sha256"]) == 64
    # the perf records: model FLOPs of a sequence (models.flops) at the measured throughput
    from skipless_jax.models import flops

    scalars = read_scalars(reference)
    config = load_config("lm_quickstart", "opt=adamw")
    config.model.update(dict(width=32, depth=1, num_heads=2, mlp_dim=64, seq_len=16))
    per_sequence = flops.lm_train_flops(config.model, text.VOCAB_SIZE)
    assert scalars["perf/tflops_per_device"]
    for step, tflops in scalars["perf/tflops_per_device"].items():
        rate = scalars["perf/tokens_per_sec_per_device"][step] / 16  # sequences of 16 tokens
        assert tflops == pytest.approx(per_sequence * rate / 1e12, rel=1e-4)


@pytest.mark.slow
def test_sigkill_then_restart_equals_uninterrupted(tmp_path, environ, reference):
    from skipless_jax import checkpoint

    workdir = str(tmp_path / "run")
    saved, out = sr.killed_then_rerun(workdir, sr.command(workdir, RUN, config=CONFIG), environ, str(tmp_path), EVERY,
                                      STEPS, TIMEOUT)
    assert f"at step {saved}." in out
    _, state = checkpoint.load_raw(workdir, STEPS)
    _, expected = checkpoint.load_raw(reference, STEPS)
    for part in ("params", "opt_state", "rng", "nonfinite"):
        jax.tree.map(np.testing.assert_array_equal, state[part], expected[part])


@pytest.mark.slow
def test_generate_cli_prints_text_and_errors_in_one_line(reference, environ, tmp_path):
    def generate(*flags):
        return subprocess.run([sys.executable, "-m", "skipless_jax.generate", *flags], env=environ, cwd=ROOT,
                              capture_output=True, text=True, timeout=TIMEOUT)

    # 50 tokens from a 16-position model (docs/method/lm.md §2): the text of the same greedy tokens in-process
    from skipless_jax import generate as generate_lib

    ok = generate(f"--workdir={reference}", "--prompt=def ", "--max_new_tokens=50", "--temperature=0")
    assert ok.returncode == 0, ok.stderr[-2000:]
    config, params = generate_lib.load(reference)
    context = [text.END_OF_DOCUMENT, *text.encode("def ").tolist()]
    new = generate_lib.generate(generate_lib.decoder(config.model, text.VOCAB_SIZE), params, context, 50)
    assert len(new) == 50 and ok.stdout == "def " + text.decode(new) + "\n"
    for flags, message in [
        ((f"--workdir={tmp_path / 'none'}",), "no such directory"),
        ((f"--workdir={tmp_path}",), "holds no checkpoint with a saved config"),
        ((f"--workdir={reference}", "--top_k=-2"), "--top_k=-2 must be >= 0"),
        ((f"--workdir={reference}", "--max_new_tokens=0"), "--max_new_tokens=0 must be at least 1"),
        (("--workdir",), "Missing value for flag --workdir"),
    ]:
        bad = generate(*flags)
        lines = [line for line in bad.stderr.splitlines() if line.strip()]
        assert bad.returncode == 2 and len(lines) == 1 and message in lines[0], (flags, bad.stderr[-2000:])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["lm_quickstart", "lm_gpt2s"])
def test_lm_config_trains_one_step(name, tmp_path):
    c = load_config(name)
    c.model.update(dict(width=32, depth=1, num_heads=2, mlp_dim=64, seq_len=16))  # dtype, remat as configured
    c.dataset.update(dict(name="stdlib", max_documents=None))  # the embedded corpus for lm_gpt2s's C4
    c.input.batch_size = c.input.eval_batch_size = 8
    c.dataset.eval_windows = 2
    c.total_steps, c.schedule.warmup_steps, c.grad_accum_steps = 1, 0, 1
    c.log_every_steps, c.eval_every_steps, c.checkpoint_every_steps, c.profile_steps = 1, 0, 0, 0
    c.analysis.update(dict(every_steps=1, probe_size=8))  # the live log κ of the token matrices
    metrics = lm.train_and_evaluate(c, str(tmp_path / "workdir"), devices=one_device())
    assert metrics["step"] == 1 and np.isfinite(metrics["val_loss"])
    kappa = read_scalars(str(tmp_path / "workdir"))
    assert {"log_kappa/sab/layer_0", "log_kappa/ffn/layer_0"} <= set(kappa)
    assert np.isfinite(kappa["log_kappa/sab/layer_0"][1]) and kappa["log_kappa/sab/layer_0"][1] >= 0
    assert abs(metrics["val_loss"] - math.log(257)) < 0.5 * math.log(257)  # near a uniform guess after one step


# ------------------------------------------------------------------------------------------
# TFDS text datasets and a SentencePiece tokenizer.


@pytest.fixture(scope="module")
def sentencepiece_model(tmp_path_factory):
    """A 600-piece SentencePiece model (byte fallback) trained on a few standard-library files."""
    sentencepiece = pytest.importorskip("sentencepiece", reason="needs sentencepiece (requirements-test.txt)")
    folder = tmp_path_factory.mktemp("sp")
    with open(folder / "corpus.txt", "wb") as f:
        for name in text.stdlib_files()[:40]:
            with open(os.path.join(text.stdlib_root(), name), "rb") as source:
                f.write(source.read())
    sentencepiece.SentencePieceTrainer.train(
        input=str(folder / "corpus.txt"), model_prefix=str(folder / "sp"), vocab_size=600, byte_fallback=True,
        character_coverage=0.995, minloglevel=2)
    return str(folder / "sp.model")


@pytest.mark.slow
def test_sentencepiece_tokens_their_byte_lengths_and_a_tfds_run(sentencepiece_model, tmp_path, monkeypatch):
    import tensorflow_datasets as tfds

    c = tiny_config()
    c.dataset.update(dict(name="lm1b", train_split="train", eval_split="test", tokenizer=sentencepiece_model,
                          max_documents=16, eval_windows=4))
    tok = text.tokenizer(c)
    assert (tok.vocab_size, tok.end_of_document) == (601, 600)
    sentence = "the value of the list is returned"
    ids = tok.encode(sentence.encode())
    assert tok.decode(ids) == sentence
    # Every piece's bytes, '▁' a space: the sentence and the one leading space SentencePiece adds.
    assert tok.bytes_per_token[ids].sum() == len(sentence) + 1
    with tfds.testing.mock_data(num_examples=16, policy=tfds.testing.MockPolicy.USE_CODE):
        monkeypatch.setattr(tfds.core.DatasetBuilder, "is_prepared", lambda self: True)
        lm.check_config(c)
        stream = text.stream(c, "train")
        assert int((stream == 600).sum()) == 17  # 16 documents, each after one
        c.total_steps, c.schedule.warmup_steps = 1, 0
        metrics = lm.train_and_evaluate(c, str(tmp_path / "workdir"), devices=one_device())
        batches, targets = text.eval_batches(text.stream(c, "test"), 16, 8, 4,
                                             weights=text.token_bytes(c, "test"))
    num_bytes = sum(float(b["bytes"].sum()) for b in batches)
    assert metrics["corpus_tfds"] == "lm1b" and len(metrics["corpus_tokenizer_sha256"]) == 64
    # Bits per byte: the total nats over the targets' bytes of the documents / ln 2, not the loss / ln 2.
    assert metrics["val_bits_per_byte"] == pytest.approx(metrics["val_loss"] * targets / num_bytes / math.log(2),
                                                         rel=1e-5)
    assert "train_bits_per_byte" not in metrics


@pytest.mark.slow
def test_the_lm_claims_name_cells_of_the_claims_grid():
    """Every cell of every lm claim is 5 seeds at each depth of the `claims` grid, judged on
    validation bits per byte (lower is better), trained below half of ln 256."""
    from skipless_jax import claims, report, sweep

    module = sweep.load_config_module(QUICKSTART)
    runs = [report.run_args(r.name) for r in sweep.expand(QUICKSTART, "claims", module)]
    assert len(runs) == 50  # no skips: 2 inits × 2 optimizers, with skips: 1; × 2 depths × 5 seeds
    qs = claims.from_module(module, path=QUICKSTART)
    assert [c.name for c in qs] == ["init_beats_default_adamw", "init_soap_matches_skips", "soap_beats_adamw_init"]
    for c in qs:
        assert c.metric == "val_bits_per_byte" and c.per == ("depth",)
        assert c.trained_below == pytest.approx(0.5 * math.log(256))
        for cell in (c.a, c.b):
            for depth in ("4", "8"):
                matching = [r for r in runs if r["depth"] == depth and all(r.get(k) == v for k, v in cell.items())]
                assert len(matching) == 5, (c.name, cell, depth)
    alternatives = {c.name: (c.alternative, c.margin) for c in qs}
    assert alternatives == {"init_beats_default_adamw": ("less", 0.0), "init_soap_matches_skips": ("greater", 0.05),
                            "soap_beats_adamw_init": ("less", 0.0)}
