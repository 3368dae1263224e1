"""DINO self-supervised training (METHOD.md §6), top to bottom: schedules → loss, centre and
EMA → optimizer → mesh → data → model/optimizer (abstract first) → shardings → update step →
checkpoint load → kNN / linear evaluation of the teacher → loop.

    python -m skipless_jax.main --config=configs/dino_digits.py --workdir=/tmp/dino_digits

A sibling of the supervised trainer (train.py): it shares the ViT, the input pipeline, the
sharding rules, the checkpoint manager and the optimizer registry, and adds the student/teacher
pair. Everything DINO keeps across steps is in the one checkpointed state: student params,
optimizer state, EMA teacher, centre, step (every schedule is a closed form of the step; the
values of the last step are stored too, for inspection).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from absl import logging
from clu import metric_writers, periodic_actions
from etils import epath

from skipless_jax import checkpoint, distributed, sharding, train, validate
from skipless_jax.data import inputs, multicrop, sources
from skipless_jax.evaluators import knn, linear_probe
from skipless_jax.models import dino_head, vit
from skipless_jax.optim import OPTIMIZERS, decay_mask

_HIGHEST = jax.lax.Precision.HIGHEST
EVALUATORS = ("knn", "linear")

# ----------------------------------------------------------------------------------------
# Schedules: DINO's per-iteration arrays (utils.cosine_scheduler) as closed forms of the step.


def cosine_schedule(
    step: jax.Array | int, base: float, final: float, total_steps: int, warmup_steps: int = 0, warmup_start: float = 0.0
) -> jax.Array:
    """linspace(warmup_start, base, W)[s] for s < W, then final + ½(base − final)(1 + cos(π(s − W)/(T − W))).

    Steps past the last (T − 1) keep the last value.
    """
    s = jnp.asarray(step, jnp.float32)
    warm = warmup_start + (base - warmup_start) * s / max(warmup_steps - 1, 1)
    span = max(total_steps - warmup_steps, 1)
    t = jnp.minimum(s - warmup_steps, span - 1) / span
    cos = final + 0.5 * (base - final) * (1.0 + jnp.cos(jnp.pi * t))
    return jnp.where(s < warmup_steps, warm, cos)


def teacher_temp_schedule(
    step: jax.Array | int, steps_per_epoch: int, warmup_temp: float, temp: float, warmup_epochs: int
) -> jax.Array:
    """Per epoch e = ⌊s / steps_per_epoch⌋: linspace(warmup_temp, temp, E_w)[e] for e < E_w, then temp."""
    epoch = jnp.floor_divide(jnp.asarray(step, jnp.int32), steps_per_epoch).astype(jnp.float32)
    warm = warmup_temp + (temp - warmup_temp) * epoch / max(warmup_epochs - 1, 1)
    return jnp.where(epoch < warmup_epochs, warm, temp)


@dataclasses.dataclass(frozen=True)
class Schedules:
    """Every schedule of the recipe, as functions of the (0-based) step."""

    total_steps: int
    steps_per_epoch: int
    warmup_steps: int
    peak_lr: float
    min_lr: float
    weight_decay: float
    weight_decay_end: float
    momentum_teacher: float
    warmup_teacher_temp: float
    teacher_temp: float
    warmup_teacher_temp_epochs: int
    freeze_last_layer_steps: int

    def lr(self, step: Any) -> jax.Array:
        return cosine_schedule(step, self.peak_lr, self.min_lr, self.total_steps, self.warmup_steps)

    def wd(self, step: Any) -> jax.Array:
        return cosine_schedule(step, self.weight_decay, self.weight_decay_end, self.total_steps)

    def momentum(self, step: Any) -> jax.Array:
        return cosine_schedule(step, self.momentum_teacher, 1.0, self.total_steps)

    def temp(self, step: Any) -> jax.Array:
        return teacher_temp_schedule(
            step, self.steps_per_epoch, self.warmup_teacher_temp, self.teacher_temp, self.warmup_teacher_temp_epochs
        )

    def values(self, step: Any) -> dict[str, jax.Array]:
        return {"lr": self.lr(step), "wd": self.wd(step), "momentum": self.momentum(step), "teacher_temp": self.temp(step)}


def steps_per_epoch(config: ml_collections.ConfigDict, num_train: int) -> int:
    """Full batches per epoch (DINO's loader drops the last partial batch)."""
    return max(num_train // config.input.batch_size, 1)


def schedules_from_config(config: ml_collections.ConfigDict, num_train: int) -> Schedules:
    spe = steps_per_epoch(config, num_train)
    opt, d = config.optimizer, config.dino
    ref = opt.get("lr_reference_batch")
    return Schedules(
        total_steps=train.steps_of(config, "total", spe),
        steps_per_epoch=spe,
        warmup_steps=train.steps_of(config, "warmup", spe),
        peak_lr=opt.lr * (config.input.batch_size / ref if ref else 1.0),  # linear scaling rule
        min_lr=opt.get("min_lr", 1e-6),
        weight_decay=opt.get("weight_decay", 0.0),
        weight_decay_end=opt.get("weight_decay_end", opt.get("weight_decay", 0.0)),
        momentum_teacher=d.momentum_teacher,
        warmup_teacher_temp=d.warmup_teacher_temp,
        teacher_temp=d.teacher_temp,
        warmup_teacher_temp_epochs=d.warmup_teacher_temp_epochs,
        freeze_last_layer_steps=d.get("freeze_last_layer_steps") or int(d.freeze_last_layer_epochs * spe),
    )


# ----------------------------------------------------------------------------------------
# Loss, centre, teacher EMA.


def dino_loss(
    student_out: jax.Array, teacher_out: jax.Array, center: jax.Array, student_temp: float, teacher_temp: jax.Array | float
) -> jax.Array:
    """METHOD.md §6: mean over pairs (teacher global view t, student view v ≠ t) of
    mean_b −Σ_k softmax((t_tb − c)/τ_t)_k · log_softmax(s_vb/τ_s)_k.

    student_out (V, B, K), views 0 and 1 the global ones; teacher_out (2, B, K); center (1, K).
    """
    q = jax.nn.softmax((teacher_out - center) / teacher_temp, axis=-1)
    q = jax.lax.stop_gradient(q)
    logp = jax.nn.log_softmax(student_out / student_temp, axis=-1)
    ce = -jnp.einsum("tbk,vbk->tv", q, logp, precision=_HIGHEST) / student_out.shape[1]  # (2, V)
    pairs = 1.0 - jnp.eye(teacher_out.shape[0], student_out.shape[0])  # drop t == v
    return jnp.sum(ce * pairs) / jnp.sum(pairs)


def update_center(center: jax.Array, teacher_out: jax.Array, momentum: float) -> jax.Array:
    """c ← m·c + (1 − m)·mean of the teacher outputs over views and the global batch; (1, K)."""
    batch_center = jnp.mean(teacher_out.reshape(-1, teacher_out.shape[-1]), axis=0, keepdims=True)
    return center * momentum + batch_center * (1.0 - momentum)


def ema(teacher: Any, student: Any, momentum: jax.Array | float) -> Any:
    """θ_t ← m·θ_t + (1 − m)·θ_s, leaf by leaf."""
    return jax.tree.map(lambda t, s: t * momentum + s * (1.0 - momentum), teacher, student)


def teacher_entropy(teacher_out: jax.Array, center: jax.Array, teacher_temp: jax.Array | float) -> dict[str, jax.Array]:
    """Collapse monitors (nats): mean per-example entropy of the teacher distribution (→ log K:
    uniform collapse) and entropy of its batch mean (→ 0: one-dimension collapse)."""
    q = jax.nn.softmax((teacher_out - center) / teacher_temp, axis=-1).reshape(-1, teacher_out.shape[-1])
    per_example = -jnp.sum(q * jnp.log(q + 1e-12), axis=-1).mean()
    marginal = q.mean(0)
    return {"teacher_entropy": per_example, "teacher_marginal_entropy": -jnp.sum(marginal * jnp.log(marginal + 1e-12))}


# ----------------------------------------------------------------------------------------
# Optimizer: clip per tensor → (registry optimizer, wd = 0) → scheduled decoupled decay,
# the last layer frozen (zero gradient in, zero update out) for the first epoch.


def clip_per_tensor(max_norm: float) -> optax.GradientTransformation:
    """g ← g·max_norm/(‖g‖ + 1e-6) for every tensor whose ratio is < 1 (DINO's clip_gradients)."""

    def update(updates, state, params=None):
        del params

        def clip(g):
            coef = max_norm / (jnp.sqrt(jnp.sum(jnp.square(g.astype(jnp.float32)))) + 1e-6)
            return jnp.where(coef < 1.0, g * coef, g).astype(g.dtype)

        return jax.tree.map(clip, updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


class CountState(NamedTuple):
    count: jax.Array


def scheduled_weight_decay(
    lr: Callable[[jax.Array], jax.Array], wd: Callable[[jax.Array], jax.Array], mask: Callable[[Any], Any]
) -> optax.GradientTransformation:
    """u ← u − lr_t·wd_t·p on masked leaves (decoupled, as torch AdamW; after the lr scaling)."""

    def init(params):
        del params
        return CountState(jnp.zeros((), jnp.int32))

    def update(updates, state, params=None):
        if params is None:
            raise ValueError("scheduled_weight_decay needs params: call update(grads, state, params)")
        shrink = lr(state.count) * wd(state.count)
        new = jax.tree.map(lambda u, p, m: (u - shrink * p).astype(u.dtype) if m else u, updates, params, mask(params))
        return new, CountState(optax.safe_increment(state.count))

    return optax.GradientTransformation(init, update)


class FreezeState(NamedTuple):
    count: jax.Array
    inner: Any


def freeze_until(
    inner: optax.GradientTransformation, frozen: Callable[[Any], Any], steps: int
) -> optax.GradientTransformation:
    """While count < steps, the leaves where `frozen(params)` is True get a zero gradient into
    `inner` and a zero update out of it (torch: grad = None, so Adam moments stay zero too)."""

    def init(params):
        return FreezeState(jnp.zeros((), jnp.int32), inner.init(params))

    def update(updates, state, params=None):
        on = state.count < steps
        mask = frozen(updates)
        zero = lambda u, m: jnp.where(on, jnp.zeros_like(u), u) if m else u
        out, inner_state = inner.update(jax.tree.map(zero, updates, mask), state.inner, params)
        return jax.tree.map(zero, out, mask), FreezeState(optax.safe_increment(state.count), inner_state)

    return optax.GradientTransformation(init, update)


def is_last_layer(tree: Any) -> Any:
    """True for the DINO head's weight-normalized last layer."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: sharding.path_str(path).startswith(f"head/{dino_head.LAST_LAYER}"), tree
    )


def build_dino_optimizer(config: ml_collections.ConfigDict, sched: Schedules) -> optax.GradientTransformation:
    """The registry's optimizer (`config.optimizer.name`: adamw, soap, ...) inside DINO's pieces."""
    opt = ml_collections.ConfigDict(config.optimizer.to_dict())
    opt.weight_decay = 0.0  # decay is scheduled below, the same for every optimizer
    base = OPTIMIZERS[opt.name](opt, sched.lr)
    parts = []
    if config.dino.clip_grad:
        parts.append(clip_per_tensor(config.dino.clip_grad))
    inner = optax.chain(base, scheduled_weight_decay(sched.lr, sched.wd, decay_mask))
    parts.append(freeze_until(inner, is_last_layer, sched.freeze_last_layer_steps))
    return optax.chain(*parts)


# ----------------------------------------------------------------------------------------
# Model and config.


def build_model(config: ml_collections.ConfigDict) -> dino_head.DINO:
    """ViT backbone (its learned position table sized for the global crop) + DINO head."""
    kwargs = vit.model_kwargs(config.model, num_classes=0)  # a backbone: no classifier
    kwargs["image_size"] = inputs.image_size(config)
    d = config.dino
    head = dino_head.DINOHead(
        out_dim=d.out_dim,
        hidden_dim=d.hidden_dim,
        bottleneck_dim=d.bottleneck_dim,
        num_layers=d.get("num_layers", 3),
        norm_last_layer=d.norm_last_layer,
        dtype=kwargs["dtype"],
    )
    return dino_head.DINO(backbone=vit.ViT(**kwargs), head=head)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_config(config: ml_collections.ConfigDict, num_devices: int | None = None) -> None:
    """Every bad field fails here in one line, before anything compiles."""
    validate.validate_config(config, num_devices)
    patch = vit.model_kwargs(config.model, 0)["patch_size"]
    multicrop.validate_multicrop_config(config.input.multicrop, patch)
    d = config.dino
    for field in ("student_temp", "teacher_temp", "warmup_teacher_temp"):
        v = d.get(field)
        _require(_finite(v) and v > 0, f"config.dino.{field}={v!r} must be a finite number > 0")
    for field in ("momentum_teacher", "center_momentum"):
        v = d.get(field)
        _require(_finite(v) and 0 <= v <= 1, f"config.dino.{field}={v!r} must be in [0, 1]")
    for field in ("out_dim", "hidden_dim", "bottleneck_dim"):
        v = d.get(field)
        _require(isinstance(v, int) and not isinstance(v, bool) and v > 0, f"config.dino.{field}={v!r} must be a positive integer")
    for field in ("warmup_teacher_temp_epochs", "freeze_last_layer_epochs"):
        v = d.get(field)
        _require(_finite(v) and v >= 0, f"config.dino.{field}={v!r} must be a number >= 0")
    v = d.get("clip_grad")
    _require(v is None or (_finite(v) and v >= 0), f"config.dino.clip_grad={v!r} must be >= 0 (0 or None: off)")
    for field in ("min_lr", "weight_decay_end"):
        v = config.optimizer.get(field, 0.0)
        _require(_finite(v) and v >= 0, f"config.optimizer.{field}={v!r} must be a finite number >= 0")
    ref = config.optimizer.get("lr_reference_batch")
    _require(ref is None or (_finite(ref) and ref > 0), f"config.optimizer.lr_reference_batch={ref!r} must be > 0 or None")
    ev = config.eval
    unknown = [e for e in ev.evaluators if e not in EVALUATORS]
    _require(not unknown, f"config.eval.evaluators={tuple(ev.evaluators)!r} has unknown {unknown}; allowed: {list(EVALUATORS)}")
    knn.validate_knn(ev.knn_k, ev.knn_temperature)
    linear_probe.validate_linear_probe(ev.linear_l2, ev.linear_steps)
    splits = [config.dataset.train_split, config.dataset.eval_split, ev.get("train_split") or config.dataset.train_split]
    sources.check_available(config.dataset.name, splits, config.dataset.get("data_dir"))


# ----------------------------------------------------------------------------------------
# The update step.


def teacher_outputs(model: dino_head.DINO, teacher: Any, batch: dict[str, jax.Array]) -> jax.Array:
    """(2, B, K) teacher head outputs on the two global crops (no gradient)."""
    b = batch["global"].shape[0]
    globals_, _ = multicrop.split_views(batch["global"], batch["local"])
    out, _ = model.apply({"params": teacher}, (globals_,), train=False)
    return jax.lax.stop_gradient(out.reshape(2, b, -1))


def student_loss(
    model: dino_head.DINO,
    params: Any,
    batch: dict[str, jax.Array],
    teacher_out: jax.Array,
    center: jax.Array,
    student_temp: float,
    teacher_temp: jax.Array | float,
    rng: jax.Array,
) -> jax.Array:
    """The DINO loss of the student on all 2 + N crops against the centred, sharpened teacher."""
    b = batch["global"].shape[0]
    globals_, locals_ = multicrop.split_views(batch["global"], batch["local"])
    views = (globals_, locals_) if locals_.shape[0] else (globals_,)
    out, _ = model.apply({"params": params}, views, train=True, rngs={"dropout": rng})
    return dino_loss(out.reshape(-1, b, out.shape[-1]), teacher_out, center, student_temp, teacher_temp)


def make_train_step(
    model: dino_head.DINO, tx: optax.GradientTransformation, sched: Schedules, dino_config: Any
) -> Callable[[dict[str, Any], dict[str, jax.Array]], tuple[dict[str, Any], dict[str, jax.Array]]]:
    """(state, {'global': (B, 2, G, G, C), 'local': (B, N, L, L, C)}) -> (state, metrics).

    Means over the batch are over the global batch (the arrays are global), so the loss, the
    centre and the entropies are the same on any mesh.
    """
    student_temp = dino_config.student_temp
    center_momentum = dino_config.center_momentum

    def train_step(state: dict[str, Any], batch: dict[str, jax.Array]) -> tuple[dict[str, Any], dict[str, jax.Array]]:
        step, params = state["step"], state["params"]
        values = sched.values(step)
        teacher_out = teacher_outputs(model, state["teacher"], batch)
        rng = jax.random.fold_in(state["rng"], step)
        loss, grads = jax.value_and_grad(
            lambda p: student_loss(model, p, batch, teacher_out, state["center"], student_temp, values["teacher_temp"], rng)
        )(params)
        updates, opt_state = tx.update(grads, state["opt_state"], params)
        new_params = optax.apply_updates(params, updates)
        new_teacher = ema(state["teacher"], new_params, values["momentum"])
        new_center = update_center(state["center"], teacher_out, center_momentum)  # after the loss

        # A non-finite loss or gradient leaves the state untouched; the host stops the run.
        ok, nonfinite = train.track_nonfinite(loss, grads, state["nonfinite"], step)
        new_state = {
            "step": step + 1,
            "params": train.keep_if(ok, new_params, params),
            "teacher": train.keep_if(ok, new_teacher, state["teacher"]),
            "center": train.keep_if(ok, new_center, state["center"]),
            "opt_state": train.keep_if(ok, opt_state, state["opt_state"]),
            "schedules": values,
            "rng": state["rng"],
            "nonfinite": nonfinite,
        }
        metrics = {
            "loss": loss,
            **values,
            **teacher_entropy(teacher_out, state["center"], values["teacher_temp"]),
            "grad_norm": optax.tree.norm(grads),
            "param_norm": optax.tree.norm(params),
            "nonfinite_steps": new_state["nonfinite"]["count"],
        }
        return new_state, metrics

    return train_step


def init_state_fn(
    model: dino_head.DINO, tx: optax.GradientTransformation, sched: Schedules, dummy: jax.Array, out_dim: int
) -> Callable[[jax.Array], dict[str, Any]]:
    """rng -> the whole train state; teacher = a copy of the student (same init), centre = 0."""

    def init_state(rng: jax.Array) -> dict[str, Any]:
        init_rng, train_rng = jax.random.split(rng)
        params = model.init({"params": init_rng}, (dummy,), train=False)["params"]
        return {
            "step": jnp.zeros((), jnp.int32),
            "params": params,
            "teacher": jax.tree.map(jnp.copy, params),
            "center": jnp.zeros((1, out_dim), jnp.float32),
            "opt_state": tx.init(params),
            "schedules": sched.values(0),
            "rng": train_rng,
            "nonfinite": train.init_nonfinite(),
        }

    return init_state


# ----------------------------------------------------------------------------------------
# Training and evaluation.


def train_and_evaluate(
    config: ml_collections.ConfigDict, workdir: str, devices: Sequence[jax.Device] | None = None
) -> dict[str, float]:
    """Trains DINO per `config` in `workdir` (resuming from it); returns the final metrics.

    `devices` (default: all) is the set the mesh is laid over.
    """
    check_config(config, len(devices) if devices is not None else None)
    mesh = sharding.make_mesh(config.mesh, devices)
    distributed.log_topology(mesh)
    is_chief = jax.process_index() == 0
    if not is_chief:  # only process 0 logs beyond warnings and writes metrics
        logging.set_verbosity(logging.WARNING)
    info = sources.dataset_info(config.dataset.name)
    num_train = inputs.num_train_examples(config)
    sched = schedules_from_config(config, num_train)
    total_steps = sched.total_steps
    global_size = inputs.image_size(config)

    # ---- Model and optimizer, abstract first.
    model = build_model(config)
    tx = build_dino_optimizer(config, sched)
    dummy = jnp.zeros((1, global_size, global_size, info.image_shape[-1]), jnp.float32)
    init_state = init_state_fn(model, tx, sched, dummy, config.dino.out_dim)
    rng = jax.random.PRNGKey(config.seed)
    abstract_state = jax.eval_shape(init_state, rng)
    state_shardings = sharding.tree_shardings(abstract_state, mesh, config.sharding_rules)
    repl = sharding.replicated(mesh)
    batch_sharding = sharding.batch_sharding(mesh)
    leaf_names = [sharding.path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(abstract_state["params"])[0]]
    num_params = sum(math.prod(x.shape) for x in jax.tree.leaves(abstract_state["params"]))
    logging.info("DINO: %s student parameters, %d steps (%d per epoch).", f"{num_params:,}", total_steps, sched.steps_per_epoch)

    # ---- Checkpoint load: workdir > config.resume > scratch.
    mngr = checkpoint.manager(workdir, keep=config.get("keep_checkpoints", 3))
    target = checkpoint.abstract(abstract_state, state_shardings)
    restored = checkpoint.restore_latest(mngr, target)
    if restored is not None:
        _, state, _ = restored
    elif config.get("resume"):
        _, state, _ = checkpoint.restore_from_path(config.resume, target)
    else:
        state = jax.jit(init_state, out_shardings=state_shardings)(rng)
    first_step = int(jax.device_get(state["step"]))
    if first_step:
        logging.info("Resumed at step %d.", first_step)

    # ---- The update step (state donated) and the feature step.
    p_train_step = jax.jit(make_train_step(model, tx, sched, config.dino), donate_argnums=0, out_shardings=(state_shardings, repl))

    def embed_step(params: Any, batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
        feats = model.apply({"params": params}, batch["image"], method=dino_head.DINO.embed)
        return {"features": feats.astype(jnp.float32), "label": batch["label"].argmax(-1), "mask": batch["mask"]}

    p_embed_step = jax.jit(embed_step, out_shardings=repl)  # replicated: every host reads all rows

    def to_global(batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        return jax.tree.map(lambda x: jax.make_array_from_process_local_data(batch_sharding, x), batch)

    def features(params: Any, split: str) -> tuple[np.ndarray, np.ndarray]:
        batches, n = inputs.eval_iterator(config, jax.process_index(), jax.process_count(), split)
        feats, labels = [], []
        for batch in batches:
            out = jax.device_get(p_embed_step(params, to_global(batch)))
            keep = out["mask"] > 0  # padding rows of the last batch
            feats.append(out["features"][keep])
            labels.append(out["label"][keep])
        feats, labels = np.concatenate(feats), np.concatenate(labels)
        if len(labels) != n:  # every example exactly once
            raise AssertionError(f"feature extraction counted {len(labels)} of {n} examples of {split!r}")
        return feats, labels

    def evaluate(teacher: Any) -> dict[str, float]:
        ev = config.eval
        if not ev.evaluators:
            return {}
        train_x, train_y = features(teacher, ev.get("train_split") or config.dataset.train_split)
        test_x, test_y = features(teacher, config.dataset.eval_split)
        out = {}
        if "knn" in ev.evaluators:
            k = min(ev.knn_k, len(train_y))  # a bank smaller than k (a tiny split) votes with all of it
            if k < ev.knn_k:
                logging.warning("kNN: only %d train examples; using k=%d instead of %d.", len(train_y), k, ev.knn_k)
            out["test_knn_accuracy"] = knn.knn_accuracy(train_x, train_y, test_x, test_y, info.num_classes, k, ev.knn_temperature)
        if "linear" in ev.evaluators:
            out["test_linear_accuracy"] = linear_probe.linear_probe_accuracy(
                train_x, train_y, test_x, test_y, info.num_classes, ev.linear_l2, ev.linear_steps
            )
        return out

    # ---- Loop.
    writer = metric_writers.create_default_writer(workdir, asynchronous=True) if is_chief else metric_writers.MultiWriter([])
    if first_step == 0:
        writer.write_hparams({k: str(v) for k, v in train.flatten_dict(config.to_dict()).items()})
    # Every logged value, one JSON line per record (teacher entropy over training, evaluations);
    # a resumed run keeps the records up to its checkpoint and rewrites the file.
    history_path = epath.Path(workdir, "history.jsonl")
    history = []
    if is_chief and history_path.exists():
        history = [line for line in history_path.read_text().splitlines() if json.loads(line)["step"] <= first_step]

    def record(step: int, values: dict[str, float]) -> None:
        if is_chief:
            history.append(json.dumps({"step": step, **values}))
            history_path.write_text("\n".join(history) + "\n")

    progress = periodic_actions.ReportProgress(num_train_steps=total_steps, writer=writer, every_steps=config.log_every_steps)
    stop_signal = train.SignalFlag()
    data = multicrop.train_iterator(config, first_step, jax.process_index(), jax.process_count())
    pending: list[dict[str, jax.Array]] = []
    last_saved = max(mngr.all_steps(), default=None)
    final_metrics: dict[str, float] = {}

    def meta(step: int) -> dict[str, Any]:
        return {"step": step, "data_position": step * config.input.batch_size, "config": config.to_json()}

    def check_finite(step: int) -> None:
        error = train.nonfinite_error(jax.device_get(state["nonfinite"]), leaf_names, step, last_saved)
        if error is not None:
            raise error

    def run_eval(step: int, prefix: str = "") -> None:
        eval_metrics = evaluate(state["teacher"])
        writer.write_scalars(step, {f"{prefix}test/{k[5:]}": v for k, v in eval_metrics.items()})
        final_metrics.update({f"{prefix}{k}": v for k, v in eval_metrics.items()})
        record(step, {f"{prefix}{k}": v for k, v in eval_metrics.items()})
        logging.info("Step %d: %s", step, ", ".join(f"{prefix}{k}={v:.4f}" for k, v in eval_metrics.items()))

    step = first_step
    try:
        with jax.set_mesh(mesh):
            if first_step == 0 and config.get("eval_at_start", True):
                run_eval(0, prefix="init_")  # the same network at initialization
            for step in range(first_step + 1, total_steps + 1):
                with jax.profiler.StepTraceAnnotation("train", step_num=step):
                    state, metrics = p_train_step(state, to_global(next(data)))
                pending.append(metrics)
                progress(step)
                last = step == total_steps
                if step % config.log_every_steps == 0 or last:
                    check_finite(step)
                    train_metrics = {k: float(np.mean(v)) for k, v in jax.device_get(train.stack_metrics(pending)).items()}
                    train_metrics["nonfinite_steps"] = float(pending[-1]["nonfinite_steps"])
                    pending = []
                    writer.write_scalars(step, {f"train/{k}": v for k, v in train_metrics.items()})
                    final_metrics.update({f"train_{k}": v for k, v in train_metrics.items()})
                    record(step, {f"train_{k}": v for k, v in train_metrics.items()})
                if (config.get("eval_every_steps") and step % config.eval_every_steps == 0) or last:
                    run_eval(step)
                preempted = mngr.reached_preemption(step) or stop_signal.raised
                if (config.get("checkpoint_every_steps") and step % config.checkpoint_every_steps == 0) or last or preempted:
                    check_finite(step)
                    checkpoint.save(mngr, step, state, meta(step))
                    last_saved = step
                if preempted:
                    logging.warning("Stopping at step %d on a preemption/termination signal; checkpoint saved.", step)
                    break
    finally:  # whatever stops the loop, saves already started are completed
        mngr.wait_until_finished()
        mngr.close()
    writer.flush()
    final_metrics["step"] = step
    if is_chief:
        epath.Path(workdir, "final_metrics.json").write_text(json.dumps(final_metrics, indent=2))
    return final_metrics
