r"""ImageNet-1k ViT-B/16 with both skips, AdamW, 300 epochs: the baseline of both papers.

    python -m skipless_jax.main --config=configs/vitb_i1k_300ep.py \
        --workdir=gs://BUCKET/vitb_i1k_300ep --config.dataset.data_dir=gs://BUCKET/tfds

Hardware: sized for one 8-GPU node (A100/H100) or a TPU v4-32 slice (global batch 1024,
bfloat16 compute); the augmentation needs ≈ 27 busy host cores per 6,150 images/s
(docs/data.md). Expected wall-clock: ≈ 17 h for 300 epochs (≈ 375k steps) at the ≈ 6,150
images/s implied by the Always Skip Attention ViT-B baseline (0.723 days, METHOD.md §4).
Data: imagenet2012 prepared by tensorflow-datasets (docs/data.md); the run fails at start, in
one line, if it is absent.

Expected ImageNet-1k top-1 (Cutting the Skip, 300 epochs), one cell per args:
    (no args)                                                   80.3   (standard ViT-B, AdamW)
    :opt=soap                                                   80.1
    :skip_sab=False,skip_ffn=False                              61.4   (skipless, default init)
    :skip_sab=False,skip_ffn=False,opt=soap                     77.0
    :skip_sab=False,skip_ffn=False,init=skipless                78.1   (skipless + skipless init)
    :skip_sab=False,skip_ffn=False,init=skipless,opt=soap       80.8   (= configs/vitb_skipless.py)

Schedule (DeiT/ViT-B 300 epochs): batch 1024, lr 1e-3, weight decay 0.3 (not on biases and
norms), 5 warm-up epochs, cosine to 1e-5, gradient clipping 1.0, label smoothing 0.1,
RandAugment m9, mixup 0.8 / cutmix 1.0, random erasing 0.25, drop-path 0.1 with skips and 0
without. SOAP: b1 0.9, b2 0.95, preconditioning every 10 steps (Cutting the Skip).
"""

import ml_collections
from ml_collections.config_dict import placeholder

from skipless_jax import config_args


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    a = config_args.parse(
        arg,
        skip_sab=True,
        skip_ffn=True,
        init="default",
        opt="adamw",
        seed=0,
        tg="none",
        eps=0.95,
        variant="B/16",
        epochs=300,
    )
    c = ml_collections.ConfigDict()
    c.trainer = "supervised"
    c.seed = a["seed"]

    c.dataset = ml_collections.ConfigDict(
        dict(name="imagenet2012", train_split="train", eval_split="validation", data_dir=placeholder(str))
    )
    c.input = ml_collections.ConfigDict(
        dict(
            batch_size=1024,
            eval_batch_size=1024,
            image_size=224,
            crop_pct=0.875,
            num_workers=32,
            aug=dict(
                randaug="rand-m9-mstd0.5-inc1",
                scale=(0.08, 1.0),
                flip=True,
                reprob=0.25,
                mixup=0.8,
                cutmix=1.0,
                mixup_switch_prob=0.5,
                label_smoothing=0.1,
            ),
        )
    )

    with_skips = a["skip_sab"] and a["skip_ffn"]
    c.model = ml_collections.ConfigDict(
        dict(
            variant=a["variant"],
            patch_size=placeholder(int),  # from the variant
            skip_sab=a["skip_sab"],
            skip_ffn=a["skip_ffn"],
            pool="tok",
            posemb="learn",
            dropout=0.0,
            drop_path=0.1 if with_skips else 0.0,
            dtype="bfloat16",
            init=a["init"],
            init_alpha=2.0,  # ViT-B/16 supervised constants (METHOD.md §3)
            init_beta=0.6,
            init_c=3.0,
            token_graying=placeholder(str) if a["tg"] == "none" else a["tg"],
            tg_eps=a["eps"],
        )
    )

    c.optimizer = ml_collections.ConfigDict(dict(name=a["opt"], lr=1e-3, weight_decay=0.3))
    if a["opt"] == "soap":
        c.optimizer.update(dict(b1=0.9, b2=0.95, precondition_frequency=10))
    else:
        c.optimizer.update(dict(b1=0.9, b2=0.999))
    c.schedule = ml_collections.ConfigDict(dict(warmup_epochs=5, end_lr=1e-5))
    c.total_epochs = a["epochs"]
    c.grad_clip_norm = 1.0
    c.label_smoothing = 0.1
    c.skip_nonfinite_steps = False

    c.mesh = [("data", -1), ("fsdp", 1)]
    c.sharding_rules = [(".*", "fsdp")]

    c.log_every_steps = 100
    c.eval_every_steps = 5000
    c.checkpoint_every_steps = 2000
    c.keep_checkpoints = 3
    c.analysis = ml_collections.ConfigDict(dict(every_steps=0, probe_size=32))
    return c
