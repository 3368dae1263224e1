"""The deep-skipless LM arms (docs/method/skipless_lm.md): Value-SkipInit, SAS, SAS-P, the
orthogonal init and Muon, each against a float64 numpy restatement of its source and with the
machinery (causal mask, KV cache, scan/remat, bf16, sharding, exact resume, roles)."""

from __future__ import annotations

import math
import os

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from test_scaling import scaling

from skipless_jax import models
from skipless_jax.models import vit
from skipless_jax.nested import flatten
from skipless_jax.optim import decay_mask, muon_labels

import subprocess_runs as sr
from util import ROOT, init_params, load_config

WIDTH, HEADS, DEPTH, SEQ, VOCAB = 16, 2, 2, 8, 257
# attention_shape -> (skip_sab, skip_ffn) of the study's cell (SAS keeps its MLP skip, §2)
ARMS = {"value_skip": (False, False), "sas": (False, True), "sas_p": (False, False)}


def arm_config(shape: str, **fields: object) -> ml_collections.ConfigDict:
    sab, ffn = ARMS[shape]
    return ml_collections.ConfigDict(dict(
        name="gpt", width=WIDTH, depth=DEPTH, num_heads=HEADS, mlp_dim=2 * WIDTH, seq_len=SEQ, attention_shape=shape,
        skip_sab=sab, skip_ffn=ffn, **{"init": "default", **fields}))


def tokens(seed: int = 0, batch: int = 2) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).integers(0, VOCAB, (batch, SEQ)), jnp.int32)


def random_params(model, seed: int = 0):
    """The init's parameters moved off their special values (zero queries, unit gains) at random."""
    params = init_params(model, jax.random.PRNGKey(seed), tokens())
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.PRNGKey(seed + 1), len(leaves))
    return jax.tree.unflatten(tree, [x + 0.3 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])


# ------------------------------------------------------------------------------------------
# float64 numpy restatements (docs/method/skipless_lm.md §1-§3; model_utils.py for SAS, SAS-P).


def np_layer_norm(x, p, eps=1e-6):
    mean, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * p["scale"] + p["bias"]


def np_mlp(x, p):
    h = x @ p["Dense_0"]["kernel"] + p["Dense_0"]["bias"]
    h = 0.5 * h * (1 + np.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h**3)))  # tanh GELU
    return h @ p["Dense_1"]["kernel"] + p["Dense_1"]["bias"]


def np_attention_matrices(q, k, p, shape):
    """(T, d) queries and keys -> (h, T, T): model_utils.py's `_attn` with skipless.yaml's gains
    (SAS: β softmax + α I − γ C, C the uniform causal matrix) or Value-SkipInit's α I + β A."""
    t, d = q.shape
    dh = d // HEADS
    out = []
    causal = np.tril(np.ones((t, t), bool))
    uniform = np.tril(np.ones((t, t))) / np.arange(1, t + 1)[:, None]  # uniform_causal_attn_mat
    for h in range(HEADS):
        logits = q[:, h * dh:(h + 1) * dh] @ k[:, h * dh:(h + 1) * dh].T / math.sqrt(dh)
        logits = np.where(causal, logits, -np.inf)
        a = np.exp(logits - logits.max(-1, keepdims=True))
        a /= a.sum(-1, keepdims=True)
        m = p["attn_resid_gain"][h] * a + p["attn_skip_gain"][h] * np.eye(t)
        if shape != "value_skip":
            m = m - p["centre_gain"][h] * uniform
        out.append(m)
    return np.stack(out)


def np_heads(mats, v):
    dh = v.shape[1] // HEADS
    return np.concatenate([mats[h] @ v[:, h * dh:(h + 1) * dh] for h in range(HEADS)], axis=1)


def np_block(x, p, shape, layer):
    a = p["MultiHeadAttention_0"]
    y = np_layer_norm(x, p["LayerNorm_0"])
    q, k = y @ a["query"] + a["query_bias"], y @ a["key"] + a["key_bias"]
    if shape == "value_skip":  # the family's attention, its matrix αI + βA; no skips in this cell
        v = y @ a["value"] + a["value_bias"]
        z = np_heads(np_attention_matrices(q, k, a, shape), v) @ a["out"] + a["out_bias"]
        return np_mlp(np_layer_norm(z, p["LayerNorm_1"]), p["MlpBlock_0"])
    # SAS / SAS-P: V = X (r W + s I) in block 0 (first_layer_value_resid_gain), X elsewhere; no projection
    v = y @ (a["value_resid_gain"] * a["value"] + a["value_skip_gain"] * np.eye(WIDTH)) if layer == 0 else y
    attn = p["attn_branch_gain"] * np_heads(np_attention_matrices(q, k, a, shape), v)
    if shape == "sas_p":  # parallel: g_M MLP(N1(x)) + g_A SA(N1(x))
        return p["mlp_branch_gain"] * np_mlp(y, p["MlpBlock_0"]) + attn
    return p["mlp_branch_gain"] * np_mlp(np_layer_norm(attn, p["LayerNorm_1"]), p["MlpBlock_0"]) + \
        p["mlp_skip_gain"] * attn


def np_logits(params, toks, shape):
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    table = p["token_embedding"]["embedding"]
    x = table[np.asarray(toks)] + p["pos_embedding"][:toks.shape[1]]
    out = []
    for row in x:
        for layer in range(DEPTH):
            row = np_block(row, p[f"block_{layer}"], shape, layer)
        out.append(np_layer_norm(row, p["encoder_norm"]) @ table.T)
    return np.stack(out)


@pytest.mark.parametrize("shape", sorted(ARMS))
def test_forward_equals_the_float64_restatement_of_its_source(shape):
    model = models.build(arm_config(shape), VOCAB)
    params, toks = random_params(model), tokens()
    logits = np.asarray(jax.jit(lambda p, x: model.apply({"params": p}, x)[0])(params, toks))
    np.testing.assert_allclose(logits, np_logits(params, toks, shape), rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("shape", ["sas", "sas_p"])
def test_shaped_attention_starts_as_the_identity(shape):
    """At init Q = 0: A = C, so βA + αI − γC = I (model_utils.py with skipless.yaml): each block's
    attention branch is its normed input (block 0: X(0·W + 1·I))."""
    model = models.build(arm_config(shape), VOCAB)
    params = init_params(model, jax.random.PRNGKey(0), tokens())
    _, out = model.apply({"params": params}, tokens())
    for layer, block in enumerate(out["blocks"]):
        x = out["embedding"] if layer == 0 else out["blocks"][layer - 1]["output"]
        norm = jax.tree.map(np.asarray, params[f"block_{layer}"]["LayerNorm_0"])
        normed = np_layer_norm(np.asarray(x, np.float64), norm)
        np.testing.assert_allclose(np.asarray(block["sab"]), normed, atol=1e-5)


# ------------------------------------------------------------------------------------------
# The machinery.


@pytest.mark.parametrize("shape", sorted(ARMS))
def test_logits_at_t_do_not_depend_on_later_tokens(shape):
    model = models.build(arm_config(shape), VOCAB)
    params, toks = random_params(model), tokens()
    apply = jax.jit(lambda p, x: model.apply({"params": p}, x)[0])
    base = np.asarray(apply(params, toks))
    for t in (0, 4):
        other = np.asarray(apply(params, toks.at[:, t + 1:].set((toks[:, t + 1:] + 7) % VOCAB)))
        np.testing.assert_allclose(other[:, :t + 1], base[:, :t + 1], rtol=0, atol=1e-5)
        assert np.abs(other[:, t + 1:] - base[:, t + 1:]).max() > 1e-4


@pytest.mark.parametrize("shape", ["sas", "value_skip"])
def test_packed_documents_give_each_document_its_own_logits(shape):
    """Two documents in one window (segments, positions restarting): each one's logits equal those
    of the document alone, so C averages over the query's own document (docs/method/skipless_lm.md §2)."""
    model = models.build(arm_config(shape), VOCAB)
    params, toks = random_params(model), tokens(batch=1)
    segments = jnp.asarray([[0, 0, 0, 1, 1, 1, 1, 1]])
    positions = jnp.asarray([[0, 1, 2, 0, 1, 2, 3, 4]])
    apply = jax.jit(lambda x, s=None, q=None: model.apply({"params": params}, x, segments=s, positions=q)[0])
    packed = np.asarray(apply(toks, segments, positions))
    for part in (slice(0, 3), slice(3, 8)):
        alone = np.asarray(apply(toks[:, part]))
        np.testing.assert_allclose(packed[:, part], alone, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("shape", sorted(ARMS))
def test_the_kv_cache_gives_the_logits_of_the_whole_window(shape):
    """Chunks of 3, 2, 1, 1, 1 tokens through the cache: each query reads its rows of I and C."""
    config = arm_config(shape)
    full = models.build(config, VOCAB)
    cached = models.build(ml_collections.ConfigDict({**config.to_dict(), "decode": True}), VOCAB)
    params, toks = random_params(full), tokens(batch=1)
    expected = np.asarray(full.apply({"params": params}, toks)[0])
    cache = jax.tree.map(jnp.zeros_like, jax.eval_shape(lambda: cached.init(jax.random.PRNGKey(0), toks))["cache"])
    step = jax.jit(lambda c, x: cached.apply({"params": params, "cache": c}, x, mutable=["cache"]))
    got, at = [], 0
    for n in (3, 2, 1, 1, 1):
        (logits, _), updated = step(cache, toks[:, at:at + n])
        cache, at = updated["cache"], at + n
        got.append(np.asarray(logits))
    np.testing.assert_allclose(np.concatenate(got, axis=1), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("shape", ["sas", "value_skip"])
def test_scanned_and_rematerialised_blocks_equal_the_unrolled_ones(shape):
    """SAS's block 0 reads the scanned layer index: logits and gradients equal the unrolled model's."""
    unrolled = models.build(arm_config(shape), VOCAB)
    scanned = models.build(arm_config(shape, scan=True, remat="full"), VOCAB)
    params, toks = random_params(unrolled), tokens()

    def loss(model, p):
        return model.apply({"params": p}, toks)[0].astype(jnp.float32).std()

    value, grads = jax.jit(jax.value_and_grad(lambda p: loss(unrolled, p)))(params)
    value_s, grads_s = jax.jit(jax.value_and_grad(lambda p: loss(scanned, p)))(vit.stack_blocks(params))
    assert float(value_s) == pytest.approx(float(value), rel=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), vit.unstack_blocks(grads_s),
                 grads)
    if shape == "sas":  # the unused value reparameterisation of blocks ≥ 1 gets no gradient
        assert not np.any(np.asarray(grads["block_1"]["MultiHeadAttention_0"]["value"]))
        assert np.any(np.asarray(grads["block_0"]["MultiHeadAttention_0"]["value"]))


@pytest.mark.parametrize("shape", ["sas", "sas_p"])
def test_bfloat16_computes_in_bfloat16_close_to_float32(shape):
    f32 = models.build(arm_config(shape), VOCAB)
    bf16 = models.build(arm_config(shape, dtype="bfloat16"), VOCAB)
    params, toks = random_params(f32), tokens()
    logits, out = jax.jit(lambda p, x: bf16.apply({"params": p}, x))(params, toks)
    assert out["blocks"][1]["sab"].dtype == jnp.bfloat16 and out["blocks"][1]["output"].dtype == jnp.bfloat16
    reference = np.asarray(f32.apply({"params": params}, toks)[0])
    assert np.abs(np.asarray(logits) - reference).max() < 0.05 * np.abs(reference).max()


# ------------------------------------------------------------------------------------------
# Roles, weight decay, Muon's split, the orthogonal init, config errors.


def test_gains_have_their_role_and_no_weight_decay_and_take_adamw_under_muon():
    """train_utils.MyTrainer: no decay on names with "gain", norms, biases; SAS's value W decayed."""
    model = models.build(arm_config("sas"), VOCAB)
    params = init_params(model, jax.random.PRNGKey(0), tokens())
    decayed, labels = flatten(decay_mask(params)), flatten(muon_labels(params))
    gains = [p for p in flatten(params) if p.endswith("_gain")]
    assert len(gains) == DEPTH * 8 and all(models.role_of(p) == "gain" for p in gains)
    assert not any(decayed[p] for p in gains) and all(labels[p] == "adam" for p in gains)
    value = "block_0/MultiHeadAttention_0/value"
    assert decayed[value] and labels[value] == "muon"
    assert labels["block_1/MlpBlock_0/Dense_0/kernel"] == labels["block_0/MultiHeadAttention_0/key"] == "muon"
    for adam in ("token_embedding/embedding", "pos_embedding", "encoder_norm/scale", "block_0/MlpBlock_0/Dense_0/bias"):
        assert labels[adam] == "adam", adam


def test_muon_orthogonalises_the_hidden_matrices_and_adamw_moves_the_rest():
    """One step from zero momentum: a hidden (d, d) update is −lr·(Newton–Schulz of the gradient),
    near-orthogonal (singular values in optax's NS band); an AdamW leaf moves by −lr·ratio·sign(g)
    (Adam's first step), a scanned (L, d, d) leaf layer by layer."""
    from skipless_jax.optim import build_optimizer

    c = ml_collections.ConfigDict(dict(
        optimizer=dict(name="muon", lr=0.1, adam_lr_ratio=0.01, weight_decay=0.0, b1=0.9, b2=0.95, nesterov=False),
        schedule=dict(warmup_steps=0, end_lr=0.1), grad_clip_norm=0.0, model=dict(name="gpt", depth=2)))
    tx, _ = build_optimizer(c, total_steps=10)
    rng = np.random.default_rng(0)
    params = {"block_0": {"MultiHeadAttention_0": {"query": jnp.zeros((16, 16))}},
              "encoder_layers": {"block": {"MlpBlock_0": {"Dense_0": {"kernel": jnp.zeros((2, 16, 32))}}}},
              "token_embedding": {"embedding": jnp.zeros((5, 16))}}
    grads = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), params)
    updates, _ = tx.update(grads, tx.init(params), params)
    s = np.linalg.svd(-np.asarray(updates["block_0"]["MultiHeadAttention_0"]["query"]) / 0.1, compute_uv=False)
    assert s.min() > 0.6 and s.max() < 1.3, s
    stacked = -np.asarray(updates["encoder_layers"]["block"]["MlpBlock_0"]["Dense_0"]["kernel"]) / 0.1
    for layer in stacked:  # (16, 32): rows near-orthonormal, scaled by √max(1, 32/16)
        s = np.linalg.svd(layer / math.sqrt(2), compute_uv=False)
        assert s.min() > 0.6 and s.max() < 1.3, s
    np.testing.assert_allclose(np.asarray(updates["token_embedding"]["embedding"]),
                               -0.1 * 0.01 * np.sign(np.asarray(grads["token_embedding"]["embedding"])), rtol=1e-3)


def test_the_orthogonal_init_draws_norm_preserving_kernels():
    model = models.build(arm_config("value_skip", init="orthogonal"), VOCAB)
    params = init_params(model, jax.random.PRNGKey(0), tokens())
    block = jax.tree.map(np.asarray, params["block_0"])
    for name in ("query", "key", "value", "out"):
        w = block["MultiHeadAttention_0"][name]
        np.testing.assert_allclose(w.T @ w, np.eye(WIDTH), atol=1e-5)
    up, down = block["MlpBlock_0"]["Dense_0"]["kernel"], block["MlpBlock_0"]["Dense_1"]["kernel"]
    np.testing.assert_allclose(np.linalg.svd(up, compute_uv=False), math.sqrt(2), rtol=1e-5)  # d -> 2d
    np.testing.assert_allclose(down.T @ down, np.eye(WIDTH), atol=1e-5)  # 2d -> d: orthonormal columns
    assert not np.any(block["MlpBlock_0"]["Dense_0"]["bias"]) and not np.any(block["MultiHeadAttention_0"]["out_bias"])


@pytest.mark.parametrize("fields, match", [
    (dict(attention_shape="sas", skip_sab=True), r"attention_shape='sas' has skip_sab=False, skip_ffn=True; got"),
    (dict(attention_shape="sas_p", skip_ffn=True), r"attention_shape='sas_p' has skip_sab=False, skip_ffn=False"),
    (dict(attention_shape="shaped"), r"attention_shape='shaped' is unknown; allowed: 'softmax', 'value_skip'"),
    (dict(attention_shape="sas", mlp_branch_gain=0), r"mlp_branch_gain=0 must be a finite number > 0"),
])
def test_bad_arm_fields_are_one_line_errors(fields, match):
    config = arm_config("sas")
    config.update(fields)
    with pytest.raises(ValueError, match=match):
        models.check_config(config, None)


def test_the_vit_family_has_value_skipinit_and_refuses_sas():
    """Value-SkipInit in the ViT: with α = 0, β = 1 it is the softmax model on the same parameters."""
    from util import tiny_config

    c = tiny_config()
    c.model.attention_shape = "sas"
    with pytest.raises(ValueError, match=r"attention_shape='sas' is not defined for the 'vit' family"):
        models.check_config(c.model, 32)
    c.model.attention_shape = "value_skip"
    models.check_config(c.model, 32)
    from flax.traverse_util import flatten_dict, unflatten_dict

    shaped, plain = models.build(c.model, 10), models.build({**c.model.to_dict(), "attention_shape": "softmax"}, 10)
    images = jnp.asarray(np.random.default_rng(0).normal(size=(2, 32, 32, 3)), jnp.float32)
    flat = flatten_dict(init_params(shaped, jax.random.PRNGKey(0), images), sep="/")
    softmax = {k: jnp.zeros_like(v) if k.endswith("attn_skip_gain") else v for k, v in flat.items()}  # α = 0, β = 1

    def features(model, params):
        return np.asarray(model.apply({"params": unflatten_dict(params, sep="/")}, images)[1]["pre_logits"])

    expected = features(plain, {k: v for k, v in flat.items() if not k.endswith("_gain")})
    np.testing.assert_allclose(features(shaped, softmax), expected, atol=1e-5)
    assert np.abs(features(shaped, flat) - expected).max() > 1e-3  # α = 1: the identity added


# ------------------------------------------------------------------------------------------
# Sharding and exact resume (the lm trainer, SAS + Muon).


def _lm_config(arg: str = "") -> ml_collections.ConfigDict:
    c = load_config("lm_quickstart", "opt=muon,skip_sab=False,skip_ffn=True,init=default" + ("," + arg if arg else ""))
    c.model.update(dict(width=128, depth=1, num_heads=4, mlp_dim=512, seq_len=64, attention_shape="sas"))
    c.input.batch_size = 256  # Newton–Schulz runs whole on every device: enough model work to divide (as SOAP's)
    return c


def _flops(program) -> float:
    cost = program.compile().cost_analysis()
    return float((cost[0] if isinstance(cost, (list, tuple)) else cost)["flops"])


@pytest.mark.slow
def test_sas_muon_step_flops_per_device_fall_eightfold():
    c = _lm_config()
    one, eight = _flops(scaling.lm_program(c, {"data": 1})), _flops(scaling.lm_program(c, {"data": 8}))
    assert eight <= 0.13 * one, eight / one


STEPS, EVERY, TIMEOUT = 8, 4, 300
RUN = [f"--config.total_steps={STEPS}", f"--config.checkpoint_every_steps={EVERY}", "--config.keep_checkpoints=2",
       "--config.model.width=16", "--config.model.depth=2", "--config.model.num_heads=2", "--config.model.mlp_dim=32",
       "--config.model.seq_len=8", "--config.input.batch_size=4", "--config.input.eval_batch_size=4",
       "--config.dataset.eval_windows=4", "--config.schedule.warmup_steps=2", "--config.log_every_steps=4",
       "--config.eval_every_steps=0", "--config.lm_evals.kurtosis=False", "--config.lm_evals.logit_lens=False",
       "--config.lm_evals.quantize=", "--config.profile_steps=0"]
CONFIG = os.path.join(ROOT, "configs", "lm_skipless_study.py:attention_shape=sas,opt=muon,init=orthogonal,val=True")


@pytest.mark.slow
def test_a_killed_sas_muon_run_resumes_to_the_uninterrupted_state(tmp_path):
    from skipless_jax import checkpoint

    environ = sr.env(1, cache_dir=str(tmp_path / "jax_cache"))
    reference = str(tmp_path / "reference")
    sr.run(sr.command(reference, RUN, config=CONFIG), environ, str(tmp_path / "reference.log"), TIMEOUT)
    workdir = str(tmp_path / "run")
    sr.killed_then_rerun(workdir, sr.command(workdir, RUN, config=CONFIG), environ, str(tmp_path), EVERY, STEPS,
                         TIMEOUT)
    _, state = checkpoint.load_raw(workdir, STEPS)
    _, expected = checkpoint.load_raw(reference, STEPS)
    for part in ("params", "opt_state", "rng", "nonfinite"):
        jax.tree.map(np.testing.assert_array_equal, state[part], expected[part])


STUDY = os.path.join(ROOT, "configs", "lm_skipless_study.py")


def test_the_study_screens_seven_cells_and_its_claims_name_those_cells():
    """42 screening runs (7 cells × 3 lrs × 2 seeds) whose configs pass the model's check; every
    claim's cell is one of them but for val (the claims read the confirmation, val=False)."""
    from skipless_jax import claims, report, sweep

    module = sweep.load_config_module(STUDY)
    runs = [report.run_args(r.name) for r in sweep.expand(STUDY, "screen", module)]
    assert len(runs) == 42 and {r["val"] for r in runs} == {"True"} and {r["depth"] for r in runs} == {"8"}
    for cell in {tuple((k, v) for k, v in r.items() if k not in ("lr", "seed")) for r in runs}:
        c = module.get_config(",".join(f"{k}={v}" for k, v in cell))
        models.check_config(c.model, None)
        assert c.input.batch_size == 8 and c.total_steps == 2000 and c.eval_every_steps == 100
    qs = claims.from_module(module, path=STUDY)
    families = {"noninferior", "steps_5x", "steps_2x", "int4_loss", "int8_loss", "kurtosis", "head_to_head"}
    assert {c.family for c in qs} == families and len(qs) == 6 * 6 + 2
    for c in qs:
        assert (c.alternative, c.per) == ("greater", ("depth",))
        for cell in (c.a, c.b):
            assert cell["val"] == "False"
            screened = [r for r in runs if all(r.get(k) == v for k, v in {**cell, "val": "True"}.items())]
            assert len(screened) == 6, (c.name, cell)
    steps = [c for c in qs if c.kind == "steps"]
    assert {(c.target_step, round(2 ** c.margin, 9)) for c in steps} == {(400, 5.0), (400, 2.0)}
