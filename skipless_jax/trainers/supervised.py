"""Supervised training, top to bottom: mesh → data → model/optimizer (abstract first) →
shardings → update step → checkpoint load → evaluators → the loop (trainers/loop.py).

    python -m skipless_jax.main --config=configs/quickstart.py --workdir=/tmp/quickstart

`config.init_from` loads the parameters of another run (a supervised run, a DINO teacher with
`config.init_from_key='teacher'`) whose names match after `warm_start.classifier_rename`; the classifier
head keeps its initialization when the source has none.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import optax
from absl import logging

from skipless_jax import checkpoint, evaluators, losses, models, pretrained, rng_streams, sharding, validate
from skipless_jax.data import device_images, device_mix, inputs, sources
from skipless_jax.models import flops
from skipless_jax.optim import build_optimizer
from skipless_jax.trainers import common, image_geometry, image_trainer, loop, model_ema, nonfinite, perf, warm_start
from skipless_jax.trainers.workdir import open_workdir

EVALUATOR_TYPES = (
    "classification", "knn", "linear_probe", "tokencut", "linear_segmentation", "feature_pca", "fewshot", "dino_linear",
)


def check_config(config: ml_collections.ConfigDict, num_devices: int | None = None) -> None:
    """Everything that can be wrong with a config or its data fails here, before compiling."""
    validate.validate_config(config, num_devices)
    evaluators.check_config(config, EVALUATOR_TYPES)
    model_ema.check_config(config)
    evaluators.check_data(config)


def make_init_state(model_config: ml_collections.ConfigDict, model: Any, tx: optax.GradientTransformation,
                    dummy: jax.Array, ema: bool = False) -> Callable[[jax.Array], Any]:
    """rng -> the trainer's state (`common.TrainState`) of `model` (built from `model_config`, its
    init `models.init_variables`) for inputs shaped like `dummy`; `batch_stats` when the model
    keeps running statistics; `ema` (model EMA, trainers/model_ema.py) a copy of params [and
    batch_stats]."""

    def init_state(rng: jax.Array) -> common.TrainState:
        init_rng, train_rng = jax.random.split(rng)
        variables = models.init_variables(model_config, model, init_rng, dummy)
        params = variables["params"]
        state = common.TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params),
                                  rng=train_rng, nonfinite=nonfinite.init_nonfinite(),
                                  batch_stats=variables.get("batch_stats"))
        return state.replace(ema=model_ema.init(state)) if ema else state

    return init_state


def build(config: ml_collections.ConfigDict) -> tuple[Any, optax.GradientTransformation, optax.Schedule,
                                                       Callable[[jax.Array], common.TrainState], float | None]:
    """(model, optimizer, its schedule, rng -> the fresh train state, the β set from
    `config.model.init_self_share` or None) of `config`. β goes into the model built here, not
    into the config saved with the run."""
    info, image_size = sources.dataset_info(config.dataset.name), inputs.image_size(config)
    model_config, init_beta = models.apply_init_self_share(config.model, image_size)
    model = models.build(model_config, info.num_classes)
    tx, schedule = build_optimizer(config, *common.train_steps(config, inputs.steps_per_epoch(config)))
    dummy = jnp.zeros((1, image_size, image_size, info.image_shape[-1]), jnp.float32)
    init_state = make_init_state(model_config, model, tx, dummy, ema=model_ema.enabled(config))
    return model, tx, schedule, init_state, init_beta


def initial_state(config: ml_collections.ConfigDict) -> Callable[[jax.Array], common.TrainState]:
    """rng -> the fresh train state of `config`, as `train_and_evaluate` builds it."""
    return build(config)[3]


def make_train_step(
    model: Any, tx: optax.GradientTransformation, schedule: optax.Schedule, config: ml_collections.ConfigDict
):
    """(state, {'image', 'label'}) -> (state, metrics); mixup/cutmix of each device's shard
    of the batch first when `device_mix.enabled(config)`; gradient accumulation over
    `config.grad_accum_steps` equal strided micro-batches (examples j, j + k, ...: each is split
    over every device like the batch); a non-finite update is rejected; the model EMA, if the
    state keeps one, moves after each kept update. A state with
    `batch_stats` (running BatchNorm statistics) has them updated by each (micro-)batch in turn,
    from the batch statistics over the whole global (micro-)batch."""
    smoothing = config.get("label_smoothing", 0.0)
    microbatches = config.get("grad_accum_steps") or 1
    mix = device_mix.enabled(config)
    mean, std = device_images.dataset_stats(config)

    def loss_fn(params, stats, images, labels, rng):
        if stats is None:
            (logits, _), new_stats = model.apply({"params": params}, images, train=True, rngs={"dropout": rng}), None
        else:
            (logits, _), updated = model.apply({"params": params, "batch_stats": stats}, images, train=True,
                                               rngs={"dropout": rng}, mutable=["batch_stats"])
            new_stats = updated["batch_stats"]
        loss = losses.cross_entropy(logits, labels, smoothing).mean()
        return loss, ((logits.argmax(-1) == labels.argmax(-1)).mean(), new_stats)

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def train_step(state: common.TrainState, batch: dict[str, jax.Array]) -> tuple[common.TrainState, dict]:
        step, params, stats = state.step, state.params, state.batch_stats
        dropout_rng = jax.random.fold_in(state.rng, step)
        # uint8 from the host: normalized (and randomly erased) here, over the global batch
        batch = device_images.prepare(batch, mean, std, jax.random.fold_in(dropout_rng, rng_streams.ERASE))
        batch = {**batch, "image": sharding.constrain_batch(batch["image"])}
        if mix:  # mixup/cutmix per device shard: draws from (seed, step, shard), pairs within the shard
            images, labels = device_mix.mixup_cutmix(
                jax.random.fold_in(dropout_rng, rng_streams.MIX), batch["image"], batch["label"], config.input.aug)
            batch = {**batch, "image": sharding.constrain_batch(images), "label": sharding.constrain_batch(labels)}
        if microbatches == 1:
            (loss, (accuracy, stats)), grads = grad_fn(params, stats, batch["image"], batch["label"], dropout_rng)
        else:  # gradient accumulation: the mean over equal micro-batches of the global batch
            split = lambda x: common.microbatches(x, microbatches)  # strided: each keeps the batch sharding

            def accumulate(carry, micro):
                sums, micro_stats = carry
                index, images, labels = micro
                (micro_loss, (micro_acc, micro_stats)), g = grad_fn(
                    params, micro_stats, images, labels, jax.random.fold_in(dropout_rng, index))
                return (jax.tree.map(jnp.add, sums, (micro_loss, micro_acc, g)), micro_stats), None

            zeros = (jnp.zeros(()), jnp.zeros(()), jax.tree.map(jnp.zeros_like, params))
            micro = (jnp.arange(microbatches), split(batch["image"]), split(batch["label"]))
            (sums, stats), _ = jax.lax.scan(accumulate, (zeros, stats), micro)
            loss, accuracy, grads = jax.tree.map(lambda x: x / microbatches, sums)
        new_state, metrics = nonfinite.guarded_update(state, loss, grads, tx, schedule, batch_stats=stats,
                                                      accuracy=accuracy)
        if state.ema is not None:
            new_state = model_ema.after_update(config, state, new_state)
        return new_state, metrics

    return train_step


def evaluation(
    config: ml_collections.ConfigDict, mesh: jax.sharding.Mesh, model: Any = None, picture_dir: str | None = None
) -> tuple[evaluators.Context, str | tuple[str, ...]]:
    """(evaluator context of the classifier (pictures under `picture_dir`), the state entries it
    evaluates: 'params', or ('params', 'batch_stats') for a model with running statistics, then
    evaluated as flax variables {'params': ..., 'batch_stats': ...})."""
    info = sources.dataset_info(config.dataset.name)
    model = model or models.build(config.model, info.num_classes)
    key, as_variables = _evaluated(config)

    def apply(tree, images):
        return model.apply(as_variables(tree), images, train=False)

    ctx = evaluators.Context(
        config, mesh, info.num_classes,
        logits=lambda tree, images: apply(tree, images)[0],
        features=lambda tree, images: apply(tree, images)[1]["pre_logits"],
        outputs=lambda tree, images: apply(tree, images)[1],
        picture_dir=picture_dir,
    )
    return ctx, key


def _evaluated(config: ml_collections.ConfigDict) -> tuple[str | tuple[str, ...], Callable[[Any], Any]]:
    """(state entries the evaluators read, their tree -> flax variables)."""
    if models.has_running_stats(config.model):
        return ("params", "batch_stats"), lambda tree: tree
    return "params", lambda params: {"params": params}


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str, devices: Sequence[jax.Device] | None = None,
                       allow_config_change: bool = False) -> dict[str, Any]:
    """Trains `config` in `workdir` (resuming from it) and returns the final metrics.

    `devices` (default: all) is the set the mesh is laid over, e.g. one device for a reference.
    Raises `Preempted` after saving when stopped by SIGTERM or a preemption notice.
    """
    mesh = common.setup(config, devices, check_config)
    image_size = inputs.image_size(config)
    steps_per_epoch = inputs.steps_per_epoch(config)
    total_steps, warmup_steps = common.train_steps(config, steps_per_epoch)

    # ---- Model and optimizer, abstract first.
    model, tx, schedule, init_state, init_beta = build(config)
    if init_beta is not None:
        logging.info("config.model.init_self_share=%g at %d tokens: init_beta=%g (docs/method/papers.md §3).",
                     config.model.init_self_share, models.num_tokens(config.model, image_size), init_beta)
    rng, abstract_state, shardings = common.abstract_state(init_state, config, mesh)
    logging.info("Model: %s parameters, %d train steps (%.1f per epoch), %d warm-up steps.",
                 f"{common.num_parameters(abstract_state.params):,}", total_steps, steps_per_epoch, warmup_steps)

    # ---- Checkpoint load: workdir > config.resume > config.init_from > scratch.
    mngr, finished = open_workdir(config, workdir, total_steps, allow_config_change,
                                  derived={"schedule.warmup_steps": warmup_steps})
    if finished is not None:
        return finished

    load_init_from = warm_start.loader(
        config, tx, shardings, lambda key: warm_start.classifier_rename(key, checkpoint.saved_config(config.init_from)))
    state = pretrained.restore_or_init(config, workdir, mngr, init_state, rng, abstract_state, shardings,
                                       load_init_from=load_init_from)

    # ---- The update step (state donated) and the evaluators.
    train_step = jax.jit(make_train_step(model, tx, schedule, config), donate_argnums=0,
                           out_shardings=(shardings, sharding.replicated(mesh)))
    ctx, key = evaluation(config, mesh, model, picture_dir=workdir)
    evals = evaluators.build(config, ctx)
    probe = _kappa_probe(config, model, ctx)

    # ---- Loop.
    train_step, cost = perf.compile_for(  # and the fit check, before the input pipeline exists
        train_step, state, inputs.train_batch_spec(config, on_device=True), sharding.batch_sharding(mesh), config)

    def results_at(step: int, state: common.TrainState) -> Any:
        """The evaluations due at `step`: (prefix, metric, value) triples."""
        results = evaluators.run_all(evals, ctx, common.entries(state, key), step, total_steps)
        if state.ema is not None:  # the EMA's own metrics, as 'ema_<prefix>'; the plain model's stay as they are
            results = itertools.chain(results, model_ema.results(
                config, evals, evaluators.run_all, ctx, common.entries(state.ema, key), step, total_steps))
        return results

    at_start = (lambda state: evaluators.run_all(evals, ctx, common.entries(state, key))) if config.get(
        "eval_at_start", False) else None
    hooks = [] if probe is None else [
        loop.Hook(config.analysis.every_steps, lambda step, state: probe(common.entries(state, key)))]
    return loop.train(config, workdir, mesh, mngr, state, train_step, cost, total_steps=total_steps,
                      guarded=nonfinite.guarded_parts(abstract_state), train_iterator=inputs.train_iterator,
                      results_at=results_at, eval_every=[e.every_steps for e in evals],
                      results_at_start=at_start, hooks=hooks,
                      metrics=None if init_beta is None else {"init_beta": init_beta})  # β beside the results


def _kappa_probe(config: ml_collections.ConfigDict, model: Any, ctx: evaluators.Context) -> Any:
    """Live log-κ monitoring (config.analysis.every_steps): params -> {'log_kappa/<point>/layer_l': value}
    on the first `probe_size` examples of the eval split, whatever the number of processes."""
    if not (config.get("analysis") and config.analysis.get("every_steps")):
        return None
    from skipless_jax import conditioning

    def kappa(tree: Any, images: jax.Array) -> dict[str, jax.Array]:
        return conditioning.embedding_log_kappa(ctx.outputs(tree, images))

    batches, _ = ctx.batches(config.dataset.eval_split, batch_size=config.analysis.get("probe_size", 32),
                              workers=False)
    images = next(batches)["image"]
    fn = jax.jit(kappa)

    def probe(tree: Any) -> dict[str, float]:
        kappas = jax.device_get(fn(tree, images))
        return {f"log_kappa/{name}/layer_{layer}": float(v)
                for name, vals in kappas.items() if name in ("sab", "ffn") for layer, v in enumerate(vals)}

    return probe


def flops_per_example(config: ml_collections.ConfigDict) -> tuple[float, float]:
    """(model FLOPs, Token Graying FLOPs) of one training image (models/flops.py)."""
    size, channels, num_classes = image_geometry(config)
    return (flops.train_flops_per_example(config.model, size, num_classes, channels=channels),
            flops.tg_flops_per_example(config.model, size, channels=channels))


TRAINER = image_trainer("supervised", check_config, train_and_evaluate, evaluation, EVALUATOR_TYPES, flops_per_example,
                        initial_state=initial_state, classifier=True)
