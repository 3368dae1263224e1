r"""DINO ViT-S/16 on ImageNet-1k with both skips: the baseline of the Cutting the Skip DINO runs.

    python -m skipless_jax.main --config=configs/dino_vits_baseline.py \
        --workdir=gs://BUCKET/dino_vits_baseline --config.dataset.data_dir=gs://BUCKET/tfds
    python -m skipless_jax.main --config=configs/dino_vits_baseline.py:opt=soap ...   # with SOAP

Hardware: sized for 16 accelerators (two 8-GPU H100 nodes or a TPU v4-32 slice; global batch
1024, bfloat16 compute) and ≈ 59 worker processes for the 10-crop augmentation at DINO's
reported pace (1,710 images/s; docs/data.md). Wall-clock: not measured; facebookresearch/dino
reports 2.6 days on 16 GPUs for its ViT-S/16 300-epoch run of
this recipe (DINO's figure, not this project's). Data: imagenet2012 prepared by
tensorflow-datasets (docs/data.md); the run fails at start, in one line, if it is absent.

Expected: not measured here (no ImageNet, no accelerator). The paper's numbers (Cutting the
Skip, DINO ViT-S/16, 300 epochs; this config is the left-hand number, configs/dino_vits_skipless.py
the right), as the paper's: linear segmentation mIoU VOC12 56.3 → 62.3 (single layer, `voc_lin`)
and 61.6 → 65.4 (multi-scale, `voc_ms`), COCO-Stuff 24.6 → 24.9 (`cocostuff_lin`), ADE20K
23.7 → 22.5 (`ade_lin`) and 26.0 → 26.3 (`ade_ms`); TokenCut CorLoc with SOAP VOC12 49.4 → 63.2
(`voc12_tokencut`), COCO20k 27.5 → 46.7 (`coco20k_tokencut`). The dense evaluations (docs/method/dense.md
§7-8: DINOv2's `lin` / `ms` probes, TokenCut) are their own job by default, run on the checkpoint
after training (one host; each writes W/eval/<name>.json; docs/data.md lays out DIR):
    python -m skipless_jax.evaluate --workdir=W \
        --config=configs/dino_vits_baseline.py:dense=all,dense_root=DIR \
        --only=voc_lin,voc_ms,ade_lin,ade_ms,cocostuff_lin,voc07_tokencut,voc12_tokencut,coco20k_tokencut
(any subset in --only). Training runs none of them unless asked: `:dense=all,dense_root=DIR` (or
'+'-joined names, e.g. dense=voc_lin+voc12_tokencut) on the training command adds them to its
last step, where the whole slice waits for them. Each probe is 40k steps of 16 crops
(docs/results/dense.md estimates the test passes' hours); a run without `dense` reports the teacher's
kNN and linear-probe top-1 (docs/method/evals.md §11). DINO's own ViT-S/16 300-epoch run (last layer not normalized)
reaches 73.3 kNN / 76.0 linear top-1 on ImageNet (facebookresearch/dino; its linear evaluation
is not this project's probe, §11).
    (no args)                                   both skips, DINO's init (init=timm), AdamW
    :opt=soap                                   both skips, DINO's init (init=timm), SOAP
    :dense=all,dense_root=DIR                   + the dense evaluations at training's end (not the default)

Schedule: as configs/dino_vits_skipless.py (DINO, boosted): batch 1024, lr 0.0005 per 256
images, 10 warm-up epochs, weight decay 0.04 rising to 0.4, 300 epochs (≈ 372k steps),
2 global crops on 224×224 images and 8 local 96×96 crops with patch 16; drop-path 0.1 with
skips and 0 without. SOAP: b1 0.9, b2 0.95, preconditioning every 10 steps.
"""

import ml_collections

from skipless_jax import config_args, config_blocks


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    a = config_args.parse(
        arg, skip_sab=True, skip_ffn=True, init="timm", opt="adamw", seed=0, variant="S/16", epochs=300,
        dense="none", dense_root="",
    )
    # The one recipe (config_blocks.dino_vits, as dino_vits_skipless.py); this file only flips the switches.
    return config_blocks.dino_vits(a)
