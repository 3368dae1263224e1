"""MAE pre-training, top to bottom: mesh → data → model/optimizer (abstract first) → shardings →
update step → checkpoint load → evaluators → the loop (trainers/loop.py; docs/method/ssl.md §9).

    python -m skipless_jax.main --config=configs/mae_digits_pretrain.py --workdir=/tmp/mae

The encoder is the ViT of `config.model` (its skips, skipless init and Token Graying); the
decoder and the loss are `config.mae`. Evaluators (kNN, linear probe) read the encoder's class
token through a `vit.ViT` view of the same parameters (the names are the ViT's). At every
evaluation and at the end a picture of original / masked / reconstructed eval images is written
to `<workdir>/reconstructions/`. Fine-tuning is the supervised trainer with `config.init_from`
pointing at this run (the MAE → classifier mapping is `warm_start.classifier_rename`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from absl import logging

from skipless_jax import evaluators, models, pictures, pretrained, rng_streams, sharding, validate
from skipless_jax.checks import is_positive_int, require
from skipless_jax.data import device_images, inputs, sources
from skipless_jax.models import flops, vit
from skipless_jax.models import mae as mae_lib
from skipless_jax.models.common import patchify, unpatchify
from skipless_jax.optim import build_optimizer
from skipless_jax.trainers import common, image_geometry, image_trainer, loop, nonfinite, perf, warm_start
from skipless_jax.trainers.workdir import open_workdir

EVALUATOR_TYPES = ("knn", "linear_probe", "fewshot", "dino_linear")
TARGETS = ("raw", "grayed")
# config.model fields of a classifier that MAE's encoder does not have.
_CLASSIFIER_ONLY = ("pool", "posemb", "dropout", "head_zero_init", "head_init_std", "image_size",
                    "posemb_antialias", "capture_attention")


def check_config(config: ml_collections.ConfigDict, num_devices: int | None = None) -> None:
    """Every bad field fails here in one line, before anything compiles."""
    validate.validate_config(config, num_devices)
    name = config.model.get("name", "vit") or "vit"
    require(name == "vit", f"config.model.name={name!r}: the mae trainer's encoder is a ViT; allowed: 'vit'")
    accum = config.get("grad_accum_steps") or 1
    require(accum == 1, f"config.grad_accum_steps={accum!r}: the mae trainer does not accumulate; allowed: 1 or None")
    require(not config.get("label_smoothing"), f"config.label_smoothing={config.get('label_smoothing')!r} has no "
             "meaning for the mae trainer; allowed: 0 or None")
    aug = config.input.get("aug")
    require(aug is None or not (aug.get("mixup") or aug.get("cutmix")),
             "config.input.aug mixes images (mixup/cutmix); MAE reconstructs them: allowed: mixup=0, cutmix=0")
    require(config.get("mae") is not None, "config.mae must be set (mask_ratio, norm_pix_loss, decoder_*)")
    m = config.mae
    ratio = m.get("mask_ratio")
    require(isinstance(ratio, (int, float)) and not isinstance(ratio, bool) and 0 <= ratio < 1,
             f"config.mae.mask_ratio={ratio!r} must be in [0, 1)")
    patch = models.describe(config.model).patch_size
    length = (inputs.image_size(config) // patch) ** 2
    require(mae_lib.num_kept(length, ratio) >= 1,
             f"config.mae.mask_ratio={ratio!r} keeps no patch of the {length} (allowed: < {1 - 1 / length:.4f})")
    for field in ("norm_pix_loss", "decoder_skip_sab", "decoder_skip_ffn"):
        value = m.get(field, field != "norm_pix_loss")
        require(isinstance(value, bool), f"config.mae.{field}={value!r} must be True or False")
    for field in ("decoder_width", "decoder_depth", "decoder_num_heads", "decoder_mlp_ratio"):
        value = m.get(field)
        require(is_positive_int(value), f"config.mae.{field}={value!r} must be a positive integer")
    require(m.decoder_width % m.decoder_num_heads == 0,
             f"config.mae.decoder_num_heads={m.decoder_num_heads} does not divide "
             f"config.mae.decoder_width={m.decoder_width}")
    target = m.get("target", "raw")
    require(target in TARGETS, f"config.mae.target={target!r} is unknown; allowed: {list(TARGETS)}")
    images = m.get("picture_images", 8)
    require(isinstance(images, int) and not isinstance(images, bool) and images >= 0,
             f"config.mae.picture_images={images!r} must be an integer >= 0 (0: no picture)")
    evaluators.check_config(config, EVALUATOR_TYPES, required_by="mae")
    evaluators.check_data(config)


def build_model(config: ml_collections.ConfigDict) -> mae_lib.MAE:
    """MAE with the ViT encoder of `config.model` and the decoder/loss of `config.mae`."""
    kwargs = vit.model_kwargs(config.model, 0)
    for field in ("num_classes", *_CLASSIFIER_ONLY):
        kwargs.pop(field, None)
    m = config.mae
    return mae_lib.MAE(
        **kwargs,
        mask_ratio=float(m.mask_ratio),
        norm_pix_loss=bool(m.get("norm_pix_loss", False)),
        decoder_width=m.decoder_width,
        decoder_depth=m.decoder_depth,
        decoder_num_heads=m.decoder_num_heads,
        decoder_mlp_ratio=m.get("decoder_mlp_ratio", 4),
        decoder_skip_sab=m.get("decoder_skip_sab", True),
        decoder_skip_ffn=m.get("decoder_skip_ffn", True),
        target=m.get("target", "raw"),
    )


def encoder_view(config: ml_collections.ConfigDict) -> vit.ViT:
    """A backbone `vit.ViT` (class token, fixed sin-cos table, no head) that reads the MAE's encoder
    parameters by name: the encoder without masking, for evaluation."""
    model_config = ml_collections.ConfigDict(config.model.to_dict())
    model_config.update(dict(pool="tok", posemb="sincos2d", dropout=0.0))
    return models.build(model_config, 0)


def encoder_params(params: dict[str, Any]) -> dict[str, Any]:
    """The MAE's parameters without the decoder's."""
    return {k: v for k, v in params.items() if k != "decoder"}


def make_train_step(
    model: mae_lib.MAE, tx: optax.GradientTransformation, schedule: optax.Schedule, config: ml_collections.ConfigDict
):
    """(state, {'image', ...}) -> (state, metrics). The masks of step s come from
    fold_in(state.rng, s) alone; a non-finite update is rejected."""

    def loss_fn(params, images, rng):
        masking, dropout = jax.random.split(rng)
        loss, _, mask = model.apply({"params": params}, images, train=True, rngs={"masking": masking,
                                                                                   "dropout": dropout})
        return loss, mask.mean()

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    mean, std = device_images.dataset_stats(config)

    def train_step(state: common.TrainState, batch: dict[str, jax.Array]) -> tuple[common.TrainState, dict]:
        step, params = state.step, state.params
        rng = jax.random.fold_in(state.rng, step)
        batch = device_images.prepare(batch, mean, std, jax.random.fold_in(rng, rng_streams.ERASE))
        (loss, masked), grads = grad_fn(params, batch["image"], rng)
        return nonfinite.guarded_update(state, loss, grads, tx, schedule, masked_fraction=masked)

    return train_step


def make_init_state(config: ml_collections.ConfigDict, model: mae_lib.MAE, tx: optax.GradientTransformation,
                    dummy: jax.Array) -> Callable[[jax.Array], common.TrainState]:
    """rng -> the train state of `model` (`common.TrainState`), for images shaped like `dummy`."""

    def init_state(rng: jax.Array) -> common.TrainState:
        init_rng, masking_rng, train_rng = jax.random.split(rng, 3)
        params = models.init_variables(config.model, model, init_rng, dummy, masking=masking_rng)["params"]
        return common.TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params),
                                 rng=train_rng, nonfinite=nonfinite.init_nonfinite())

    return init_state


def build(config: ml_collections.ConfigDict) -> tuple[mae_lib.MAE, optax.GradientTransformation, optax.Schedule,
                                                       Callable[[jax.Array], common.TrainState]]:
    """(model, optimizer, its schedule, rng -> the fresh train state) of `config`."""
    size, channels = inputs.image_size(config), sources.dataset_info(config.dataset.name).image_shape[-1]
    model = build_model(config)
    tx, schedule = build_optimizer(config, *common.train_steps(config, inputs.steps_per_epoch(config)))
    return model, tx, schedule, make_init_state(config, model, tx, jnp.zeros((1, size, size, channels), jnp.float32))


def initial_state(config: ml_collections.ConfigDict) -> Callable[[jax.Array], common.TrainState]:
    """rng -> the fresh train state of `config`, as `train_and_evaluate` builds it."""
    return build(config)[3]


def evaluation(
    config: ml_collections.ConfigDict, mesh: jax.sharding.Mesh, model: Any = None, picture_dir: str | None = None
) -> tuple[evaluators.Context, str]:
    """(evaluator context of the encoder's class token (pictures under `picture_dir`), the state
    entry it evaluates: 'params')."""
    del model
    view = encoder_view(config)

    def apply(params: Any, images: jax.Array) -> tuple[jax.Array, dict[str, Any]]:
        return view.apply({"params": encoder_params(params)}, images, train=False)

    ctx = evaluators.Context(
        config, mesh, sources.dataset_info(config.dataset.name).num_classes,
        features=lambda params, images: apply(params, images)[0],
        outputs=lambda params, images: apply(params, images)[1],
        picture_dir=picture_dir,
    )
    return ctx, "params"


# ----------------------------------------------------------------------------------------
# The picture: original / masked / reconstruction.


def reconstruction_rows(
    images: np.ndarray, prediction: np.ndarray, mask: np.ndarray, patch_size: int, norm_pix_loss: bool,
    mean: Sequence[float], std: Sequence[float],
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(original, masked, reconstruction) as (N, H, W, C) images in [0, 1].

    The reconstruction shows the prediction on the removed patches and the input elsewhere (MAE's
    "reconstruction + visible"); with `norm_pix_loss` each predicted patch is mapped back with its
    target patch's mean and standard deviation.
    """
    n, h, w, c = images.shape
    grid = (h // patch_size, w // patch_size)
    target = np.asarray(jax.device_get(patchify(jnp.asarray(images), patch_size)), np.float64)
    pred = np.asarray(prediction, np.float64)
    if norm_pix_loss:
        mu = target.mean(-1, keepdims=True)
        sigma = np.sqrt(target.var(-1, keepdims=True, ddof=1) + 1e-6)
        pred = pred * sigma + mu
    removed = np.asarray(mask, bool)[..., None]
    masked = np.where(removed, np.nan, target)
    pasted = np.where(removed, pred, target)

    def to_image(patches: np.ndarray) -> np.ndarray:
        image = np.asarray(jax.device_get(unpatchify(jnp.asarray(patches), grid, patch_size, c)), np.float64)
        return np.clip(image * np.asarray(std) + np.asarray(mean), 0.0, 1.0)

    return to_image(target), to_image(masked), to_image(pasted)


def picture_fn(config: ml_collections.ConfigDict, model: mae_lib.MAE, ctx: evaluators.Context, workdir: str):
    """params, step -> writes <workdir>/reconstructions/step_<step>.png (and reconstruction.png);
    the first `config.mae.picture_images` eval images, masks from a fixed key (seed, 'picture')."""
    count = config.mae.get("picture_images", 8)
    if not count:
        return None
    info = sources.dataset_info(config.dataset.name)
    shards = sharding.num_data_shards(ctx.mesh) * jax.process_count()
    batch_size = math.ceil(count / shards) * shards
    batches, _ = ctx.batches(config.dataset.eval_split, batch_size=batch_size, workers=False)
    images = next(batches)["image"]
    key = jax.random.fold_in(jax.random.PRNGKey(config.seed), rng_streams.MAE_PICTURE)

    def forward(params: Any, images: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        _, prediction, mask = model.apply({"params": params}, images, train=False, rngs={"masking": key})
        return images, prediction, mask

    apply = jax.jit(forward, out_shardings=sharding.replicated(ctx.mesh))  # every host holds all rows

    def write(params: Any, step: int) -> None:
        shown, prediction, mask = jax.device_get(apply(params, images))
        if jax.process_index() != 0:
            return
        rows = reconstruction_rows(shown[:count], prediction[:count], mask[:count],
                                   model.patch_size, model.norm_pix_loss, info.mean, info.std)
        title = f"step {step}: original / masked ({model.mask_ratio:.0%}) / reconstruction"
        labelled = list(zip(("original", "masked", "reconstruction"), rows))
        for path in (os.path.join(workdir, "reconstructions", f"step_{step:06d}.png"),
                     os.path.join(workdir, "reconstruction.png")):
            pictures.image_grid(path, labelled, title)

    return write


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str, devices: Sequence[jax.Device] | None = None,
                       allow_config_change: bool = False) -> dict[str, Any]:
    """Pre-trains MAE per `config` in `workdir` (resuming from it); returns the final metrics.

    Raises `Preempted` after saving when stopped by SIGTERM or a preemption notice.
    """
    mesh = common.setup(config, devices, check_config)
    steps_per_epoch = inputs.steps_per_epoch(config)
    total_steps, warmup_steps = common.train_steps(config, steps_per_epoch)

    # ---- Model and optimizer, abstract first.
    model, tx, schedule, init_state = build(config)
    rng, abstract_state, shardings = common.abstract_state(init_state, config, mesh)
    logging.info("MAE: %s parameters (encoder %s), %d train steps (%.1f per epoch), %d warm-up steps.",
                 f"{common.num_parameters(abstract_state.params):,}",
                 f"{common.num_parameters(encoder_params(abstract_state.params)):,}", total_steps, steps_per_epoch,
                 warmup_steps)

    # ---- Checkpoint load: workdir > config.resume > config.init_from > scratch.
    mngr, finished = open_workdir(config, workdir, total_steps, allow_config_change,
                                  derived={"schedule.warmup_steps": warmup_steps})
    if finished is not None:
        return finished

    state = pretrained.restore_or_init(config, workdir, mngr, init_state, rng, abstract_state, shardings,
                                       load_init_from=warm_start.loader(config, tx, shardings))

    # ---- The update step (state donated), the evaluators and the picture.
    train_step = jax.jit(make_train_step(model, tx, schedule, config), donate_argnums=0,
                           out_shardings=(shardings, sharding.replicated(mesh)))
    ctx, _ = evaluation(config, mesh, picture_dir=workdir)
    evals = evaluators.build(config, ctx)
    picture = picture_fn(config, model, ctx, workdir)

    # ---- Loop.
    train_step, cost = perf.compile_for(  # and the fit check, before the input pipeline exists
        train_step, state, inputs.train_batch_spec(config, on_device=True), sharding.batch_sharding(mesh), config)
    hooks = [] if picture is None else [
        loop.Hook(config.get("eval_every_steps"), lambda step, state: picture(state.params, step))]
    return loop.train(
        config, workdir, mesh, mngr, state, train_step, cost, total_steps=total_steps,
        guarded=nonfinite.guarded_parts(abstract_state), train_iterator=inputs.train_iterator,
        results_at=lambda step, state: evaluators.run_all(evals, ctx, state.params, step, total_steps),
        eval_every=[e.every_steps for e in evals], hooks=hooks)

def flops_per_example(config: ml_collections.ConfigDict) -> tuple[float, float]:
    """(model FLOPs, Token Graying FLOPs) of one training image (models/flops.py)."""
    size, channels, _ = image_geometry(config)
    return (flops.mae_train_flops(config.model, size, config.get("mae"), channels=channels),
            flops.tg_flops_per_example(config.model, size, channels=channels))


TRAINER = image_trainer("mae", check_config, train_and_evaluate, evaluation, EVALUATOR_TYPES, flops_per_example,
                        initial_state=initial_state, build_model=build_model)
