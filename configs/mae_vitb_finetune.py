r"""Fine-tuning an MAE-pre-trained ViT-B/16 on ImageNet-1k (facebookresearch/mae's recipe).

    python -m skipless_jax.main --config=configs/mae_vitb_finetune.py:init_from=gs://BUCKET/mae_vitb_dct \
        --workdir=gs://BUCKET/mae_vitb_dct_ft --config.dataset.data_dir=gs://BUCKET/tfds

`init_from` is the workdir of a configs/mae_vitb_pretrain.py run: the encoder loads by name, the
fixed position table becomes the learned `pos_embedding`, `fc_norm` and the head are new
(docs/method/ssl.md §9). Without `init_from` the same recipe trains from scratch.

Expected (the paper's numbers, Always Skip Attention, ImageNet-1k top-1, ViT-B/16): 83.0 → 83.2
with DCT Token Graying in pre-training; not reproduced here. The paper does not say whether TG
is also on during fine-tuning; the arg `tg` is this run's own switch (default 'none').

Settings: this config follows MAE's released code (base learning rate 5e-4, layer decay 0.65); the paper's
text gives 1e-3 / 0.75 (`settings=paper`). Global batch 1024 (lr = base × 1024 / 256), AdamW
(0.9, 0.999), weight decay 0.05 on kernels, 5 warm-up epochs, cosine to 1e-6, 100 epochs, drop path
0.1, RandAugment m9 (mstd 0.5), mixup 0.8 / cutmix 1.0, label smoothing 0.1, random erasing 0.25,
global average pooling → fc_norm → head (std 2e-5); whole batches per epoch (MAE's loader drops
the last). Hardware: sized for one 8-GPU node or a TPU
v4-32 slice (bfloat16 compute); wall-clock not measured.

Init under init='skipless' (config_blocks.MAE_FORK_INIT; docs/method/authors_init.md §3): the authors'
fork's uniform Q/K, V/O c² U V, c = 1 and Xavier MLP; the paper's text's α = 2, β = 0.6.
"""

import ml_collections
from ml_collections.config_dict import placeholder

from skipless_jax import config_args, config_blocks

SETTINGS = {"code": dict(base_lr=5e-4, layer_decay=0.65), "paper": dict(base_lr=1e-3, layer_decay=0.75)}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    a = config_args.parse(
        arg, init_from=None, skip_sab=True, skip_ffn=True, init="mae", seed=0, tg="none", eps=0.95,
        settings="code", epochs=100,
    )
    if a["settings"] not in SETTINGS:
        raise ValueError(f"config arg settings={a['settings']!r} is unknown; allowed: {sorted(SETTINGS)}")
    s = SETTINGS[a["settings"]]
    c = ml_collections.ConfigDict()
    c.trainer = "supervised"
    c.seed = a["seed"]
    c.init_from = a["init_from"] if a["init_from"] else placeholder(str)
    c.dataset = ml_collections.ConfigDict(
        dict(name="imagenet2012", train_split="train", eval_split="validation", data_dir=placeholder(str))
    )
    c.input = ml_collections.ConfigDict(
        dict(batch_size=1024, eval_batch_size=1024, image_size=224, crop_pct=0.875, num_workers=32, drop_last=True,
             aug=config_blocks.deit_aug())
    )
    c.model = config_blocks.vit_model(
        a, config_blocks.MAE_FORK_INIT, variant="B/16", patch_size=placeholder(int),
        pool="gap_fc_norm", posemb="learn", drop_path=0.1, head_init_std=2e-5, dtype="bfloat16", gelu="exact",
    )
    c.optimizer = config_blocks.mae_optimizer(s["base_lr"], c.input.batch_size, b2=0.999,
                                              layer_decay=s["layer_decay"])
    c.schedule = ml_collections.ConfigDict(dict(warmup_epochs=5, end_lr=1e-6))
    c.total_epochs = a["epochs"]
    c.grad_clip_norm = placeholder(float)
    c.label_smoothing = 0.1
    c.skip_nonfinite_steps = False
    c.update(config_blocks.runtime(eval_every=5000, checkpoint_every=2000))
    c.update(config_blocks.imagenet_evals(c, classifier=True))
    return c
