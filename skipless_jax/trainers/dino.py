"""DINO self-supervised training (docs/method/ssl.md §6), top to bottom: schedules → centre and EMA
→ optimizer → mesh → data → model/optimizer (abstract first) → shardings → update step →
checkpoint load → kNN / linear evaluation of the teacher → the loop (trainers/loop.py).

    python -m skipless_jax.main --config=configs/dino_digits.py --workdir=/tmp/dino_digits

Built on trainers/common.py and run by the one loop (no other trainer is imported): it shares
the model registry, the input pipeline, the sharding rules, the checkpoint manager, the
optimizer registry, the evaluators and its loss (losses.dino_loss), and adds the
student/teacher pair. Everything DINO keeps across steps is in the one
checkpointed state: student params, optimizer state, EMA teacher, centre, step (every schedule
is a closed form of the step; the values of the last step are stored too, for inspection).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import optax
from absl import logging
from flax import struct

from skipless_jax import checkpoint, evaluators, losses, models, pretrained, sharding, validate
from skipless_jax.checks import is_finite, require
from skipless_jax.data import device_images, inputs, multicrop, sources
from skipless_jax.models import dino_head, flops, roles
from skipless_jax.models.common import layer_ndim
from skipless_jax.optim import OPTIMIZERS
from skipless_jax.trainers import common, image_geometry, image_trainer, loop, model_ema, nonfinite, perf, warm_start
from skipless_jax.trainers.workdir import open_workdir

EVALUATOR_TYPES = ("knn", "linear_probe", "tokencut", "linear_segmentation", "feature_pca", "fewshot", "dino_linear")

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
        return {
            "lr": self.lr(step), "wd": self.wd(step), "momentum": self.momentum(step), "teacher_temp": self.temp(step)
        }


def schedules_from_config(config: ml_collections.ConfigDict, num_train: int) -> Schedules:
    spe = inputs.steps_per_epoch(config, num_train, **multicrop.EPOCH_STEPS)
    opt, d = config.optimizer, config.dino
    ref = opt.get("lr_reference_batch")
    return Schedules(
        total_steps=common.steps_of(config, "total", spe),
        steps_per_epoch=spe,
        warmup_steps=common.steps_of(config, "warmup", spe),
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
# Centre (the teacher's EMA: model_ema.update; the loss: losses.dino_loss).


def update_center(center: jax.Array, teacher_out: jax.Array, momentum: float) -> jax.Array:
    """c ← m·c + (1 − m)·mean of the teacher outputs over views and the global batch; (1, K)."""
    batch_center = jnp.mean(teacher_out.reshape(-1, teacher_out.shape[-1]), axis=0, keepdims=True)
    return center * momentum + batch_center * (1.0 - momentum)


def teacher_entropy(teacher_out: jax.Array, center: jax.Array, teacher_temp: jax.Array | float) -> dict[str, jax.Array]:
    """Collapse monitors (nats): mean per-example entropy of the teacher distribution (→ log K:
    uniform collapse) and entropy of its batch mean (→ 0: one-dimension collapse)."""
    q = jax.nn.softmax((teacher_out - center) / teacher_temp, axis=-1).reshape(-1, teacher_out.shape[-1])
    per_example = -jnp.sum(q * jnp.log(q + 1e-12), axis=-1).mean()
    marginal = q.mean(0)
    return {"teacher_entropy": per_example, "teacher_marginal_entropy": -jnp.sum(marginal * jnp.log(marginal + 1e-12))}


# ----------------------------------------------------------------------------------------
# Optimizer (docs/method/ssl.md §6): clip per tensor → the registry optimizer's direction (lr 1,
# no decay), the last layer in its own partition → × lr_t → decoupled decay lr_t·wd_t·p on
# ≥ 2-D tensors → the last layer's update zeroed while it is frozen. lr and wd follow the global
# step; the last layer's optimizer state does not advance while frozen (torch: its grad is None,
# so AdamW skips it: no moments, no step count, no decay), so its bias correction starts at
# t = 1 when it unfreezes.


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


def frozen_until(inner: optax.GradientTransformation, steps: int) -> optax.GradientTransformation:
    """While count < steps: a zero update and `inner`'s state kept as it was (not advanced)."""

    def init(params):
        return FreezeState(jnp.zeros((), jnp.int32), inner.init(params))

    def update(updates, state, params=None):
        on = state.count < steps
        out, new_inner = inner.update(updates, state.inner, params)
        out = jax.tree.map(lambda u: jnp.where(on, jnp.zeros_like(u), u), out)
        kept = jax.tree.map(lambda new, old: jnp.where(on, old, new), new_inner, state.inner)
        return out, FreezeState(optax.safe_increment(state.count), kept)

    return optax.GradientTransformation(init, update)


def zero_while_frozen(frozen: Callable[[Any], Any], steps: int) -> optax.GradientTransformation:
    """The leaves where `frozen(updates)` get a zero update while count < steps (decay included)."""

    def update(updates, state, params=None):
        del params
        on = state.count < steps
        out = jax.tree.map(lambda u, m: jnp.where(on, jnp.zeros_like(u), u) if m else u, updates, frozen(updates))
        return out, CountState(optax.safe_increment(state.count))

    return optax.GradientTransformation(lambda params: CountState(jnp.zeros((), jnp.int32)), update)


def is_last_layer(tree: Any) -> Any:
    """True for the DINO head's weight-normalized last layer."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: sharding.path_str(path).startswith(f"head/{dino_head.LAST_LAYER}"), tree
    )


# Left out of DINO's regularized group by role (models/roles.py): the biases, and Swin's
# relative-position tables (Swin's `no_weight_decay_keywords`, as optim.NO_DECAY).
DINO_UNDECAYED = roles.BIASES | {roles.RELATIVE_POSITION_TABLE}


def dino_decay_mask(params: Any) -> Any:
    """DINO's regularized group: every tensor of ≥ 2 dims per layer whose role (`models.find_role`)
    is not in DINO_UNDECAYED (pos_embedding and cls are decayed)."""
    def leaf(path: tuple[Any, ...], p: Any) -> bool:
        name = sharding.path_str(path)
        return layer_ndim(name, p) >= 2 and models.find_role(name) not in DINO_UNDECAYED

    return jax.tree_util.tree_map_with_path(leaf, params)


def build_dino_optimizer(config: ml_collections.ConfigDict, sched: Schedules) -> optax.GradientTransformation:
    """The registry's optimizer (`config.optimizer.name`: adamw, soap, ...) inside DINO's pieces."""
    opt = ml_collections.ConfigDict(config.optimizer.to_dict())
    opt.weight_decay = 0.0  # decay is scheduled below, the same for every optimizer
    direction = lambda: OPTIMIZERS[opt.name](opt, 1.0)
    labels = lambda params: jax.tree.map(lambda last: "last_layer" if last else "rest", is_last_layer(params))
    steps = sched.freeze_last_layer_steps
    parts = [clip_per_tensor(config.dino.clip_grad)] if config.dino.clip_grad else []
    parts += [
        optax.multi_transform({"last_layer": frozen_until(direction(), steps), "rest": direction()}, labels),
        optax.scale_by_schedule(sched.lr),
        scheduled_weight_decay(sched.lr, sched.wd, dino_decay_mask),
        zero_while_frozen(is_last_layer, steps),
    ]
    return optax.chain(*parts)


# ----------------------------------------------------------------------------------------
# Model and config.


def build_model(config: ml_collections.ConfigDict) -> dino_head.DINO:
    """The registry's backbone (its learned position table sized for the global crop) + DINO head."""
    backbone = models.build(config.model, 0, image_size=inputs.image_size(config))  # no classifier
    d = config.dino
    head = dino_head.DINOHead(
        out_dim=d.out_dim,
        hidden_dim=d.hidden_dim,
        bottleneck_dim=d.bottleneck_dim,
        num_layers=d.get("num_layers", 3),
        norm_last_layer=d.norm_last_layer,
        dtype=backbone.dtype,
    )
    return dino_head.DINO(backbone=backbone, head=head)


def check_config(config: ml_collections.ConfigDict, num_devices: int | None = None) -> None:
    """Every bad field fails here in one line, before anything compiles."""
    validate.validate_config(config, num_devices)
    accum = config.get("grad_accum_steps") or 1
    require(accum == 1, f"config.grad_accum_steps={accum!r}: the dino trainer does not accumulate gradients "
             "(the centre and the teacher see the whole batch); allowed: 1 or None")
    require(not config.get("grad_clip_norm"), f"config.grad_clip_norm={config.get('grad_clip_norm')!r}: the dino "
             "trainer clips per tensor (config.dino.clip_grad); allowed: None")
    require(not config.get("label_smoothing"), f"config.label_smoothing={config.get('label_smoothing')!r} has no "
             "meaning for the dino trainer; allowed: 0 or None")
    patch = models.describe(config.model).patch_size
    multicrop.validate_multicrop_config(config.input.multicrop, patch)
    d = config.dino
    for field in ("student_temp", "teacher_temp", "warmup_teacher_temp"):
        v = d.get(field)
        require(is_finite(v) and v > 0, f"config.dino.{field}={v!r} must be a finite number > 0")
    for field in ("momentum_teacher", "center_momentum"):
        v = d.get(field)
        require(is_finite(v) and 0 <= v <= 1, f"config.dino.{field}={v!r} must be in [0, 1]")
    for field in ("out_dim", "hidden_dim", "bottleneck_dim"):
        v = d.get(field)
        require(isinstance(v, int) and not isinstance(v, bool) and v > 0,
                 f"config.dino.{field}={v!r} must be a positive integer")
    for field in ("warmup_teacher_temp_epochs", "freeze_last_layer_epochs"):
        v = d.get(field)
        require(is_finite(v) and v >= 0, f"config.dino.{field}={v!r} must be a number >= 0")
    v = d.get("clip_grad")
    require(v is None or (is_finite(v) and v >= 0), f"config.dino.clip_grad={v!r} must be >= 0 (0 or None: off)")
    for field in ("min_lr", "weight_decay_end"):
        v = config.optimizer.get(field, 0.0)
        require(is_finite(v) and v >= 0, f"config.optimizer.{field}={v!r} must be a finite number >= 0")
    ref = config.optimizer.get("lr_reference_batch")
    require(ref is None or (is_finite(ref) and ref > 0),
             f"config.optimizer.lr_reference_batch={ref!r} must be > 0 or None")
    evaluators.check_config(config, EVALUATOR_TYPES, required_by="dino")
    evaluators.check_data(config)


# ----------------------------------------------------------------------------------------
# The update step.


def _batch_major(views: jax.Array) -> jax.Array:
    """(B, n, H, W, C) -> (B·n, H, W, C), example-major (row b·n + v): the batch sharding of the
    leading axis survives the reshape (a crop-major order would gather the batch on every device)."""
    b, n = views.shape[:2]
    return sharding.constrain_batch(views.reshape((b * n,) + tuple(views.shape[2:])))


def _view_major(out: jax.Array, b: int) -> jax.Array:
    """(B·n, K) example-major head outputs -> (n, B, K), the batch axis kept split."""
    per_example = sharding.constrain_batch(out.reshape(b, -1, out.shape[-1]))
    return sharding.constrain_batch(per_example.swapaxes(0, 1), dim=1)


def teacher_outputs(model: dino_head.DINO, teacher: Any, batch: dict[str, jax.Array]) -> jax.Array:
    """(2, B, K) teacher head outputs on the two global crops (no gradient)."""
    b = batch["global"].shape[0]
    out, _ = model.apply({"params": teacher}, (_batch_major(batch["global"]),), train=False)
    return jax.lax.stop_gradient(_view_major(out, b))


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
    """The DINO loss of the student on all 2 + N crops against the centred, sharpened teacher.

    The views enter the model example-major (`_batch_major`), so the student's passes are
    data-parallel; the outputs are put back in view order (V, B, K) for the loss.
    """
    b = batch["global"].shape[0]
    globals_ = _batch_major(batch["global"])
    has_local = batch["local"].shape[1] > 0
    views = (globals_, _batch_major(batch["local"])) if has_local else (globals_,)
    out, _ = model.apply({"params": params}, views, train=True, rngs={"dropout": rng})
    student_out = _view_major(out[: 2 * b], b)
    if has_local:
        student_out = jnp.concatenate([student_out, _view_major(out[2 * b:], b)], axis=0)
    return losses.dino_loss(student_out, teacher_out, center, student_temp, teacher_temp)


@struct.dataclass
class DinoState:
    """DINO's train state: the student and its optimizer, the teacher (its EMA) and the centre.
    Each field is one entry of its checkpoint, under the same name, in alphabetical order (the
    checkpoint's)."""

    center: jax.Array  # (1, out_dim): the running mean of the teacher's outputs
    nonfinite: nonfinite.Nonfinite  # the non-finite guard's counters (trainers/nonfinite.py)
    opt_state: Any
    params: Any  # the student
    rng: jax.Array
    schedules: dict[str, jax.Array]  # the schedules' values at the last step (Schedules.values)
    step: jax.Array
    teacher: Any  # the teacher's parameters (the evaluated network)


def guarded_parts(grads: Any, params: Any, opt_state: Any, teacher: Any) -> dict[str, Any]:
    """The trees an update must leave finite, in the order the non-finite guard numbers them."""
    return {"gradient": grads, "parameter": params, "optimizer state": opt_state, "teacher": teacher}


def make_train_step(
    model: dino_head.DINO, tx: optax.GradientTransformation, sched: Schedules, dino_config: Any,
    image_stats: tuple[tuple[float, ...], tuple[float, ...]] | None = None,
) -> Callable[[DinoState, dict[str, jax.Array]], tuple[DinoState, dict[str, jax.Array]]]:
    """(state, {'global': (B, 2, G, G, C), 'local': (B, N, L, L, C)}) -> (state, metrics).

    Means over the batch are over the global batch (the arrays are global), so the loss, the
    centre and the entropies are the same on any mesh. `image_stats` (mean, std): uint8 crops
    are normalized with them first (float crops pass as they are).
    """
    student_temp = dino_config.student_temp
    center_momentum = dino_config.center_momentum

    def train_step(state: DinoState, batch: dict[str, jax.Array]) -> tuple[DinoState, dict[str, jax.Array]]:
        step, params = state.step, state.params
        if image_stats is not None:
            batch = device_images.prepare(batch, *image_stats, fields=("global", "local"))
        values = sched.values(step)
        teacher_out = teacher_outputs(model, state.teacher, batch)
        rng = jax.random.fold_in(state.rng, step)
        loss, grads = jax.value_and_grad(
            lambda p: student_loss(
                model, p, batch, teacher_out, state.center, student_temp, values["teacher_temp"], rng
            )
        )(params)
        updates, opt_state = tx.update(grads, state.opt_state, params)
        new_params = optax.apply_updates(params, updates)
        new_teacher = model_ema.update(state.teacher, new_params, values["momentum"])
        new_center = update_center(state.center, teacher_out, center_momentum)  # after the loss

        # A non-finite loss, gradient, parameter or optimizer state leaves the state untouched.
        ok, counters = nonfinite.track_nonfinite(
            loss, guarded_parts(grads, new_params, opt_state, new_teacher), state.nonfinite, step
        )
        new_state = state.replace(  # the fields not named here (rng) pass through
            step=step + 1,
            params=nonfinite.keep_if(ok, new_params, params),
            teacher=nonfinite.keep_if(ok, new_teacher, state.teacher),
            center=nonfinite.keep_if(ok, new_center, state.center),
            opt_state=nonfinite.keep_if(ok, opt_state, state.opt_state),
            schedules=values,
            nonfinite=counters,
        )
        metrics = {
            "loss": loss,
            **values,
            **teacher_entropy(teacher_out, state.center, values["teacher_temp"]),
            "grad_norm": optax.tree.norm(grads),
            "param_norm": optax.tree.norm(params),
            "nonfinite_steps": new_state.nonfinite.count,
        }
        return new_state, metrics

    return train_step


def init_state_fn(
    model_config: ml_collections.ConfigDict, model: dino_head.DINO, tx: optax.GradientTransformation,
    sched: Schedules, dummy: jax.Array, out_dim: int
) -> Callable[[jax.Array], DinoState]:
    """rng -> the whole train state (the backbone's init that of `model_config`,
    `models.init_variables`); teacher = a copy of the student (same init), centre = 0."""

    def init_state(rng: jax.Array) -> DinoState:
        init_rng, train_rng = jax.random.split(rng)
        params = models.init_variables(model_config, model, init_rng, (dummy,))["params"]
        return DinoState(
            step=jnp.zeros((), jnp.int32),
            params=params,
            teacher=jax.tree.map(jnp.copy, params),
            center=jnp.zeros((1, out_dim), jnp.float32),
            opt_state=tx.init(params),
            schedules=sched.values(0),
            rng=train_rng,
            nonfinite=nonfinite.init_nonfinite(),
        )

    return init_state


def build(config: ml_collections.ConfigDict) -> tuple[Any, optax.GradientTransformation, Any,
                                                       Callable[[jax.Array], DinoState]]:
    """(model, optimizer, schedules, rng -> the fresh train state) of `config`."""
    sched = schedules_from_config(config, inputs.num_train_examples(config))
    size, channels = inputs.image_size(config), sources.dataset_info(config.dataset.name).image_shape[-1]
    model, tx = build_model(config), build_dino_optimizer(config, sched)
    dummy = jnp.zeros((1, size, size, channels), jnp.float32)
    return model, tx, sched, init_state_fn(config.model, model, tx, sched, dummy, config.dino.out_dim)


def initial_state(config: ml_collections.ConfigDict) -> Callable[[jax.Array], DinoState]:
    """rng -> the fresh train state of `config`, as `train_and_evaluate` builds it."""
    return build(config)[3]


# ----------------------------------------------------------------------------------------
# Training and evaluation.


def init_from_rename(available: Sequence[str]) -> Callable[[str], str | None]:
    """Target path -> source path: a DINO checkpoint has the same names; a classifier's
    parameters fill the backbone (its head is not used); the DINO head stays fresh then."""
    if any(name.startswith("backbone/") for name in available):
        return lambda name: name
    return lambda name: name[len("backbone/"):] if name.startswith("backbone/") else None


def evaluation(
    config: ml_collections.ConfigDict, mesh: jax.sharding.Mesh, model: Any = None, picture_dir: str | None = None
) -> tuple[evaluators.Context, str]:
    """(evaluator context of the teacher's backbone features (pictures under `picture_dir`), the
    state entry it evaluates: 'teacher')."""
    model = model or build_model(config)
    ctx = evaluators.Context(
        config, mesh, sources.dataset_info(config.dataset.name).num_classes,
        features=lambda params, images: model.apply({"params": params}, images, method=dino_head.DINO.embed),
        outputs=lambda params, images: model.apply({"params": params}, images, method=dino_head.DINO.backbone_outputs),
        picture_dir=picture_dir,
    )
    return ctx, "teacher"


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str, devices: Sequence[jax.Device] | None = None,
                       allow_config_change: bool = False) -> dict[str, Any]:
    """Trains DINO per `config` in `workdir` (resuming from it); returns the final metrics.

    `devices` (default: all) is the set the mesh is laid over. Raises `Preempted` after
    saving when stopped by SIGTERM or a preemption notice.
    """
    mesh = common.setup(config, devices, check_config)

    # ---- Model and optimizer, abstract first.
    model, tx, sched, init_state = build(config)
    total_steps = sched.total_steps
    rng, abstract_state, shardings = common.abstract_state(init_state, config, mesh)
    logging.info("DINO: %s student parameters, %d steps (%d per epoch).",
                 f"{common.num_parameters(abstract_state.params):,}", total_steps, sched.steps_per_epoch)

    # ---- Checkpoint load: workdir > config.resume > config.init_from > scratch.
    mngr, finished = open_workdir(config, workdir, total_steps, allow_config_change)
    if finished is not None:
        return finished

    load_init_from = warm_start.loader(
        config, tx, shardings, lambda key: init_from_rename(checkpoint.param_shapes(config.init_from, key)))
    state = pretrained.restore_or_init(config, workdir, mngr, init_state, rng, abstract_state, shardings,
                                       load_init_from=load_init_from)

    # ---- The update step (state donated) and the evaluators of the teacher.
    step_fn = make_train_step(model, tx, sched, config.dino, device_images.dataset_stats(config))
    train_step = jax.jit(step_fn, donate_argnums=0, out_shardings=(shardings, sharding.replicated(mesh)))
    ctx, _ = evaluation(config, mesh, model, picture_dir=workdir)
    evals = evaluators.build(config, ctx)

    # ---- Loop.
    a = abstract_state
    train_step, cost = perf.compile_for(  # and the fit check, before the input pipeline exists
        train_step, state, multicrop.train_batch_spec(config, on_device=True), sharding.batch_sharding(mesh), config)
    at_start = (lambda state: evaluators.run_all(evals, ctx, state.teacher)) if config.get(
        "eval_at_start", True) else None  # the same network at init
    return loop.train(
        config, workdir, mesh, mngr, state, train_step, cost, total_steps=total_steps,
        guarded=guarded_parts(a.params, a.params, a.opt_state, a.teacher),
        train_iterator=multicrop.train_iterator,
        results_at=lambda step, state: evaluators.run_all(evals, ctx, state.teacher, step, total_steps),
        eval_every=[e.every_steps for e in evals], results_at_start=at_start)

def flops_per_example(config: ml_collections.ConfigDict) -> tuple[float, float]:
    """(model FLOPs, Token Graying FLOPs) of one training image: every crop (models/flops.py)."""
    size, channels, _ = image_geometry(config)
    crops = config.input.get("multicrop")
    return (flops.dino_train_flops(config.model, size, config.get("dino"), crops, channels=channels),
            flops.dino_tg_flops(config.model, size, crops, channels=channels))


TRAINER = image_trainer("dino", check_config, train_and_evaluate, evaluation, EVALUATOR_TYPES, flops_per_example,
                        initial_state=initial_state, epoch_steps=multicrop.EPOCH_STEPS, build_model=build_model,
                        backbone_key="teacher")
