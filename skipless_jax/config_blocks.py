"""Blocks that the recipe configs (configs/*.py) share, so each setting is written once.

A config file states its recipe (data, model size, schedule) and takes the rest from here:
the residual switches and init constants from its args, the AdamW/SOAP settings, the DeiT
augmentation, and the mesh/logging/checkpointing fields. A recipe that several config files
share (the same recipe with other default args) is a function here too, never one config file
executing another.
"""

from __future__ import annotations

import copy
from typing import Any

import ml_collections
from ml_collections.config_dict import placeholder

# Skipless-init constants (docs/method/papers.md §3).
VITB_SUPERVISED_INIT = dict(init_alpha=2.0, init_beta=0.6, init_c=3.0)  # ViT-B/16 supervised
DINO_VITS_INIT = dict(init_alpha=1.8, init_beta=1.0, init_c=3.0)  # DINO ViT-S/16
# The MAE recipes' init (docs/method/authors_init.md §3), each setting's source: Q/K uniform, V/O U V,
# c = 1 (W_v = W_p = 1.0) and Xavier-uniform MLP from the authors' fork (yipingji/mae models_mae.py,
# main_pretrain.py); α = 2, β = 0.6 from the paper's text (the fork does not record its own).
MAE_FORK_INIT = dict(VITB_SUPERVISED_INIT, init_c=1.0, init_qk_dist="uniform", init_vo="fork", init_mlp="default")


def deit_aug(**overrides: Any) -> dict[str, Any]:
    """DeiT-style train augmentation: RandAugment m9, flip, random erasing 0.25, mixup 0.8 /
    cutmix 1.0, random-resized crop (scale 0.08-1) unless overridden; label smoothing is the
    loss's `config.label_smoothing` (it applies to the mixed targets alike)."""
    aug = dict(
        randaug="rand-m9-mstd0.5-inc1",
        scale=(0.08, 1.0),
        flip=True,
        reprob=0.25,
        mixup=0.8,
        cutmix=1.0,
        mixup_switch_prob=0.5,
    )
    aug.update(overrides)
    return aug


def model_ema(decay: float = 0.99996, **overrides: Any) -> ml_collections.ConfigDict:
    """Model EMA (trainers/model_ema.py, timm ModelEmaV3): DeiT's decay 0.99996 without warm-up,
    evaluated by every config.evals entry under 'ema_<prefix>'; decay 0 is off."""
    return ml_collections.ConfigDict(dict(dict(decay=decay, warmup=False, warmup_gamma=1.0, warmup_power=2 / 3,
                                               evals=placeholder(tuple)), **overrides))


def vit_model(a: dict[str, Any], init_constants: dict[str, float], **fields: Any) -> ml_collections.ConfigDict:
    """`config.model`: the switches, init and Token Graying from the config args `a` (those it
    has), drop-path 0.1 only with both skips, class token, learned position embedding; `fields`
    (sizes or a variant, dtype, ...) are added and win."""
    skip_sab, skip_ffn = a.get("skip_sab", True), a.get("skip_ffn", True)
    tg = a.get("tg", "none")
    model = dict(
        skip_sab=skip_sab,
        skip_ffn=skip_ffn,
        pool="tok",
        posemb="learn",
        dropout=0.0,
        drop_path=0.1 if skip_sab and skip_ffn else 0.0,
        dtype="float32",
        init=a.get("init", "default"),
        **init_constants,
        token_graying=placeholder(str) if tg == "none" else tg,
        tg_eps=a.get("eps", 0.95),
    )
    model.update(fields)
    return ml_collections.ConfigDict(model)


def small_model_shampoo(opt: str, width: int) -> dict[str, Any]:
    """`shampoo_ec`'s block size for a model of `width` (update the optimizer block with it): 3 ×
    width keeps the regime of the fork's ViT-B at 8192 (docs/method/shampoo_ec.md): no weight
    matrix merged into one vector, every 1-D parameter one full factor, no block split. At 8192 a
    width-64 model's 64×128 kernels merge into 8192×8192 factors (18 GB at depth 8). Other
    optimizers: nothing."""
    return {"max_preconditioner_dim": 3 * width} if opt == "shampoo_ec" else {}


def optimizer(name: str, **fields: Any) -> ml_collections.ConfigDict:
    """`config.optimizer`: AdamW with b2 0.999, SOAP with Cutting the Skip's b1 0.9, b2 0.95
    and preconditioner refresh every 10 steps, or eigenvalue-corrected Shampoo with the authors'
    MAE fork's call (b1 0.9, b2 0.95, eps 1e-8, eigh every 100 steps, blocks of at most 8192;
    docs/method/shampoo_ec.md); `fields` (lr, weight decay, ...) are added."""
    opt = dict(name=name, **fields)
    if name == "soap":
        opt.update(b1=0.9, b2=0.95, precondition_frequency=10)
    elif name == "shampoo_ec":
        opt.update(b1=0.9, b2=0.95, eps=1e-8, precondition_frequency=100, max_preconditioner_dim=8192,
                   start_preconditioning_step=-1)
    else:
        opt.update(b1=0.9, b2=0.999)
    return ml_collections.ConfigDict(opt)


def lm_optimizer(name: str, lr: float) -> ml_collections.ConfigDict:
    """`config.optimizer` of the LM configs (GPT-2 / nanoGPT, docs/method/lm.md §4): AdamW with
    b1 0.9, b2 0.95, or SOAP (b2 0.95 already); weight decay 0.1 on the parameters of ≥ 2 dims."""
    opt = optimizer(name, lr=lr, weight_decay=0.1, weight_decay_rule="ndim")
    opt.b2 = 0.95
    return opt


def runtime(*, eval_every: int, checkpoint_every: int, log_every: int = 100, analysis: bool = True) -> dict[str, Any]:
    """The run's fields (`c.update(runtime(...))`): a data-parallel mesh (`--config.mesh.fsdp=8`
    shards parameters over 8 devices, data takes the rest), logging, evaluation and checkpoint
    periods in steps, 3 checkpoints kept, live log-κ monitoring present but off; the persistent XLA
    compilation cache in its default folder (`compilation_cache_dir`: None the default, '' off;
    skipless_jax/compilation_cache.py)."""
    fields = dict(
        mesh=ml_collections.ConfigDict(dict(data=-1, fsdp=1)),
        sharding_rules=[(".*", "fsdp")],
        log_every_steps=log_every,
        eval_every_steps=eval_every,
        checkpoint_every_steps=checkpoint_every,
        keep_checkpoints=3,
        compilation_cache_dir=placeholder(str),
        profile_steps=3,  # steps traced after warm-up into <workdir>/plugins/profile/ (0: off; trainers/profiler.py)
        profile_hlo=False,  # the compiled programs' HLO in that trace (op profile, memory viewer; MBs)
        peak_tflops=placeholder(float),  # per-device peak for perf/mfu; None: trainers/devices.py's table by device
        # Hosted tracking next to TensorBoard: off unless a project is named (trainers/wandb_writer.py).
        wandb=ml_collections.ConfigDict(
            dict(project=placeholder(str), entity=placeholder(str), name=placeholder(str), mode=placeholder(str))
        ),
    )
    if analysis:
        fields["analysis"] = ml_collections.ConfigDict(dict(every_steps=0, probe_size=32))
    return fields


def val_evals(split: str) -> ml_collections.ConfigDict:
    """`config.evals` of a run that holds `split` of its training set out: the test accuracy and
    the validation accuracy on `split` (what chooses learning rates; the test split never does)."""
    return ml_collections.ConfigDict(dict(test=dict(type="classification"),
                                          val=dict(type="classification", split=split)))


# DINO's backbone (facebookresearch/dino, docs/method/ssl.md §13): exact GELU, position tables of local
# crops resized bicubically without antialiasing.
DINO_BACKBONE = dict(gelu="exact", posemb_antialias=False)


def dino_evals(linear_l2: float, linear_steps: int) -> ml_collections.ConfigDict:
    """`config.evals` of the DINO recipes: weighted kNN (k 20, T 0.07) and the linear probe on
    the teacher's features, both on the eval split with the train split as their bank."""
    common = dict(split=placeholder(str), train_split=placeholder(str), prefix="test")
    return ml_collections.ConfigDict(dict(
        knn=dict(type="knn", k=20, temperature=0.07, **common),
        linear=dict(type="linear_probe", l2=linear_l2, steps=linear_steps, **common),
    ))


# The config arg `evals=` of the digits pre-training configs (configs/dino_digits.py,
# configs/mae_digits_pretrain.py): their own evaluators, or with the few-shot (docs/method/evals.md §17)
# and DINO linear-evaluation (§18) protocols added, at the last step only
# (experiments/fewshot_linear_digits.py): DINO's protocol as written and at lr 0.1·B/256.
FEWSHOT_LINEAR_EVALS = dict(
    fewshot=dict(type="fewshot", every_steps=0),
    dino_linear=dict(type="dino_linear", every_steps=0),
    dino_linear_lr0p1=dict(type="dino_linear", every_steps=0, lr=0.1),
)
EVAL_SETS = ("default", "fewshot_linear")


def eval_set(c: ml_collections.ConfigDict, name: str) -> ml_collections.ConfigDict:
    """`c` with the evaluators of the config arg evals=`name` (one of EVAL_SETS): 'default' leaves
    it as it is; 'fewshot_linear' adds FEWSHOT_LINEAR_EVALS and turns the evaluation at step 0 off."""
    if name not in EVAL_SETS:
        raise ValueError(f"config arg evals={name!r} is not allowed; allowed: {' | '.join(EVAL_SETS)}")
    if name == "fewshot_linear":
        c.eval_at_start = False
        for key, entry in FEWSHOT_LINEAR_EVALS.items():
            c.evals[key] = ml_collections.ConfigDict(entry)
    return c


# The dense evaluations of "Cutting the Skip" (docs/method/dense.md §7-8) by name: (type, dataset,
# split, train split, protocol); TokenCut has no train split.
DENSE_EVALS = {
    "voc_lin": ("linear_segmentation", "voc12_seg", "val", "train_aug", "lin"),
    "voc_ms": ("linear_segmentation", "voc12_seg", "val", "train_aug", "ms"),
    "ade_lin": ("linear_segmentation", "ade20k", "val", "train", "lin"),
    "ade_ms": ("linear_segmentation", "ade20k", "val", "train", "ms"),
    "cocostuff_lin": ("linear_segmentation", "coco_stuff", "val", "train", "lin"),
    "voc07_tokencut": ("tokencut", "voc07_boxes", "trainval", None, None),
    "voc12_tokencut": ("tokencut", "voc12_boxes", "trainval", None, None),
    "coco20k_tokencut": ("tokencut", "coco20k", "train", None, None),
}


def dense_evals(selection: str, root: str | None) -> dict[str, ml_collections.ConfigDict]:
    """Evaluator entries for `selection` ('none', 'all', or names of DENSE_EVALS joined by '+'),
    each reading its dataset from `root` (the folder that holds the datasets' folders; None: set
    data_dir per entry, or tfds for the VOC boxes); run at the end of training only."""
    names = [] if selection in ("", "none") else list(DENSE_EVALS) if selection == "all" else selection.split("+")
    unknown = [n for n in names if n not in DENSE_EVALS]
    if unknown:
        raise ValueError(f"config arg dense={selection!r}: {unknown[0]!r} is unknown; allowed: 'none', 'all' "
                         f"or '+'-joined names of {list(DENSE_EVALS)}")
    out = {}
    for name in names:
        kind, dataset, split, train_split, protocol = DENSE_EVALS[name]
        entry = dict(type=kind, dataset=dataset, split=split, data_dir=root, every_steps=0, prefix=name)
        if kind == "linear_segmentation":
            entry.update(train_split=train_split, protocol=protocol)
        out[name] = ml_collections.ConfigDict(entry)
    return out


# big_vision's i1k minival: 1% of train held out for model selection (docs/method/evals.md §16).
MINIVAL_TRAIN, MINIVAL = "train[:99%]", "train[99%:]"


def imagenet_evals(c: ml_collections.ConfigDict, classifier: bool) -> dict[str, Any]:
    """What every ImageNet recipe `c` evaluates besides `validation` (docs/method/evals.md §16), as the
    fields to add (`c.update(imagenet_evals(c, ...))`): it trains on `train[:99%]` and reads a
    minival on `train[99%:]` (a classifier's accuracy; a self-supervised recipe's kNN, with its
    kNN's bank), and a classifier also ImageNet-ReaL and ImageNet-v2 from the run's data_dir (tfds
    `imagenet2012_real`, `imagenet_v2`). `c.evals` (default: a `test` classification) gains them."""
    evals = {} if c.get("evals") else dict(test=ml_collections.ConfigDict(dict(type="classification")))
    if classifier:
        data_dir = c.dataset.get_ref("data_dir")
        evals["minival"] = ml_collections.ConfigDict(dict(type="classification", split=MINIVAL, prefix="minival"))
        evals["real"] = ml_collections.ConfigDict(dict(type="classification", dataset="imagenet2012_real",
                                                       split="validation", data_dir=data_dir, prefix="real"))
        evals["v2"] = ml_collections.ConfigDict(dict(type="classification", dataset="imagenet_v2", split="test",
                                                     data_dir=data_dir, prefix="v2"))
    else:
        knn = c.evals.knn
        evals["minival"] = ml_collections.ConfigDict(dict(type="knn", k=knn.k, temperature=knn.temperature,
                                                          split=MINIVAL, train_split=knn.get("train_split"),
                                                          prefix="minival"))
    return dict(dataset=dict(train_split=MINIVAL_TRAIN), evals=evals)


def mae(**overrides: Any) -> ml_collections.ConfigDict:
    """`config.mae` of facebookresearch/mae's pre-training (docs/method/ssl.md §9): mask ratio 0.75,
    decoder 512 wide, 8 blocks, 16 heads (MLP ×4) with its skips, the raw image as the target,
    8 images in the reconstruction picture."""
    block = dict(
        mask_ratio=0.75,
        norm_pix_loss=True,
        decoder_width=512,
        decoder_depth=8,
        decoder_num_heads=16,
        decoder_mlp_ratio=4,
        decoder_skip_sab=True,
        decoder_skip_ffn=True,
        target="raw",
        picture_images=8,
    )
    block.update(overrides)
    return ml_collections.ConfigDict(block)


def mae_optimizer(base_lr: float, batch_size: int, name: str = "adamw", **fields: Any) -> ml_collections.ConfigDict:
    """AdamW (0.9, 0.95), weight decay 0.05, lr = base_lr × batch / 256 (MAE's scaling rule); another
    `name` (e.g. 'shampoo_ec', the authors' fork's `--opt soap` call) takes `optimizer`'s settings of
    it with the same lr and weight decay."""
    lr = base_lr * batch_size / 256
    opt = dict(name="adamw", lr=lr, b1=0.9, b2=0.95, weight_decay=0.05) if name == "adamw" else \
        optimizer(name, lr=lr, weight_decay=0.05).to_dict()
    opt.update(fields)
    return ml_collections.ConfigDict(opt)


# Whole recipes that more than one config file uses (a config file never reads another one): the
# family model block and the ImageNet recipe of the Swin, CaiT and PVTv2 configs (docs/method/families.md
# §10), then the ViT and DINO recipes behind their baseline/variant configs.


def family_model(name: str, a: dict[str, Any], drop_path: float, **fields: Any) -> ml_collections.ConfigDict:
    """`config.model` of a family other than the ViT: switches, init and TG from the args `a`,
    drop-path only with both skips (docs/method/papers.md §1); `fields` (variant, sizes) are added."""
    skip_sab, skip_ffn = a.get("skip_sab", True), a.get("skip_ffn", True)
    init = a.get("init", "default")
    skipless = init in ("skipless", "mimetic")
    constants = VITB_SUPERVISED_INIT if skipless else dict(init_alpha=1.0, init_beta=1.0, init_c=1.0)
    tg = a.get("tg", "none")
    return ml_collections.ConfigDict(dict(
        name=name, skip_sab=skip_sab, skip_ffn=skip_ffn, drop_path=drop_path if skip_sab and skip_ffn else 0.0,
        init=init, **constants, token_graying=placeholder(str) if tg == "none" else tg, tg_eps=a.get("eps", 0.95),
        dtype="float32", **fields,
    ))


def recipe(a: dict[str, Any], trainer: str, dataset: str, train_split: str, eval_split: str,
           **input_fields: Any) -> ml_collections.ConfigDict:
    """The head of every recipe: the trainer, the seed from the args `a`, the dataset and its
    splits (data_dir set per run) and `config.input` from `input_fields`."""
    c = ml_collections.ConfigDict()
    c.trainer = trainer
    c.seed = a["seed"]
    c.dataset = ml_collections.ConfigDict(
        dict(name=dataset, train_split=train_split, eval_split=eval_split, data_dir=placeholder(str)))
    c.input = ml_collections.ConfigDict(input_fields)
    return c


# The ImageNet-1k input of the references: batch 1024, 224×224 (evaluation resizes to 256 and
# centre-crops 224).
IMAGENET_INPUT = dict(batch_size=1024, eval_batch_size=1024, image_size=224, crop_pct=0.875, num_workers=32)


def supervised_training(a: dict[str, Any], *, lr: float, weight_decay: float, warmup_epochs: int,
                        grad_clip: float | None) -> dict[str, Any]:
    """The supervised recipes' training fields (`c.update(...)`): the args' optimizer and epochs,
    linear warm-up then cosine to 1e-5, gradient clipping (None or 0: off), label smoothing 0.1,
    non-finite steps fatal."""
    return dict(
        optimizer=optimizer(a["opt"], lr=lr, weight_decay=weight_decay),
        schedule=ml_collections.ConfigDict(dict(warmup_epochs=warmup_epochs, end_lr=1e-5)),
        total_epochs=a["epochs"],
        grad_clip_norm=grad_clip if grad_clip else placeholder(float),
        label_smoothing=0.1,
        skip_nonfinite_steps=False,
    )


def imagenet_recipe(a: dict[str, Any], model: ml_collections.ConfigDict, *, warmup_epochs: int,
                    grad_clip: float | None, lr: float = 1e-3, weight_decay: float = 0.05,
                    repeated_augmentation: int = 1, ema_decay: float = 0.0) -> ml_collections.ConfigDict:
    """The DeiT-style ImageNet-1k recipe these family configs share (batch 1024, 224×224; each
    epoch whole batches, as the references' loaders drop the last one); `repeated_augmentation`
    (DeiT's RASampler repeats) and `ema_decay` (model EMA, 0 off) as the family's reference
    (docs/recipes.md)."""
    c = recipe(a, "supervised", "imagenet2012", "train", "validation", **IMAGENET_INPUT, aug=deit_aug(),
               repeated_augmentation=repeated_augmentation, drop_last=True)
    c.model = copy.deepcopy(model)  # the caller's stays as it is
    c.model.dtype = "bfloat16"
    c.update(supervised_training(a, lr=lr, weight_decay=weight_decay, warmup_epochs=warmup_epochs,
                                 grad_clip=grad_clip))
    c.model_ema = model_ema(decay=ema_decay)
    c.update(runtime(eval_every=5000, checkpoint_every=2000))
    c.update(imagenet_evals(c, classifier=True))
    return c


def cifar_vit_tiny(a: dict[str, Any]) -> ml_collections.ConfigDict:
    """The CIFAR-10 ViT-Tiny recipe of configs/cifar10_vit_tiny.py for the config args `a` (the
    CIFAR-100 and Tiny-ImageNet configs change its dataset and sizes)."""
    c = recipe(
        a, "supervised", "cifar10", "train", "test",
        batch_size=128,
        eval_batch_size=1000,
        image_size=32,
        crop_pct=1.0,  # eval sees the image as it is
        num_workers=8,
        aug=deit_aug(crop="pad", crop_padding=4),  # scale: used only by crop="rrc"
    )
    c.model = vit_model(a, VITB_SUPERVISED_INIT, variant=placeholder(str), width=192, depth=a["depth"], num_heads=3,
                        mlp_dim=768, patch_size=4)
    c.update(supervised_training(a, lr=1e-3, weight_decay=0.05, warmup_epochs=10, grad_clip=1.0))
    steps_per_10_epochs = 3906  # 390.6 steps per epoch
    c.update(runtime(eval_every=steps_per_10_epochs, checkpoint_every=steps_per_10_epochs))
    return c


def imagenet_vit(a: dict[str, Any]) -> ml_collections.ConfigDict:
    """The ImageNet-1k ViT recipe of configs/vitb_skipless.py for the config args `a`
    (configs/vit_i1k_tg.py sets other args)."""
    # The papers' recipe: no repeated augmentation, no model EMA, the plain stream; the fields are
    # present so DeiT's settings are one override away (docs/recipes.md).
    c = recipe(a, "supervised", "imagenet2012", "train", "validation", **IMAGENET_INPUT, aug=deit_aug(),
               repeated_augmentation=1, drop_last=False)
    c.model = vit_model(
        a,
        VITB_SUPERVISED_INIT,
        variant=a["variant"],
        patch_size=placeholder(int),  # from the variant
        dtype="bfloat16",
    )
    c.update(supervised_training(a, lr=1e-3, weight_decay=0.3, warmup_epochs=5, grad_clip=1.0))
    c.model_ema = model_ema(decay=0.0)
    c.update(runtime(eval_every=5000, checkpoint_every=2000))
    c.update(imagenet_evals(c, classifier=True))
    return c


def multicrop(*, global_scale: tuple[float, float], local_size: int, local_scale: tuple[float, float],
              num_local: int, flip_prob: float, jitter: tuple[float, ...], blur_sigma: tuple[float, float]
              ) -> dict[str, Any]:
    """`config.input.multicrop` of the DINO recipes: DINO's colour jitter (p 0.8), grayscale (p 0.2),
    blur (p 1.0 / 0.1 / 0.5 on global 1, global 2, locals) and solarization (p 0.2) probabilities;
    the crops' sizes and scales, flip, jitter strengths and blur sigmas are the recipe's."""
    return dict(
        global_scale=global_scale,
        local_size=local_size,
        local_scale=local_scale,
        num_local=num_local,
        flip_prob=flip_prob,
        jitter=jitter,
        jitter_prob=0.8,
        grayscale_prob=0.2,
        blur_prob=(1.0, 0.1, 0.5),
        blur_sigma=blur_sigma,
        solarize_prob=0.2,
    )


def dino_training(a: dict[str, Any], *, out_dim: int, hidden_dim: int, bottleneck_dim: int,
                  warmup_teacher_temp: float, teacher_temp: float, warmup_teacher_temp_epochs: int, lr: float,
                  lr_reference_batch: Any) -> dict[str, Any]:
    """`config.dino` and the training fields of the DINO recipes (`c.update(...)`): the head's sizes
    and the teacher temperatures are the recipe's; 3 head layers with a normalized last one,
    student T 0.1, centre momentum 0.9, teacher momentum 0.996, per-tensor clipping at 3, last
    layer frozen 1 epoch; the args' optimizer with min lr 1e-6 and weight decay 0.04 -> 0.4, 10
    warm-up epochs."""
    dino = ml_collections.ConfigDict(
        dict(
            out_dim=out_dim,
            hidden_dim=hidden_dim,
            bottleneck_dim=bottleneck_dim,
            num_layers=3,
            norm_last_layer=True,
            student_temp=0.1,
            warmup_teacher_temp=warmup_teacher_temp,
            teacher_temp=teacher_temp,
            warmup_teacher_temp_epochs=warmup_teacher_temp_epochs,
            center_momentum=0.9,
            momentum_teacher=0.996,
            clip_grad=3.0,
            freeze_last_layer_epochs=1,
        )
    )
    return dict(
        dino=dino,
        optimizer=optimizer(a["opt"], lr=lr, lr_reference_batch=lr_reference_batch, min_lr=1e-6, weight_decay=0.04,
                            weight_decay_end=0.4),
        schedule=ml_collections.ConfigDict(dict(warmup_epochs=10)),
        total_epochs=a["epochs"],
        total_steps=placeholder(int),  # set to override the epochs
        grad_clip_norm=placeholder(float),  # DINO clips per tensor: config.dino.clip_grad
        skip_nonfinite_steps=False,
    )


def dino_vits(a: dict[str, Any]) -> ml_collections.ConfigDict:
    """The DINO ViT-S/16 ImageNet recipe of configs/dino_vits_skipless.py for the config args `a`
    (configs/dino_vits_baseline.py sets the switches)."""
    c = recipe(
        a, "dino", "imagenet2012", "train", "validation", **IMAGENET_INPUT,  # image_size: the global crops
        aug=None,
        drop_last=True,  # DINO's loader: whole batches per epoch, as its ⌊N/B⌋ steps per epoch
        multicrop=multicrop(global_scale=(0.4, 1.0), local_size=96, local_scale=(0.05, 0.4), num_local=8,
                            flip_prob=0.5, jitter=(0.4, 0.4, 0.2, 0.1), blur_sigma=(0.1, 2.0)),
    )
    c.model = vit_model(
        a,
        DINO_VITS_INIT,
        variant=a["variant"],
        patch_size=placeholder(int),  # from the variant
        dtype="bfloat16",
        **DINO_BACKBONE,
    )
    c.update(dino_training(a, out_dim=65536, hidden_dim=2048, bottleneck_dim=256, warmup_teacher_temp=0.04,
                           teacher_temp=0.07, warmup_teacher_temp_epochs=30, lr=0.0005, lr_reference_batch=256))
    c.evals = dino_evals(linear_l2=1e-4, linear_steps=1000)
    c.evals.update(dense_evals(a["dense"], a["dense_root"] or None))
    c.eval_at_start = False
    c.update(runtime(eval_every=50_000, checkpoint_every=2000, analysis=False))
    c.update(imagenet_evals(c, classifier=False))
    return c


def dino_digits(a: dict[str, Any]) -> ml_collections.ConfigDict:
    """The DINO recipe on digits of configs/dino_digits.py for the config args `a`
    (configs/dino_digit_scenes.py changes data, crops and evaluations)."""
    c = recipe(
        a, "dino", "digits", "train", "test",
        batch_size=32,
        eval_batch_size=256,
        image_size=8,  # global crops and evaluation images
        num_workers=0,
        aug=None,
        multicrop=multicrop(global_scale=(0.5, 1.0), local_size=4, local_scale=(0.3, 0.6), num_local=2,
                            flip_prob=0.0, jitter=(0.4, 0.4, 0.0, 0.0), blur_sigma=(0.1, 0.6)),
    )
    c.model = vit_model(
        a,
        DINO_VITS_INIT,
        variant=placeholder(str),
        width=64,
        depth=a["depth"],
        num_heads=4,
        mlp_dim=128,
        patch_size=4,
        drop_path=0.0,
        **DINO_BACKBONE,
    )
    c.update(dino_training(a, out_dim=256, hidden_dim=256, bottleneck_dim=32, warmup_teacher_temp=0.025,
                           teacher_temp=0.025, warmup_teacher_temp_epochs=0, lr=1e-3,
                           lr_reference_batch=placeholder(int)))
    c.evals = dino_evals(linear_l2=1e-3, linear_steps=300)
    c.eval_at_start = True  # and every 660 steps (15 epochs) and at the end

    c.update(runtime(eval_every=660, checkpoint_every=500, log_every=44, analysis=False))
    c.keep_checkpoints = 2
    return c
