"""The language model's numbers as the field defines them (docs/method/lm.md): bits per byte over
the original documents' bytes, generation past the context, causal model FLOPs against maxtext's
formula, GPT-2's init and optimizer defaults, the packing options.
"""

from __future__ import annotations

import math
import os
import shutil

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from skipless_jax import models, sharding
from skipless_jax.data import text
from skipless_jax.trainers import lm

from util import init_params, load_config, one_device

SPLIT_FILES = 40  # two of them (the 20th and the 40th) are the validation split


def tiny_config(arg: str = "", **model: object) -> ml_collections.ConfigDict:
    """configs/lm_quickstart.py shrunk: width 16, depth 1, 2 heads, context 16, batch 8."""
    c = load_config("lm_quickstart", "opt=adamw,steps=6" + ("," + arg if arg else ""))
    c.model.update({**dict(width=16, depth=1, num_heads=2, mlp_dim=32, seq_len=16), **model})
    c.input.batch_size, c.input.eval_batch_size = 8, 8
    c.schedule.warmup_steps = 2
    return c


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A folder of 40 standard-library files (with non-ASCII text, tabs, runs of spaces), read as
    the `stdlib` corpus is (config.dataset.data_dir)."""
    folder = tmp_path_factory.mktemp("corpus")
    for i, name in enumerate(text.stdlib_files()[:SPLIT_FILES]):
        shutil.copy(os.path.join(text.stdlib_root(), name), folder / f"f{i:02d}.py")
    with open(folder / "f19.py", "ab") as f:  # a validation file the default normalizer would change
        f.write("\n\tx  =  'naïve — ünïcode'   \n\n\n".encode())
    return str(folder)


@pytest.fixture(scope="module")
def identity_sentencepiece(corpus, tmp_path_factory):
    """A 400-piece SentencePiece model that round-trips code: the identity normalizer, no dummy
    prefix, whitespace kept, byte fallback."""
    sentencepiece = pytest.importorskip("sentencepiece", reason="needs sentencepiece (requirements-test.txt)")
    folder = tmp_path_factory.mktemp("sp")
    with open(folder / "corpus.txt", "wb") as f:
        for name in sorted(os.listdir(corpus)):
            with open(os.path.join(corpus, name), "rb") as source:
                f.write(source.read())
    sentencepiece.SentencePieceTrainer.train(
        input=str(folder / "corpus.txt"), model_prefix=str(folder / "sp"), vocab_size=400, byte_fallback=True,
        normalization_rule_name="identity", add_dummy_prefix=False, remove_extra_whitespaces=False,
        character_coverage=1.0, minloglevel=2)
    return str(folder / "sp.model")


def _validation_bytes(folder: str) -> int:
    """The UTF-8 bytes of the validation files, read from the files (every 20th of the sorted list)."""
    names = sorted(os.listdir(folder))
    return sum(os.path.getsize(os.path.join(folder, n)) for i, n in enumerate(names) if i % 20 == 19)


def _nll_by_hand(model, params, tokens: np.ndarray, seq_len: int) -> float:
    """The total next-token NLL (nats, float64) of every target of a stream, window by window."""
    apply = jax.jit(lambda p, x: model.apply({"params": p}, x)[0])
    total = 0.0
    for start in range(0, len(tokens) - 1, seq_len):
        piece = np.asarray(tokens[start:start + seq_len + 1], np.int64)
        logits = np.asarray(apply(params, jnp.asarray(piece[None, :-1], jnp.int32))[0], np.float64)
        z = logits - logits.max(-1, keepdims=True)
        logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
        total -= logp[np.arange(len(piece) - 1), piece[1:]].sum()
    return total


@pytest.mark.slow
@pytest.mark.parametrize("tokenizer", ["bytes", "sentencepiece"])
def test_bits_per_byte_divide_by_the_original_documents_bytes(tokenizer, corpus, identity_sentencepiece):
    c = tiny_config()
    c.dataset.update(dict(data_dir=corpus, eval_windows=None))
    if tokenizer == "sentencepiece":
        c.dataset.tokenizer = identity_sentencepiece
        tok = text.tokenizer(c)
        for name in ("f19.py", "f39.py"):  # the identity normalizer round-trips the files
            with open(os.path.join(corpus, name), "rb") as f:
                data = f.read()
            assert tok.decode(tok.encode(data)).encode("utf-8") == data
    lm.check_config(c)
    tok = text.tokenizer(c)
    model = models.build(c.model, tok.vocab_size)
    params = init_params(model, jax.random.PRNGKey(0), jnp.zeros((1, 16), jnp.int32))
    mesh = sharding.make_mesh(c.mesh, one_device())
    metrics = dict(((s, n), v) for s, n, v in lm.make_evaluate(model, c, mesh)(params))
    tokens = text.stream(c, "validation")
    num_bytes = _validation_bytes(corpus)
    np.testing.assert_allclose(text.token_bytes(c, "validation").sum(), num_bytes, rtol=1e-12)
    nll = _nll_by_hand(model, params, tokens, 16)
    assert metrics["val", "loss"] == pytest.approx(nll / (len(tokens) - 1), rel=1e-5)
    assert metrics["val", "bits_per_byte"] == pytest.approx(nll / (math.log(2) * num_bytes), rel=1e-5)


def test_document_weights_share_the_bytes_by_piece_length():
    np.testing.assert_allclose(text.document_weights(10, np.array([1.0, 3.0, 1.0])), [2.0, 6.0, 2.0, 0.0])
    np.testing.assert_allclose(text.document_weights(4, np.zeros(2)), [0.0, 0.0, 4.0])  # pieces without bytes
    np.testing.assert_allclose(text.document_weights(0, np.zeros(0)), [0.0])  # an empty document


def test_eval_batches_count_the_weights_of_their_targets():
    tokens = np.arange(95, dtype=np.uint16)
    weights = np.linspace(0.0, 2.0, 95)
    batches, _ = text.eval_batches(tokens, 10, 4, weights=weights)
    assert sum(float(b["bytes"].sum()) for b in batches) == pytest.approx(weights[1:].sum(), rel=1e-6)
    capped, _ = text.eval_batches(tokens, 10, 4, max_windows=3, weights=weights)  # windows 0, 3, 6
    expected = sum(weights[w * 10 + 1: w * 10 + 11].sum() for w in (0, 3, 6))
    assert sum(float(b["bytes"].sum()) for b in capped) == pytest.approx(expected, rel=1e-6)


# ------------------------------------------------------------------------------------------
# Generation past the context (docs/method/lm.md §2).


def test_the_window_moves_to_the_last_seq_len_minus_one_tokens():
    from skipless_jax.generate import window_start

    assert [window_start(0, n, 4) for n in (1, 4)] == [0, 0]
    assert window_start(0, 5, 4) == 2 and window_start(2, 6, 4) == 2 and window_start(2, 7, 4) == 4
    assert window_start(0, 11, 4) == 8  # a context longer than the window: its last 3 tokens


@pytest.mark.slow
@pytest.mark.parametrize("temperature, top_k", [(0.0, 0), (0.8, 5)])
def test_generation_three_times_the_context_with_the_cache_equals_recompute(temperature, top_k):
    from skipless_jax import generate

    c = tiny_config()
    full, cached = models.build(c.model, text.VOCAB_SIZE), generate.decoder(c.model, text.VOCAB_SIZE)
    params = init_params(full, jax.random.PRNGKey(3), jnp.zeros((1, 16), jnp.int32))
    context = [text.END_OF_DOCUMENT, *text.encode("def ").tolist()]
    new = generate.generate(cached, params, context, 48, temperature, top_k, seed=1)
    assert len(new) == 48
    assert new == generate.generate_by_recompute(full, params, context, 48, temperature, top_k, seed=1)
    long_context = context * 5  # 25 tokens: cropped to the last 15 before the first call
    assert generate.generate(cached, params, long_context, 4) == generate.generate_by_recompute(
        full, params, long_context, 4)


# ------------------------------------------------------------------------------------------
# Model FLOPs and throughput (docs/method/lm.md §3).


def _maxtext_tflops(batch: int, seq: int, emb: int, mlp: int, heads: int, layers: int, vocab: int) -> float:
    """maxtext's calculate_tflops_training_per_device for a dense decoder with one MLP activation
    (h_q = h_kv = heads, head_dim = emb / heads), written as it is there."""
    head_dim = emb // heads
    ffn = 2 * batch * seq * mlp * emb * 1 + 2 * batch * seq * mlp * emb  # ffn1 (one activation), ffn2
    qkv = 2 * batch * seq * emb * (heads + 2 * heads) * head_dim
    projection = 2 * batch * seq * emb * heads * head_dim
    causal_attention = 4 * batch * seq**2 * heads * head_dim / 2
    embedding = 2 * batch * seq * emb * vocab
    learnable = ((ffn + qkv + projection) * layers + embedding) * 3 / 10**12
    return learnable + causal_attention * layers * 3 / 10**12


@pytest.mark.parametrize("sizes", [dict(width=128, depth=4, num_heads=4, mlp_dim=512, seq_len=128),
                                   dict(width=768, depth=12, num_heads=12, mlp_dim=3072, seq_len=1024),
                                   dict(width=2048, depth=24, num_heads=16, mlp_dim=8192, seq_len=2048)])
def test_causal_model_flops_equal_maxtexts_formula(sizes):
    from skipless_jax.models import flops

    c = tiny_config(**sizes)
    ours = 7 * flops.lm_train_flops(c.model, 50257) / 1e12  # a batch of 7
    expected = _maxtext_tflops(7, sizes["seq_len"], sizes["width"], sizes["mlp_dim"], sizes["num_heads"],
                               sizes["depth"], 50257)
    assert ours == pytest.approx(expected, rel=1e-12)


def test_lm_throughput_is_counted_in_tokens():
    from skipless_jax.trainers import perf

    c = tiny_config()  # batch 8 sequences of 16 tokens
    now = [0.0]
    cost = perf.StepCost(flops=1.0, argument_bytes=0, output_bytes=0, alias_bytes=0, temp_bytes=0, devices=2)
    meter = perf.Meter(cost, 8, c, first_step=0, flops_per_example=100.0, clock=lambda: now[0])
    meter.step_done(2)
    fields = meter.fields(6, now=2.0)  # 4 steps of 8 × 16 tokens in 2 s
    assert fields["perf/tokens_per_sec"] == pytest.approx(4 * 8 * 16 / 2, rel=1e-12)
    assert fields["perf/tokens_per_sec_per_device"] == pytest.approx(4 * 8 * 16 / 2 / 2, rel=1e-12)
    assert fields["perf/tflops_per_device"] == pytest.approx(100.0 * 4 * 8 / 2 / 2 / 1e12, rel=1e-12)
    assert not any(k.startswith("perf/img") for k in fields)


# ------------------------------------------------------------------------------------------
# GPT-2's init and optimizer (docs/method/lm.md §4).

# GPT-2's std of each leaf of a depth-2 decoder (L = 2: residual projections 0.02 / √4), by name.
GPT2_STD = {"token_embedding/embedding": 0.02, "pos_embedding": 0.02, "head/kernel": 0.02,
            "MultiHeadAttention_0/query": 0.02, "MultiHeadAttention_0/key": 0.02,
            "MultiHeadAttention_0/value": 0.02, "MultiHeadAttention_0/out": 0.01,
            "MlpBlock_0/Dense_0/kernel": 0.02, "MlpBlock_0/Dense_1/kernel": 0.01}


@pytest.mark.slow
@pytest.mark.parametrize("scan", [False, True])
def test_gpt_default_init_is_gpt2s(scan):
    from skipless_jax.models import init_schemes
    from skipless_jax.nested import flatten

    c = tiny_config(width=64, depth=2, num_heads=2, mlp_dim=128, init="default", tied_head=False, scan=scan)
    model = models.build(c.model, 257)
    key = jax.random.PRNGKey(7)
    params = models.init_variables(c.model, model, key, jnp.zeros((1, 16), jnp.int32))["params"]
    leaves = sorted(flatten(params).items())
    assert len(leaves) == (2 * 16 if not scan else 16) + 6  # blocks; the tables, final norm, head
    for index, (path, value) in enumerate(leaves):
        value = np.asarray(value)
        std = next((s for name, s in GPT2_STD.items() if path.endswith(name)), None)
        if std is not None:  # exactly std × the leaf's standard normal draw (init_schemes.redraw's keys)
            draw = np.asarray(jax.random.normal(jax.random.fold_in(key, index), value.shape))
            np.testing.assert_allclose(value, std * draw, rtol=1e-6, atol=0, err_msg=path)
            assert abs(value.std() / std - 1) < 0.1, path
        elif path.endswith("scale"):
            np.testing.assert_array_equal(value, 1.0, err_msg=path)
        else:
            assert path.endswith("bias"), path
            np.testing.assert_array_equal(value, 0.0, err_msg=path)
    assert init_schemes.redraws(c.model) and not init_schemes.redraws(tiny_config(init="skipless").model)


def test_lm_configs_use_gpt2s_adamw_and_decay_every_matrix():
    from skipless_jax import optim
    from skipless_jax.nested import flatten

    for name in ("lm_quickstart", "lm_gpt2s"):
        opt = load_config(name, "opt=adamw").optimizer
        assert (opt.name, opt.b1, opt.b2, opt.weight_decay, opt.weight_decay_rule) == ("adamw", 0.9, 0.95, 0.1, "ndim")
        c = load_config(name)
        assert c.grad_clip_norm == 1.0 and c.schedule.warmup_steps > 0 and c.optimizer.b2 == 0.95
    c = tiny_config(tied_head=False)
    model = models.build(c.model, 257)
    params = init_params(model, jax.random.PRNGKey(0), jnp.zeros((1, 16), jnp.int32))
    mask = flatten(optim.decay_mask(params, "ndim"))
    assert {p for p, decayed in mask.items() if decayed} == {p for p, v in flatten(params).items() if v.ndim >= 2}
    assert mask["token_embedding/embedding"] and mask["pos_embedding"] and not mask["encoder_norm/scale"]


def test_the_gpt2s_recipes_hardware_time_is_its_flop_count_at_40_percent_mfu():
    """configs/lm_gpt2s.py's docstring: FLOPs per sequence and step, seconds per step on 8 and 1
    H100s at 40% MFU of the bf16 peak, hours for its steps, tokens against its documents."""
    import configs.lm_gpt2s as recipe
    from skipless_jax.models import flops
    from skipless_jax.trainers import devices

    c = load_config("lm_gpt2s")
    per_sequence = flops.lm_train_flops(c.model, text.VOCAB_SIZE)
    step = per_sequence * c.input.batch_size
    peak = devices.PEAK_TFLOPS["NVIDIA H100 80GB HBM3"] * 1e12
    doc = " ".join(recipe.__doc__.split())
    eight, one = step / (8 * peak * 0.4), step / (peak * 0.4)  # seconds per step
    for figure in (f"{per_sequence:.3g}".replace("+", ""), f"{step:.3g}".replace("+", ""),
                   f"{eight:.2g} s per step", f"{eight * c.total_steps / 3600:.2f} hours",
                   f"{one:.2f} s per step", f"{one * c.total_steps / 3600:.1f} hours"):
        assert figure in doc, figure
    tokens = c.total_steps * c.input.batch_size * c.model.seq_len
    assert f"{tokens / 1e9:.2f}B tokens" in doc and c.dataset.name.startswith("c4/en")
    assert 0.9 < c.dataset.max_documents * 2270 / tokens < 1.1  # about one pass (bytes are tokens)


# ------------------------------------------------------------------------------------------
# Packing (docs/method/lm.md §5).

EOD = text.END_OF_DOCUMENT


def test_segments_start_at_each_end_of_document_and_positions_restart():
    inputs = np.array([[5, 6, EOD, 7, 8, 9, EOD, EOD, 4], [EOD, 1, 2, 3, 4, 5, 6, 7, 8]])
    segments, positions = text.segments_and_positions(inputs, EOD)
    np.testing.assert_array_equal(segments, [[0, 0, 1, 1, 1, 1, 2, 3, 3], [1, 1, 1, 1, 1, 1, 1, 1, 1]])
    np.testing.assert_array_equal(positions, [[0, 1, 0, 1, 2, 3, 0, 0, 1], np.arange(9)])


@pytest.mark.slow
def test_segment_masking_equals_running_each_document_alone():
    c = tiny_config(init="default")
    model = models.build(c.model, text.VOCAB_SIZE)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, (2, 16))
    tokens[0, [4, 11]] = EOD  # three documents: [0, 4), [4, 11), [11, 16)
    tokens[1, 0] = EOD  # one document
    params = init_params(model, jax.random.PRNGKey(1), jnp.zeros((1, 16), jnp.int32))
    segments, positions = text.segments_and_positions(tokens, EOD)
    packed = np.asarray(model.apply({"params": params}, jnp.asarray(tokens), segments=jnp.asarray(segments),
                                    positions=jnp.asarray(positions))[0])
    for row, bounds in ((0, (0, 4, 11, 16)), (1, (0, 16))):
        for start, stop in zip(bounds, bounds[1:]):
            alone = np.asarray(model.apply({"params": params}, jnp.asarray(tokens[row:row + 1, start:stop]))[0])
            np.testing.assert_allclose(packed[row, start:stop], alone[0], rtol=1e-5, atol=1e-5)
    across = np.asarray(model.apply({"params": params}, jnp.asarray(tokens))[0])  # 'windows': across documents
    assert np.abs(across[0, 4:] - packed[0, 4:]).max() > 1e-3


def test_random_offsets_depend_on_seed_and_epoch_and_resume_exactly():
    tokens = np.arange(1000, dtype=np.uint16) % 251  # no END_OF_DOCUMENT: a token's value gives its position mod 251
    seq, batch, windows = 10, 8, (1000 - 10) // 10  # 99 windows of every epoch, at the epoch's offset
    whole = text.train_batches(tokens, seq, batch, seed=3, random_offsets=True)
    first = [next(whole)["tokens"] for _ in range(40)]  # 320 positions: more than 3 epochs
    offsets = [text.epoch_offset(3, e, seq) for e in range(4)]
    assert len(set(offsets)) > 1 and offsets == [text.epoch_offset(3, e, seq) for e in range(4)]
    assert [text.epoch_offset(4, e, seq) for e in range(4)] != offsets
    for step, b in enumerate(first):
        for k, row in enumerate(b):
            epoch, i = divmod(step * batch + k, windows)
            w = int(text.epoch_order(3, epoch, windows)[i])
            np.testing.assert_array_equal(row, tokens[offsets[epoch] + w * seq: offsets[epoch] + w * seq + seq + 1])
    resumed = text.train_batches(tokens, seq, batch, seed=3, start_step=17, random_offsets=True)
    for step in range(17, 40):
        np.testing.assert_array_equal(next(resumed)["tokens"], first[step])


@pytest.mark.slow
def test_a_documents_packed_run_with_random_offsets_trains_and_is_checked(tmp_path):
    c = tiny_config()
    c.dataset.update(dict(packing="documents", random_offsets=True, eval_windows=4))
    c.total_steps, c.log_every_steps, c.checkpoint_every_steps, c.profile_steps = 2, 1, 0, 0
    spec = text.train_batch_spec(c)
    assert spec["segments"] == ((8, 16), np.dtype(np.int32)) == spec["positions"]
    batch = next(text.train_iterator(c, 0, 0, 1))
    np.testing.assert_array_equal(batch["segments"], text.segments_and_positions(batch["tokens"][:, :-1], EOD)[0])
    metrics = lm.train_and_evaluate(c, str(tmp_path / "workdir"), devices=one_device())
    assert metrics["step"] == 2 and np.isfinite(metrics["val_loss"])
    for field, value, message in [
        ("dataset.packing", "sequences", r"config.dataset.packing='sequences' is unknown; allowed: \['windows'"),
        ("model.scan", True, r"config.dataset.packing='documents' needs config.model.scan=False"),
    ]:
        bad = c.copy_and_resolve_references()
        section, leaf = field.split(".")
        bad[section][leaf] = value
        with pytest.raises(ValueError, match=message):
            lm.check_config(bad)
