"""Causal language-model training, top to bottom: mesh → data → model/optimizer (abstract first)
→ shardings → update step → checkpoint load → evaluation → the loop (trainers/loop.py; docs/method.md §26).

    python -m skipless_jax.main --config=configs/lm_quickstart.py --workdir=/tmp/lm

The model is the `gpt` family (models/gpt.py: the ViT's blocks with their switches and inits,
causal); the data the packed byte-level windows of data/text.py (the embedded `stdlib` corpus).
The loss is the mean next-token cross-entropy over the batch's targets. Validation (at
`config.eval_every_steps` and at the end): `val_loss` (nats per target token), `val_bits_per_byte`
(the total NLL / (ln 2 · the UTF-8 bytes of the documents the targets cover), every tokenizer;
docs/method/lm.md §1) and `val_perplexity` (exp val_loss), over
`config.dataset.eval_windows` validation windows spread over the split, every target once. `config.analysis.every_steps`
logs the live per-layer log κ of the token matrices (①, ①+②, ③, ③+④; docs/method.md §2) of a
probe batch of validation windows. The final metrics also record the corpus (`corpus_*`: the
Python version, files, bytes, SHA-256). The perf records count tokens, `perf/tokens_per_sec`
(docs/method/lm.md §3).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import optax
from absl import logging

from skipless_jax import losses, models, pretrained, sharding, validate
from skipless_jax.checks import is_positive_int, require
from skipless_jax.data import device_input, text
from skipless_jax.optim import build_optimizer
from skipless_jax.trainers import common, loop, nonfinite, perf
from skipless_jax.trainers.run import every, open_workdir

LN2 = math.log(2.0)


def check_config(config: ml_collections.ConfigDict, num_devices: int | None = None) -> None:
    """Every bad field fails here in one line, before anything compiles or any text is read."""
    trainer = config.get("trainer")
    require(trainer == "lm", f"config.trainer={trainer!r}: this is the lm trainer; allowed: 'lm'")
    require(isinstance(config.get("seed"), int), f"config.seed={config.get('seed')!r} must be an integer")
    text.check_config(config)
    name = config.model.get("name")
    require(name == "gpt", f"config.model.name={name!r}: the lm trainer trains a causal decoder; allowed: 'gpt'")
    models.check_config(config.model, 0)
    for field in ("total_steps", "schedule.warmup_steps"):
        holder, leaf = (config.schedule, "warmup_steps") if "." in field else (config, field)
        value = holder.get(leaf)
        require(is_positive_int(value) or (leaf == "warmup_steps" and value == 0),
                f"config.{field}={value!r} must be a {'non-negative' if leaf == 'warmup_steps' else 'positive'} "
                "integer (the lm trainer counts steps, not epochs)")
    for field in ("total_epochs", "warmup_epochs"):
        holder = config.schedule if field == "warmup_epochs" else config
        require(holder.get(field) is None, f"config.{'schedule.' if holder is not config else ''}{field}="
                f"{holder.get(field)!r}: the lm trainer counts steps; allowed: None")
    require(not config.get("label_smoothing"), f"config.label_smoothing={config.get('label_smoothing')!r}: "
            "the lm loss is the plain cross-entropy; allowed: 0 or None")
    require(not config.get("init_from"), f"config.init_from={config.get('init_from')!r} is not supported by the lm "
            "trainer; allowed: None (config.resume continues a run)")
    num_devices = num_devices or jax.device_count()
    names, sizes = sharding.mesh_shape(config.mesh, num_devices)
    shards = math.prod(s for n, s in zip(names, sizes) if n in sharding.DATA_AXES)
    accum = config.get("grad_accum_steps") or 1
    for field in ("batch_size", "eval_batch_size"):
        batch = config.input.get(field)
        require(batch is None and field == "eval_batch_size" or is_positive_int(batch),
                f"config.input.{field}={batch!r} must be a positive integer")
        if batch:
            require(batch % shards == 0 and batch % jax.process_count() == 0,
                    f"config.input.{field}={batch} is not divisible by the {shards} data-parallel devices and the "
                    f"{jax.process_count()} processes")
    require(is_positive_int(accum) and config.input.batch_size % (accum * shards) == 0,
            f"config.grad_accum_steps={accum!r} must be a positive integer dividing config.input.batch_size"
            f"={config.input.batch_size} into micro-batches divisible by the {shards} data-parallel devices")
    sharding.validate_rules(config.get("sharding_rules", []))
    if config.get("analysis") and config.analysis.get("every_steps"):
        probe = config.analysis.get("probe_size", 8)
        require(is_positive_int(probe) and probe % shards == 0,
                f"config.analysis.probe_size={probe!r} must be a positive integer divisible by the {shards} "
                "data-parallel devices")
    validate.validate_training(config)


def vocab_size(config: ml_collections.ConfigDict) -> int:
    """The tokenizer's symbols and END_OF_DOCUMENT (bytes: 257)."""
    return text.tokenizer(config).vocab_size


def bits_per_byte(loss_nats: float, num_bytes: float | None = None) -> float:
    """Bits per byte (docs/method/lm.md §1): with `num_bytes`, `loss_nats` is the total NLL of
    targets covering that many UTF-8 bytes of the original documents: total / (ln 2 · bytes);
    without, the mean loss per target / ln 2 (bits per target)."""
    return loss_nats / (num_bytes or 1.0) / LN2


def make_init_state(model_config: ml_collections.ConfigDict, model: Any, tx: optax.GradientTransformation,
                    seq_len: int):
    """rng -> the state {step, params, opt_state, rng, nonfinite} (the init of `model_config`,
    `models.init_variables`)."""

    def init_state(rng: jax.Array) -> dict[str, Any]:
        init_rng, train_rng = jax.random.split(rng)
        params = models.init_variables(model_config, model, init_rng, jnp.zeros((1, seq_len), jnp.int32))["params"]
        return {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": tx.init(params),
                "rng": train_rng, "nonfinite": nonfinite.init_nonfinite()}

    return init_state


def make_train_step(model: Any, tx: optax.GradientTransformation, schedule: optax.Schedule,
                    config: ml_collections.ConfigDict):
    """(state, {'tokens': (B, T + 1)}) -> (state, metrics): the mean next-token loss, gradient
    accumulation over `config.grad_accum_steps` strided micro-batches (`common.microbatches`),
    the non-finite guard."""
    k = config.get("grad_accum_steps") or 1
    byte_tokens = not config.dataset.get("tokenizer")  # train bits per byte: the loss / ln 2, bytes only

    def loss_fn(params, tokens, rng):
        logits, _ = model.apply({"params": params}, tokens[:, :-1], train=True, rngs={"dropout": rng})
        total, count = losses.next_token_loss(logits, tokens)
        return total / count

    grad_fn = jax.value_and_grad(loss_fn)

    def train_step(state: dict[str, Any], batch: dict[str, jax.Array]) -> tuple[dict[str, Any], dict[str, jax.Array]]:
        rng = jax.random.fold_in(state["rng"], state["step"])
        tokens = sharding.constrain_batch(batch["tokens"])
        if k == 1:
            loss, grads = grad_fn(state["params"], tokens, rng)
        else:  # equal micro-batches: the mean of their means is the batch's mean
            def accumulate(sums, micro):
                index, part = micro
                value, g = grad_fn(state["params"], part, jax.random.fold_in(rng, index))
                return jax.tree.map(jnp.add, sums, (value, g)), None

            zeros = (jnp.zeros(()), jax.tree.map(jnp.zeros_like, state["params"]))
            sums, _ = jax.lax.scan(accumulate, zeros, (jnp.arange(k), common.microbatches(tokens, k)))
            loss, grads = jax.tree.map(lambda x: x / k, sums)
        extra = {"bits_per_byte": loss / LN2} if byte_tokens else {}
        return nonfinite.guarded_update(state, loss, grads, tx, schedule, **extra)

    return train_step


def make_evaluate(model: Any, config: ml_collections.ConfigDict, mesh: jax.sharding.Mesh):
    """params -> [('val', 'loss' | 'bits_per_byte' | 'perplexity', value)] over the validation
    windows (data/text.py `eval_batches`, every target once; docs/method.md §26)."""
    batch_size = config.input.get("eval_batch_size") or config.input.batch_size
    local, targets = text.eval_batches(text.stream(config, config.dataset.eval_split), config.model.seq_len,
                                       batch_size, config.dataset.get("eval_windows"), jax.process_index(),
                                       jax.process_count(), text.token_bytes(config, config.dataset.eval_split))
    batch_sharding = sharding.batch_sharding(mesh)

    @jax.jit
    def sums(params, batch):
        logits, _ = model.apply({"params": params}, batch["tokens"][:, :-1], train=False)
        total, count = losses.next_token_loss(logits, batch["tokens"], batch["mask"])
        return total, count, batch["bytes"].sum()

    def evaluate(params: Any) -> list[tuple[str, str, float]]:
        total = count = num_bytes = 0.0
        for batch in local:
            s, n, b = jax.device_get(sums(params, device_input.global_batch(batch, batch_sharding)))
            total, count, num_bytes = total + float(s), count + float(n), num_bytes + float(b)
        assert round(count) == targets, (count, targets)  # every validation target exactly once
        loss = total / count
        return [("val", "loss", loss), ("val", "bits_per_byte", bits_per_byte(total, num_bytes)),
                ("val", "perplexity", math.exp(min(loss, 700.0)))]

    return evaluate


def make_kappa_probe(model: Any, config: ml_collections.ConfigDict, mesh: jax.sharding.Mesh):
    """params -> {'log_kappa/<point>/layer_l': value} on `config.analysis.probe_size` validation
    windows spread over the split (config.analysis.every_steps > 0), else None."""
    if not (config.get("analysis") and config.analysis.get("every_steps")):
        return None
    from skipless_jax import conditioning

    probe = config.analysis.get("probe_size", 8)
    local, _ = text.eval_batches(text.stream(config, config.dataset.eval_split), config.model.seq_len, probe,
                                 probe, jax.process_index(), jax.process_count())
    tokens = device_input.global_batch({"tokens": local[0]["tokens"][:, :-1]}, sharding.batch_sharding(mesh))

    @jax.jit
    def kappa(params):
        return conditioning.embedding_log_kappa(model.apply({"params": params}, tokens["tokens"], train=False)[1])

    def log_kappa(params: Any) -> dict[str, float]:
        values = jax.device_get(kappa(params))
        return {f"log_kappa/{name}/layer_{layer}": float(v)
                for name, vals in values.items() if name in ("sab", "ffn") for layer, v in enumerate(vals)}

    return log_kappa


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str, devices: Sequence[jax.Device] | None = None,
                       allow_config_change: bool = False) -> dict[str, Any]:
    """Trains the causal LM of `config` in `workdir` (resuming from it); returns the final metrics.

    Raises `Preempted` after saving when stopped by SIGTERM or a preemption notice.
    """
    mesh = common.setup(config, devices, check_config)
    total_steps = config.total_steps
    facts = text.corpus_facts(config)
    logging.info("Corpus %s: %s", config.dataset.name, facts)

    # ---- Model and optimizer, abstract first.
    model = models.build(config.model, vocab_size(config))
    tx, schedule = build_optimizer(config, total_steps)
    init_state = make_init_state(config.model, model, tx, config.model.seq_len)
    rng, abstract_state, shardings = common.abstract_state(init_state, config, mesh)
    logging.info("GPT: %s parameters, %d train steps of %d × %d tokens.",
                 f"{common.num_parameters(abstract_state['params']):,}", total_steps, config.input.batch_size,
                 config.model.seq_len)

    # ---- Checkpoint load: workdir > config.resume > scratch.
    mngr, finished = open_workdir(config, workdir, total_steps, allow_config_change)
    if finished is not None:
        return finished
    state = pretrained.restore_or_init(config, workdir, mngr, init_state, rng, abstract_state, shardings)

    # ---- The update step (state donated), the evaluation and the κ probe.
    train_step = jax.jit(make_train_step(model, tx, schedule, config), donate_argnums=0,
                         out_shardings=(shardings, sharding.replicated(mesh)))
    evaluate = make_evaluate(model, config, mesh)
    probe = make_kappa_probe(model, config, mesh)

    # ---- Loop.
    train_step, cost = perf.compile_for(  # and the fit check, before the input pipeline exists
        train_step, state, text.train_batch_spec(config), sharding.batch_sharding(mesh), config)

    def results_at(step: int, state: dict[str, Any]) -> list[tuple[str, str, float]]:
        return evaluate(state["params"]) if every(step, config.get("eval_every_steps"), total_steps) else []

    hooks = [] if probe is None else [
        loop.Hook(config.analysis.every_steps, lambda step, state: probe(state["params"]))]
    return loop.train(config, workdir, mesh, mngr, state, train_step, cost, total_steps=total_steps,
                      guarded=nonfinite.guarded_parts(abstract_state), train_iterator=text.train_iterator,
                      results_at=results_at, hooks=hooks, metrics=facts)  # the corpus the numbers belong to


def unigram_entropy(config: ml_collections.ConfigDict, split: str | None = None) -> float:
    """Bits per token of the unigram (token-frequency) model of a split (default the eval split):
    the bits per byte a model that ignores context can reach at best (§26)."""
    return text.unigram_entropy_bits(text.stream(config, split or config.dataset.eval_split))
