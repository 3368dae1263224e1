"""Supervised training, top to bottom: mesh → data → model/optimizer (abstract first) →
shardings → update step → checkpoint load → evaluators → loop.

    python -m skipless_jax.main --config=configs/quickstart.py --workdir=/tmp/quickstart
"""

from __future__ import annotations

import json
import math
import signal
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from absl import logging
from clu import metric_writers, periodic_actions
from etils import epath

from skipless_jax import checkpoint, distributed, sharding, validate
from skipless_jax.data import inputs, sources
from skipless_jax.models import vit
from skipless_jax.optim import build_optimizer


class NonFiniteError(FloatingPointError):
    """A non-finite loss or gradient stopped the run."""


def steps_of(config: ml_collections.ConfigDict, name: str, steps_per_epoch: float) -> int:
    """`config.<name>_steps`, else `config.<name>_epochs` × steps per epoch (rounded up)."""
    holder, field = (config.schedule, name) if name == "warmup" else (config, name)
    steps = holder.get(f"{field}_steps")
    if steps is not None:
        return int(steps)
    return int(math.ceil(holder.get(f"{field}_epochs", 0) * steps_per_epoch))


def cross_entropy(logits: jax.Array, labels: jax.Array, smoothing: float) -> jax.Array:
    """Per-example softmax cross-entropy against (soft) labels smoothed by `smoothing`."""
    labels = labels * (1.0 - smoothing) + smoothing / labels.shape[-1]
    return optax.softmax_cross_entropy(logits, labels)


def init_nonfinite() -> dict[str, jax.Array]:
    """The state's non-finite bookkeeping: skipped updates, and the first one's step and leaf."""
    return {
        "count": jnp.zeros((), jnp.int32),
        "first_step": jnp.full((), -1, jnp.int32),
        "first_leaf": jnp.full((), -1, jnp.int32),
    }


def track_nonfinite(loss: jax.Array, grads: Any, nonfinite: dict[str, jax.Array], step: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(ok, updated bookkeeping) for the update that makes `step` + 1 (numbered like checkpoints).

    ok is false when the loss or any gradient leaf is not finite; the first such update records
    its step and the index of its first bad gradient leaf (-1: only the loss).
    """
    leaf_ok = jnp.stack([jnp.isfinite(g).all() for g in jax.tree.leaves(grads)])
    ok = jnp.isfinite(loss) & leaf_ok.all()
    first = (nonfinite["count"] == 0) & ~ok
    return ok, {
        "count": nonfinite["count"] + (~ok).astype(jnp.int32),
        "first_step": jnp.where(first, step + 1, nonfinite["first_step"]),
        "first_leaf": jnp.where(first, jnp.where(leaf_ok.all(), -1, jnp.argmin(leaf_ok)), nonfinite["first_leaf"]),
    }


def keep_if(ok: jax.Array, new: Any, old: Any) -> Any:
    """new where ok, else old, leaf by leaf (a rejected update leaves the state as it was)."""
    return jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)


def nonfinite_error(nonfinite: dict[str, Any], leaf_names: list[str], step: int, last_saved: Optional[int]) -> Optional[NonFiniteError]:
    """The error to raise for fetched bookkeeping with skipped updates, else None."""
    if int(nonfinite["count"]) == 0:
        return None
    leaf = leaf_names[int(nonfinite["first_leaf"])] if int(nonfinite["first_leaf"]) >= 0 else "(loss)"
    return NonFiniteError(
        f"Non-finite loss or gradient at step {int(nonfinite['first_step'])} (first offending "
        f"parameter: {leaf}); stopped at step {step}, last good checkpoint: {last_saved}"
    )


def check_config(config: ml_collections.ConfigDict, num_devices: Optional[int] = None) -> None:
    """Everything that can be wrong with a config or its data fails here, before compiling."""
    validate.validate_config(config, num_devices)
    sources.check_available(
        config.dataset.name, [config.dataset.train_split, config.dataset.eval_split], config.dataset.get("data_dir")
    )


def train_and_evaluate(
    config: ml_collections.ConfigDict, workdir: str, devices: Optional[Sequence[jax.Device]] = None
) -> dict[str, float]:
    """Trains `config` in `workdir` (resuming from it) and returns the final metrics.

    `devices` (default: all) is the set the mesh is laid over, e.g. one device for a reference.
    """
    check_config(config, len(devices) if devices is not None else None)
    mesh = sharding.make_mesh(config.mesh, devices)
    distributed.log_topology(mesh)
    is_chief = jax.process_index() == 0
    if not is_chief:  # only process 0 logs beyond warnings and writes metrics
        logging.set_verbosity(logging.WARNING)
    info = sources.dataset_info(config.dataset.name)
    image_size = inputs.image_size(config)
    steps_per_epoch = inputs.num_train_examples(config) / config.input.batch_size
    total_steps = steps_of(config, "total", steps_per_epoch)
    config.schedule.warmup_steps = steps_of(config, "warmup", steps_per_epoch)

    # ---- Model and optimizer, abstract first.
    model = vit.build_model(config.model, info.num_classes)
    tx, schedule = build_optimizer(config, total_steps)
    dummy = jnp.zeros((1, image_size, image_size, info.image_shape[-1]), jnp.float32)

    def init_state(rng: jax.Array) -> dict[str, Any]:
        init_rng, train_rng = jax.random.split(rng)
        params = model.init({"params": init_rng}, dummy, train=False)["params"]
        return {
            "step": jnp.zeros((), jnp.int32),
            "params": params,
            "opt_state": tx.init(params),
            "rng": train_rng,
            "nonfinite": init_nonfinite(),
        }

    rng = jax.random.PRNGKey(config.seed)
    abstract_state = jax.eval_shape(init_state, rng)
    state_shardings = sharding.tree_shardings(abstract_state, mesh, config.sharding_rules)
    repl = sharding.replicated(mesh)
    batch_sharding = sharding.batch_sharding(mesh)
    leaf_names = [sharding.path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(abstract_state["params"])[0]]
    num_params = sum(math.prod(x.shape) for x in jax.tree.leaves(abstract_state["params"]))
    logging.info("Model: %s parameters, %d train steps (%.1f per epoch).", f"{num_params:,}", total_steps, steps_per_epoch)

    # ---- Checkpoint load: workdir > config.resume > config.init_from > scratch.
    mngr = checkpoint.manager(workdir, keep=config.get("keep_checkpoints", 3))
    target = checkpoint.abstract(abstract_state, state_shardings)
    restored = checkpoint.restore_latest(mngr, target)
    if restored is not None:
        step0, state, _ = restored
        logging.info("Resumed from %s at step %d.", mngr.directory, step0)
    elif config.get("resume"):
        step0, state, _ = checkpoint.restore_from_path(config.resume, target)
        logging.info("Resumed from config.resume=%s at step %d.", config.resume, step0)
    else:
        state = jax.jit(init_state, out_shardings=state_shardings)(rng)
        if config.get("init_from"):
            _, params = checkpoint.restore_params(config.init_from, target["params"])
            state["params"] = params
            logging.info("Initialized weights from config.init_from=%s.", config.init_from)
    first_step = int(jax.device_get(state["step"]))

    # ---- The update step (state donated) and the evaluation step.
    smoothing = config.get("label_smoothing", 0.0)
    skip_nonfinite = config.get("skip_nonfinite_steps", False)
    microbatches = config.get("grad_accum_steps") or 1

    def train_step(state: dict[str, Any], batch: dict[str, jax.Array]) -> tuple[dict[str, Any], dict[str, jax.Array]]:
        step, params = state["step"], state["params"]
        dropout_rng = jax.random.fold_in(state["rng"], step)

        def loss_fn(params, images, labels, rng):
            logits, _ = model.apply({"params": params}, images, train=True, rngs={"dropout": rng})
            loss = cross_entropy(logits, labels, smoothing).mean()
            return loss, (logits.argmax(-1) == labels.argmax(-1)).mean()

        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        if microbatches == 1:
            (loss, accuracy), grads = grad_fn(params, batch["image"], batch["label"], dropout_rng)
        else:  # gradient accumulation: the mean over equal micro-batches of the global batch
            split = lambda x: x.reshape(microbatches, -1, *x.shape[1:])  # noqa: E731

            def accumulate(carry, micro):
                index, images, labels = micro
                (l, a), g = grad_fn(params, images, labels, jax.random.fold_in(dropout_rng, index))
                return jax.tree.map(jnp.add, carry, (l, a, g)), None

            zeros = (jnp.zeros(()), jnp.zeros(()), jax.tree.map(jnp.zeros_like, params))
            micro = (jnp.arange(microbatches), split(batch["image"]), split(batch["label"]))
            sums, _ = jax.lax.scan(accumulate, zeros, micro)
            loss, accuracy, grads = jax.tree.map(lambda x: x / microbatches, sums)
        updates, opt_state = tx.update(grads, state["opt_state"], params)
        new_params = optax.apply_updates(params, updates)

        # A non-finite loss or gradient leaves params and optimizer state untouched; the host
        # then stops the run (default) or counts the skipped step (skip_nonfinite_steps).
        ok, nonfinite = track_nonfinite(loss, grads, state["nonfinite"], step)
        new_state = {
            "step": step + 1,
            "params": keep_if(ok, new_params, params),
            "opt_state": keep_if(ok, opt_state, state["opt_state"]),
            "rng": state["rng"],
            "nonfinite": nonfinite,
        }
        metrics = {
            "loss": loss,
            "accuracy": accuracy,
            "grad_norm": optax.tree.norm(grads),
            "param_norm": optax.tree.norm(params),
            "lr": schedule(step),
            "nonfinite_steps": nonfinite["count"],
        }
        return new_state, metrics

    def eval_step(params: Any, batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
        logits, _ = model.apply({"params": params}, batch["image"], train=False)
        mask = batch["mask"]
        correct = (logits.argmax(-1) == batch["label"].argmax(-1)) * mask
        loss = cross_entropy(logits, batch["label"], 0.0) * mask
        return {"correct": correct.sum(), "loss": loss.sum(), "count": mask.sum()}

    p_train_step = jax.jit(train_step, donate_argnums=0, out_shardings=(state_shardings, repl))
    p_eval_step = jax.jit(eval_step, out_shardings=repl)

    def to_global(batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        return jax.tree.map(lambda x: jax.make_array_from_process_local_data(batch_sharding, x), batch)

    def evaluate(params: Any) -> dict[str, float]:
        batches, num_examples = inputs.eval_iterator(config, jax.process_index(), jax.process_count())
        totals = None
        for batch in batches:
            sums = p_eval_step(params, to_global(batch))
            totals = sums if totals is None else jax.tree.map(jnp.add, totals, sums)
        totals = jax.device_get(totals)
        if int(totals["count"]) != num_examples:  # every example exactly once
            raise AssertionError(f"evaluation counted {totals['count']} of {num_examples} examples")
        return {"test_accuracy": float(totals["correct"] / totals["count"]), "test_loss": float(totals["loss"] / totals["count"])}

    probe = None
    if config.get("analysis") and config.analysis.get("every_steps"):
        from skipless_jax import conditioning

        def kappa(params: Any, images: jax.Array) -> dict[str, jax.Array]:
            _, out = model.apply({"params": params}, images, train=False)
            return conditioning.embedding_log_kappa(out)

        # The first probe_size examples of the eval split, whatever the number of processes.
        probe_size = config.analysis.get("probe_size", 32)
        batches = inputs.eval_iterator(config, jax.process_index(), jax.process_count(), batch_size=probe_size)[0]
        probe = (jax.jit(kappa), to_global({"image": next(batches)["image"]})["image"])

    # ---- Loop.
    writer = metric_writers.create_default_writer(workdir, asynchronous=True) if is_chief else metric_writers.MultiWriter([])
    if first_step == 0:
        writer.write_hparams({k: str(v) for k, v in flatten_dict(config.to_dict()).items()})
    progress = periodic_actions.ReportProgress(num_train_steps=total_steps, writer=writer, every_steps=config.log_every_steps)
    # One process: our SIGTERM flag. Several: jax.distributed's preemption service catches SIGTERM
    # and mngr.reached_preemption(step) is true at the same step everywhere; a Python handler would
    # replace it, and the signalled process would save while the others keep stepping (a hang).
    stop_signal = SignalFlag() if jax.process_count() == 1 else None
    data = inputs.train_iterator(config, first_step, jax.process_index(), jax.process_count())
    pending: list[dict[str, jax.Array]] = []
    last_saved = max(mngr.all_steps(), default=None)

    def meta(step: int) -> dict[str, Any]:
        return {"step": step, "data_position": step * config.input.batch_size, "config": config.to_json()}

    def check_finite(step: int) -> None:
        error = nonfinite_error(jax.device_get(state["nonfinite"]), leaf_names, step, last_saved)
        if error is not None and not skip_nonfinite:
            raise error

    final_metrics: dict[str, float] = {}
    step = first_step
    try:  # whatever stops the loop, saves already started are completed (finally)
        with jax.set_mesh(mesh):
            for step in range(first_step + 1, total_steps + 1):
                with jax.profiler.StepTraceAnnotation("train", step_num=step):
                    state, metrics = p_train_step(state, to_global(next(data)))
                pending.append(metrics)
                progress(step)
                last = step == total_steps
                if step % config.log_every_steps == 0 or last:
                    check_finite(step)
                    train_metrics = {k: float(np.mean(v)) for k, v in jax.device_get(stack_metrics(pending)).items()}
                    train_metrics["nonfinite_steps"] = float(pending[-1]["nonfinite_steps"])
                    pending = []
                    writer.write_scalars(step, {f"train/{k}": v for k, v in train_metrics.items()})
                    final_metrics.update({f"train_{k}": v for k, v in train_metrics.items()})
                if probe is not None and (step % config.analysis.every_steps == 0 or last):
                    kappas = jax.device_get(probe[0](state["params"], probe[1]))
                    writer.write_scalars(step, {f"log_kappa/{name}/layer_{l}": float(v) for name, vals in kappas.items() if name in ("sab", "ffn") for l, v in enumerate(vals)})
                if (config.get("eval_every_steps") and step % config.eval_every_steps == 0) or last:
                    eval_metrics = evaluate(state["params"])
                    writer.write_scalars(step, {f"test/{k[5:]}": v for k, v in eval_metrics.items()})
                    final_metrics.update(eval_metrics)
                    logging.info("Step %d: test accuracy %.4f, test loss %.4f", step, eval_metrics["test_accuracy"], eval_metrics["test_loss"])
                preempted = mngr.reached_preemption(step) or (stop_signal is not None and stop_signal.raised)
                if (config.get("checkpoint_every_steps") and step % config.checkpoint_every_steps == 0) or last or preempted:
                    check_finite(step)
                    checkpoint.save(mngr, step, state, meta(step))
                    last_saved = step
                if preempted:
                    logging.warning("Stopping at step %d on a preemption/termination signal; checkpoint saved.", step)
                    break
    finally:
        mngr.wait_until_finished()
        mngr.close()
    writer.flush()
    final_metrics["step"] = step
    if is_chief and step == total_steps:  # a run stopped early has no final metrics
        epath.Path(workdir, "final_metrics.json").write_text(json.dumps(final_metrics, indent=2))
    return final_metrics


def stack_metrics(metrics: list[dict[str, jax.Array]]) -> dict[str, jax.Array]:
    """Per-step metric dicts -> one dict of stacked arrays (one device_get for a log period)."""
    return {k: jnp.stack([m[k] for m in metrics]) for k in metrics[0]}


def flatten_dict(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{'a': {'b': 1}} -> {'a.b': 1} (config hyperparameters for TensorBoard)."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten_dict(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


class SignalFlag:
    """Records SIGTERM so that the loop saves a checkpoint and stops at the next step."""

    def __init__(self):
        self.raised = False
        try:
            signal.signal(signal.SIGTERM, self._handler)
        except ValueError:  # not the main thread (e.g. a test runner thread)
            pass

    def _handler(self, signum, frame):
        logging.warning("Received signal %d: will checkpoint and stop after this step.", signum)
        self.raised = True
