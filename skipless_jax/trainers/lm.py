"""Causal language-model training, top to bottom: mesh → data → model/optimizer (abstract first)
→ shardings → update step → checkpoint load → evaluation → the loop (trainers/loop.py; docs/method/gpt.md §26).

    python -m skipless_jax.main --config=configs/lm_quickstart.py --workdir=/tmp/lm

The model is the `gpt` family (models/gpt.py: the ViT's blocks with their switches and inits,
causal); the data the packed byte-level windows of data/text.py (the embedded `stdlib` corpus).
The loss is the mean next-token cross-entropy over the batch's targets. Validation (at
`config.eval_every_steps` and at the end): `val_loss` (nats per target token), `val_bits_per_byte`
(the total NLL / (ln 2 · the UTF-8 bytes of the documents the targets cover), every tokenizer;
docs/method/lm.md §1) and `val_perplexity` (exp val_loss), over
`config.dataset.eval_windows` validation windows spread over the split, every target once. `config.analysis.every_steps`
logs the live per-layer log κ of the token matrices (①, ①+②, ③, ③+④; docs/method/papers.md §2) of a
probe batch of validation windows. The final metrics also record the corpus (`corpus_*`: the
Python version, files, bytes, SHA-256). The perf records count tokens, `perf/tokens_per_sec`
(docs/method/lm.md §3).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from absl import logging

from skipless_jax import losses, models, pretrained, sharding, validate
from skipless_jax.checks import is_positive_int, require
from skipless_jax.data import device_input, text
from skipless_jax.models import flops
from skipless_jax.optim import build_optimizer
from skipless_jax.trainers import Trainer, common, loop, nonfinite, perf
from skipless_jax.trainers.run import every
from skipless_jax.trainers.workdir import open_workdir

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
    if config.dataset.get("packing", "windows") == "documents":  # the segment mask runs through unrolled blocks
        require(not config.model.get("scan", False), "config.dataset.packing='documents' needs config.model.scan="
                "False (a scanned encoder takes no segment mask)")
        shape = config.model.get("attention_shape", "softmax")
        require(shape not in ("sas", "sas_p"), f"config.dataset.packing='documents' is not defined for "
                f"config.model.attention_shape={shape!r} (its centring runs over every earlier token); allowed: "
                "'softmax', 'value_skip'")
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
    check_evaluators(config)
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
    """rng -> the state (`common.TrainState`: no running statistics, no model EMA) of the init of
    `model_config` (`models.init_variables`)."""

    def init_state(rng: jax.Array) -> common.TrainState:
        init_rng, train_rng = jax.random.split(rng)
        params = models.init_variables(model_config, model, init_rng, jnp.zeros((1, seq_len), jnp.int32))["params"]
        return common.TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params),
                                 rng=train_rng, nonfinite=nonfinite.init_nonfinite())

    return init_state


def make_train_step(model: Any, tx: optax.GradientTransformation, schedule: optax.Schedule,
                    config: ml_collections.ConfigDict):
    """(state, {'tokens': (B, T + 1)[, 'segments', 'positions': (B, T)]}) -> (state, metrics): the
    mean next-token loss (packed documents: each within its segment, docs/method/lm.md §5),
    gradient accumulation over `config.grad_accum_steps` strided micro-batches
    (`common.microbatches`), the non-finite guard."""
    k = config.get("grad_accum_steps") or 1
    byte_tokens = not config.dataset.get("tokenizer")  # train bits per byte: the loss / ln 2, bytes only

    def loss_fn(params, batch, rng):
        logits, _ = model.apply({"params": params}, batch["tokens"][:, :-1], train=True, rngs={"dropout": rng},
                                **segment_inputs(batch))
        total, count = losses.next_token_loss(logits, batch["tokens"])
        return total / count

    grad_fn = jax.value_and_grad(loss_fn)

    def train_step(state: common.TrainState, batch: dict[str, jax.Array]) -> tuple[common.TrainState, dict]:
        rng = jax.random.fold_in(state.rng, state.step)
        batch = {name: sharding.constrain_batch(value) for name, value in batch.items()}
        if k == 1:
            loss, grads = grad_fn(state.params, batch, rng)
        else:  # equal micro-batches: the mean of their means is the batch's mean
            def accumulate(sums, micro):
                index, part = micro
                value, g = grad_fn(state.params, part, jax.random.fold_in(rng, index))
                return jax.tree.map(jnp.add, sums, (value, g)), None

            zeros = (jnp.zeros(()), jax.tree.map(jnp.zeros_like, state.params))
            micro = {name: common.microbatches(value, k) for name, value in batch.items()}
            sums, _ = jax.lax.scan(accumulate, zeros, (jnp.arange(k), micro))
            loss, grads = jax.tree.map(lambda x: x / k, sums)
        extra = {"bits_per_byte": loss / LN2} if byte_tokens else {}
        return nonfinite.guarded_update(state, loss, grads, tx, schedule, **extra)

    return train_step


def segment_inputs(batch: dict[str, Any]) -> dict[str, Any]:
    """The model's `segments` and `positions` keywords from a packed-documents batch (none otherwise)."""
    return {name: batch[name] for name in ("segments", "positions") if name in batch}


def make_evaluate(model: Any, config: ml_collections.ConfigDict, mesh: jax.sharding.Mesh):
    """params -> [('val', 'loss' | 'bits_per_byte' | 'perplexity', value)] over the validation
    windows (data/text.py `eval_batches`, every target once; docs/method/gpt.md §26)."""
    batch_size = config.input.get("eval_batch_size") or config.input.batch_size
    local, targets = text.eval_batches(text.stream(config, config.dataset.eval_split), config.model.seq_len,
                                       batch_size, config.dataset.get("eval_windows"), jax.process_index(),
                                       jax.process_count(), text.token_bytes(config, config.dataset.eval_split),
                                       text.segment_end(config))
    batch_sharding = sharding.batch_sharding(mesh)

    @jax.jit
    def sums(params, batch):
        logits, _ = model.apply({"params": params}, batch["tokens"][:, :-1], train=False, **segment_inputs(batch))
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
    inputs = local[0]["tokens"][:, :-1]
    batch = device_input.global_batch({"tokens": inputs, **probe_kwargs(config, inputs)}, sharding.batch_sharding(mesh))

    @jax.jit
    def kappa(params):
        tokens, kwargs = batch["tokens"], {k: v for k, v in batch.items() if k != "tokens"}
        return conditioning.embedding_log_kappa(model.apply({"params": params}, tokens, train=False, **kwargs)[1])

    def log_kappa(params: Any) -> dict[str, float]:
        values = jax.device_get(kappa(params))
        return {f"log_kappa/{name}/layer_{layer}": float(v)
                for name, vals in values.items() if name in ("sab", "ffn") for layer, v in enumerate(vals)}

    return log_kappa


def probe_kwargs(config: ml_collections.ConfigDict, inputs: np.ndarray) -> dict[str, np.ndarray]:
    """The model's `segments` and `positions` of input windows packed as documents ({} otherwise),
    so that a probe's forward attends within documents as training does (data/text.py)."""
    end = text.segment_end(config)
    return {} if end is None else dict(zip(("segments", "positions"), text.segments_and_positions(inputs, end)))


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
                 f"{common.num_parameters(abstract_state.params):,}", total_steps, config.input.batch_size,
                 config.model.seq_len)

    # ---- Checkpoint load: workdir > config.resume > scratch.
    mngr, finished = open_workdir(config, workdir, total_steps, allow_config_change)
    if finished is not None:
        return finished
    state = pretrained.restore_or_init(config, workdir, mngr, init_state, rng, abstract_state, shardings)

    # ---- The update step (state donated), the evaluation and the κ probe.
    train_step = jax.jit(make_train_step(model, tx, schedule, config), donate_argnums=0,
                         out_shardings=(shardings, sharding.replicated(mesh)))
    evaluate = make_validation(model, config, mesh)  # and the measures of config.lm_evals
    probe = make_kappa_probe(model, config, mesh)

    # ---- Loop.
    train_step, cost = perf.compile_for(  # and the fit check, before the input pipeline exists
        train_step, state, text.train_batch_spec(config), sharding.batch_sharding(mesh), config)

    def results_at(step: int, state: common.TrainState) -> list[tuple[str, str, float]]:
        return evaluate(state.params) if every(step, config.get("eval_every_steps"), total_steps) else []

    hooks = [] if probe is None else [
        loop.Hook(config.analysis.every_steps, lambda step, state: probe(state.params))]
    return loop.train(config, workdir, mesh, mngr, state, train_step, cost, total_steps=total_steps,
                      guarded=nonfinite.guarded_parts(abstract_state), train_iterator=text.train_iterator,
                      results_at=results_at, eval_every=[config.get("eval_every_steps")], hooks=hooks,
                      metrics=facts)  # the corpus the numbers belong to


def unigram_entropy(config: ml_collections.ConfigDict, split: str | None = None) -> float:
    """Bits per token of the unigram (token-frequency) model of a split (default the eval split):
    the bits per byte a model that ignores context can reach at best (§26)."""
    return text.unigram_entropy_bits(text.stream(config, split or config.dataset.eval_split))


# ----------------------------------------------------------------------------------------
# The tools on a run (evaluate.py, export.py, analyze.py; trainers/__init__.py) and the measures
# of `config.lm_evals` (docs/method/lm_measures.md).

# config.lm_evals: the measures each validation adds, all off by default.
LM_EVALS = dict(kurtosis=False, logit_lens=False, quantize="", quantize_activations=False)  # quantize: "int8,int4"


def parse_formats(value: Any, field: str = "config.lm_evals.quantize") -> tuple[str, ...]:
    """A weight-format list ('int8,int4', or a sequence of names) -> the names; one-line ValueError
    naming `field` for an unknown one."""
    from skipless_jax import lm_measures

    names = tuple(n.strip() for n in (value.split(",") if isinstance(value, str) else value or ()) if n.strip())
    bad = [n for n in names if n not in lm_measures.FORMATS]
    require(not bad, f"{field}={value!r}: {bad[0] if bad else ''!r} is unknown; allowed: "
            f"{', '.join(lm_measures.FORMATS)}")
    return names


def lm_evals(config: ml_collections.ConfigDict) -> dict[str, Any]:
    """`config.lm_evals` over LM_EVALS' defaults, `quantize` parsed; one-line ValueErrors."""
    given = dict(config.get("lm_evals") or {})
    unknown = sorted(set(given) - set(LM_EVALS))
    require(not unknown, f"config.lm_evals.{unknown[0] if unknown else ''} is unknown; allowed: {sorted(LM_EVALS)}")
    out = {**LM_EVALS, **given}
    for field in ("kurtosis", "logit_lens", "quantize_activations"):
        require(isinstance(out[field], bool), f"config.lm_evals.{field}={out[field]!r} must be True or False")
    out["quantize"] = parse_formats(out["quantize"])
    require(out["quantize"] or not out["quantize_activations"], "config.lm_evals.quantize_activations=True "
            "quantizes the activations of a quantized model; set config.lm_evals.quantize too")
    return out


def with_quantize(config: ml_collections.ConfigDict, formats: str) -> ml_collections.ConfigDict:
    """`config` with `config.lm_evals.quantize` = `formats` ('int8,int4', `evaluate --quantize`)."""
    config = ml_collections.ConfigDict(config.to_dict())
    config.lm_evals = ml_collections.ConfigDict({**lm_evals(config), "quantize": ",".join(
        parse_formats(formats, "--quantize"))})
    return config


def check_evaluators(config: ml_collections.ConfigDict) -> None:
    """The lm trainer evaluates validation loss, bits per byte and perplexity, and `config.lm_evals`;
    `config.evals` (the image evaluators) is refused in one line."""
    require(not config.get("evals"), f"config.evals ({', '.join(config.get('evals') or {})}): the image "
            "evaluators do not read token windows; the lm trainer's measures are config.lm_evals "
            f"({', '.join(sorted(LM_EVALS))}; docs/method/lm_measures.md)")
    lm_evals(config)


def validation_windows(config: ml_collections.ConfigDict, mesh: jax.sharding.Mesh) -> list[dict[str, jax.Array]]:
    """The validation windows `make_evaluate` reads ({'tokens': (B, T + 1), 'mask': (B, T)} and, packed
    as documents, the inputs' 'segments' and 'positions'; global batches on the mesh): every target
    of `config.dataset.eval_windows` windows once."""
    batch_size = config.input.get("eval_batch_size") or config.input.batch_size
    local, _ = text.eval_batches(text.stream(config, config.dataset.eval_split), config.model.seq_len, batch_size,
                                 config.dataset.get("eval_windows"), jax.process_index(), jax.process_count(),
                                 end_of_document=text.segment_end(config))
    batch_sharding = sharding.batch_sharding(mesh)
    return [device_input.global_batch({k: b[k] for k in ("tokens", "mask", "segments", "positions") if k in b},
                                      batch_sharding) for b in local]


def make_validation(model: Any, config: ml_collections.ConfigDict, mesh: jax.sharding.Mesh,
                    evals: dict[str, Any] | None = None):
    """params -> `make_evaluate`'s [('val', metric, value)] and, where `evals` (default
    `config.lm_evals`) turns them on, the measures of docs/method/lm_measures.md: 'kurtosis_layer_<l>',
    'logit_lens_{loss,bits_per_byte}_layer_<l>', '<format>_{loss,bits_per_byte}'."""
    from skipless_jax import lm_measures
    from skipless_jax.models import roles

    evaluate = make_evaluate(model, config, mesh)
    evals = lm_evals(config) if evals is None else evals
    if not (evals["kurtosis"] or evals["logit_lens"] or evals["quantize"]):
        return evaluate
    measures = lm_measures.make_measures(
        model, validation_windows(config, mesh), roles.table_of("gpt"), config.model.get("tied_head", True),
        kurtosis=evals["kurtosis"], logit_lens=evals["logit_lens"], quantize=evals["quantize"],
        activations=evals["quantize_activations"])

    def validate(params: Any) -> list[tuple[str, str, float]]:
        results = evaluate(params)
        got = {metric: value for _, metric, value in results}
        found = measures(params)
        extra = lm_measures.bits_per_byte_of(found, found["loss"], got["bits_per_byte"])
        return results + [("val", metric, value) for metric, value in extra.items()]

    return validate


@dataclasses.dataclass(frozen=True)
class Evaluation:
    """What the tools ask of an lm run (trainers/__init__.py): its config, mesh and model. No
    state is kept between evaluation rounds (`new_round`, called by `evaluators.run_all`)."""

    config: ml_collections.ConfigDict
    mesh: jax.sharding.Mesh
    model: Any

    def new_round(self) -> None:
        pass


@dataclasses.dataclass
class Validation:
    """The lm trainer's validation as an evaluator (`evaluators.common.Evaluator`): metrics
    'loss', 'bits_per_byte', 'perplexity' and those of `config.lm_evals`, under the prefix 'val'."""

    validate: Any
    name: str = "val"
    prefix: str = "val"
    every_steps: int | None = None

    def run(self, params: Any, step: int | None = None) -> Iterator[tuple[str, float]]:
        del step
        for _, metric, value in self.validate(params):
            yield metric, value


def evaluation(config: ml_collections.ConfigDict, mesh: jax.sharding.Mesh, model: Any = None,
               picture_dir: str | None = None) -> tuple[Evaluation, str]:
    """(what the tools read of the run, the state entry they evaluate: 'params')."""
    del picture_dir  # nothing is drawn
    return Evaluation(config, mesh, model or models.build(config.model, vocab_size(config))), "params"


def build_evaluators(config: ml_collections.ConfigDict, ctx: Evaluation) -> list[Validation]:
    """The validation of `config` (with `config.lm_evals`' measures), as `evaluate.py` runs it."""
    return [Validation(make_validation(ctx.model, config, ctx.mesh))]


def export_forward(config: ml_collections.ConfigDict, ctx: Evaluation, params: Any) -> tuple[Any, dict[str, Any]]:
    """(int32 tokens (B, T) -> float32 logits (B, T, vocab), the model.json fields of the input
    and output) with `params` as constants; T = `config.model.seq_len`. Packed as documents, the
    segments and positions are computed inside from the tokens (`segments_and_positions`)."""
    seq_len, end = config.model.seq_len, text.segment_end(config)

    def fn(tokens: jax.Array) -> jax.Array:
        kwargs = {} if end is None else dict(zip(("segments", "positions"), segments_and_positions(tokens, end)))
        return ctx.model.apply({"params": params}, tokens, train=False, **kwargs)[0].astype(jnp.float32)

    meta = {"input": {"shape": [None, seq_len], "dtype": "int32", "what": "token windows"},
            "output": "logits", "vocab_size": vocab_size(config), "seq_len": seq_len,
            "tokenizer": config.dataset.get("tokenizer"), "dataset": config.dataset.name,
            "eval_split": config.dataset.eval_split, "packing": config.dataset.get("packing", "windows")}
    return fn, meta


def segments_and_positions(tokens: jax.Array, end_of_document: int) -> tuple[jax.Array, jax.Array]:
    """data/text.py's `segments_and_positions` of int tokens (B, T) in jax (inside an exported
    forward): the segment of t counts END_OF_DOCUMENT at positions ≤ t; its position is t less
    the position where its segment starts (docs/method/lm.md §5)."""
    starts = tokens == end_of_document
    t = jnp.broadcast_to(jnp.arange(tokens.shape[-1], dtype=jnp.int32), tokens.shape)
    first = jax.lax.cummax(jnp.where(starts, t, 0), axis=tokens.ndim - 1)
    return jnp.cumsum(starts, axis=-1, dtype=jnp.int32), t - first


def export_examples(config: ml_collections.ConfigDict, count: int) -> dict[str, np.ndarray]:
    """{'tokens': (N, T + 1) int32, 'mask': (N, T) float32} of the first `count` (-1: all) validation
    windows `make_evaluate` reads: the mean of the target losses under `mask` is its `val_loss`."""
    local, _ = text.eval_batches(text.stream(config, config.dataset.eval_split), config.model.seq_len,
                                 config.input.get("eval_batch_size") or config.input.batch_size,
                                 config.dataset.get("eval_windows"))
    tokens = np.concatenate([b["tokens"] for b in local]).astype(np.int32)
    mask = np.concatenate([b["mask"] for b in local]).astype(np.float32)
    real = mask.any(axis=1)  # rows past the last window are padding
    stop = None if count == -1 else count
    return {"tokens": tokens[real][:stop], "mask": mask[real][:stop]}


def analysis(config: ml_collections.ConfigDict, workdir: str | None, weights: str = "model",
             num_windows: int | None = None) -> dict[str, Any]:
    """What `analyze` reads of an lm run: {'model', 'params' (the newest checkpoint's, else the
    trainer's init for config.seed), 'step', 'source', 'inputs': `num_windows` (default
    config.analysis.probe_size) validation windows spread over the split (N, T), the κ probe of
    `make_kappa_probe`, 'probe' (their description), 'measures': validation loss and bits per byte
    with every measure of docs/method/lm_measures.md (int8 and int4 weights), 'inputs_kwargs': the
    inputs' segments and positions where packed as documents}."""
    from skipless_jax import checkpoint
    from skipless_jax.trainers import model_ema

    models.check_config(config.model, 0)
    model = models.build(config.model, vocab_size(config))
    saved = bool(workdir) and checkpoint.saved_config(workdir) is not None
    model_ema.check_params(weights, checkpoint.state_entries(workdir) if saved else [], workdir or "--config")
    if saved:
        step, state = checkpoint.load_raw(workdir)
        params, source = state["params"], "checkpoint"
    else:
        init = make_init_state(config.model, model, optax.identity(), config.model.seq_len)
        params, step, source = jax.jit(init)(jax.random.PRNGKey(config.seed)).params, 0, "init"
    num_windows = num_windows or (config.get("analysis") or {}).get("probe_size", 8)
    stream = text.stream(config, config.dataset.eval_split)
    require(0 < num_windows <= text.num_windows(len(stream), config.model.seq_len),
            f"--num_images={num_windows} must be in [1, {text.num_windows(len(stream), config.model.seq_len)}] "
            "(the validation split's windows)")
    probe, _ = text.eval_batches(stream, config.model.seq_len, num_windows, num_windows)  # as make_kappa_probe's
    mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.local_devices()[:1])
    evals = {**LM_EVALS, "kurtosis": True, "logit_lens": True, "quantize": ("int8", "int4")}
    with jax.set_mesh(mesh):
        measures = dict((m, v) for _, m, v in make_validation(model, config, mesh, evals)(params))
    inputs = probe[0]["tokens"][:, :-1]
    return {"model": model, "params": params, "step": int(step), "source": source, "inputs": inputs,
            "inputs_kwargs": probe_kwargs(config, inputs),
            "probe": f"{num_windows} validation windows spread over the split", "measures": measures}

def flops_per_example(config: ml_collections.ConfigDict) -> tuple[float, float]:
    """(model FLOPs, 0: no Token Graying) of one training sequence (docs/method/lm.md §3)."""
    return flops.lm_train_flops(config.model, text.tokenizer(config).vocab_size), 0.0


def example_unit(config: ml_collections.ConfigDict) -> tuple[str, int]:
    """An example is a sequence of `config.model.seq_len` tokens (docs/method/lm.md §3)."""
    return "tokens", int(config.model.seq_len)


TRAINER = Trainer(
    "lm", check_config, train_and_evaluate, evaluation, check_evaluators, build_evaluators,
    evaluator_names=lambda config: [Validation.name],
    flops_per_example=flops_per_example, example_unit=example_unit, epoch_steps={}, inputs="tokens",
    build_model=None, backbone_key=None, classifier=False, with_quantize=with_quantize,
    export_forward=export_forward, export_examples=export_examples, analysis=analysis,
    initial_state=lambda config: make_init_state(config.model, models.build(config.model, vocab_size(config)),
                                                 build_optimizer(config, config.total_steps)[0], config.model.seq_len))
