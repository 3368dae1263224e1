r"""DINO ViT-S/16 on ImageNet-1k without skips, skipless init: the "Cutting the Skip" DINO recipe.

    python -m skipless_jax.main --config=configs/dino_vits_skipless.py \
        --workdir=gs://BUCKET/dino_vits_skipless --config.dataset.data_dir=gs://BUCKET/tfds
    python -m skipless_jax.main --config=configs/dino_vits_skipless.py:opt=soap ...   # with SOAP

Hardware: sized for 16 accelerators (two 8-GPU H100 nodes or a TPU v4-32 slice; global batch
1024, bfloat16 compute) and ≈ 59 worker processes for the 10-crop augmentation at DINO's
reported pace (1,710 images/s; docs/data.md). Wall-clock: not measured; facebookresearch/dino
reports 2.6 days on 16 GPUs for its ViT-S/16 300-epoch run of
this recipe with skips (DINO's figure, not this project's). Data: imagenet2012 prepared by
tensorflow-datasets (docs/data.md); the run fails at start, in one line, if it is absent.

Expected: not measured here (no ImageNet, no accelerator). The paper's numbers (Cutting the
Skip, DINO ViT-S/16, 300 epochs; skip → skipless, this config is the right-hand number), as the
paper's: linear segmentation mIoU VOC12 56.3 → 62.3 (single layer, `voc_lin`) and 61.6 → 65.4
(multi-scale, `voc_ms`), COCO-Stuff 24.6 → 24.9 (`cocostuff_lin`), ADE20K 23.7 → 22.5 (`ade_lin`)
and 26.0 → 26.3 (`ade_ms`); TokenCut CorLoc with SOAP VOC12 49.4 → 63.2 (`voc12_tokencut`),
COCO20k 27.5 → 46.7 (`coco20k_tokencut`). The dense evaluations (docs/method/dense.md
§7-8: DINOv2's `lin` / `ms` probes, TokenCut) are their own job by default, run on the checkpoint
after training (one host; each writes W/eval/<name>.json; docs/data.md lays out DIR):
    python -m skipless_jax.evaluate --workdir=W \
        --config=configs/dino_vits_skipless.py:dense=all,dense_root=DIR \
        --only=voc_lin,voc_ms,ade_lin,ade_ms,cocostuff_lin,voc07_tokencut,voc12_tokencut,coco20k_tokencut
(any subset in --only). Training runs none of them unless asked: `:dense=all,dense_root=DIR` (or
'+'-joined names, e.g. dense=voc_lin+voc12_tokencut) on the training command adds them to its
last step, where the whole slice waits for them. Each probe is 40k steps of 16 crops
(docs/results/dense.md estimates the test passes' hours); a run without `dense` reports the teacher's
kNN and linear-probe top-1 (docs/method/evals.md §11).
DINO's own ViT-S/16 300-epoch run (with skips, last layer not normalized) reaches 73.3 kNN /
76.0 linear top-1 on ImageNet (facebookresearch/dino; its linear evaluation is not this
project's probe, §11).
    (no args)                                   skipless, skipless init, AdamW
    :opt=soap                                   skipless, skipless init, SOAP
    :init=default                               skipless, default init (the ablation)
    :dense=all,dense_root=DIR                   + the dense evaluations at training's end (not the default)

Schedule (DINO, boosted): batch 1024, lr 0.0005 per 256 images (linear scaling), 10 warm-up
epochs then cosine to a min lr of 1e-6, weight decay 0.04 rising to 0.4 (cosine; all parameters
except biases and 1-D tensors, docs/method/ssl.md §13), 300 epochs (≈ 372k steps; whole batches per epoch, as DINO's
loader), per-tensor
gradient clip 3.0, last layer frozen for the first epoch, teacher momentum 0.996 → 1 (cosine),
teacher temperature 0.04 → 0.07 linearly over the first 30 of them, then constant; student
temperature 0.1, centre momentum 0.9. Multi-crop: 2 global crops on 224×224 images (scale
0.4–1) and 8 local 96×96 crops (scale 0.05–0.4) with patch 16. Head 2048–2048–256 → 65536,
weight-normalized last layer with g = 1. Skipless init α 1.8, β 1, c 3 (docs/method/papers.md §3);
drop-path 0.1 with skips and 0 without. SOAP: b1 0.9, b2 0.95, preconditioning every 10 steps
(Cutting the Skip).
"""

import ml_collections

from skipless_jax import config_args, config_blocks


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    a = config_args.parse(
        arg, skip_sab=False, skip_ffn=False, init="skipless", opt="adamw", seed=0, variant="S/16", epochs=300,
        dense="none", dense_root="",
    )
    return config_blocks.dino_vits(a)
