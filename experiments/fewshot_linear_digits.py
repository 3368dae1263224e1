r"""Few-shot (docs/method/evals.md §17) and DINO's linear evaluation (§18) on the digits DINO and MAE
runs (configs/dino_digits.py, configs/mae_digits_pretrain.py), seeds 0-2, mean ± std.

    OPENBLAS_NUM_THREADS=1 python experiments/fewshot_linear_digits.py --out=docs/figures/fewshot_linear_digits \
        [--root=DIR] [--workers=2] [--config.x=y ...]

Each run trains its config as it is with the config arg `evals=fewshot_linear`: evaluated at the
last step only, `fewshot` (shots 1/5/10/25 × seeds 0-2 on digits) and `dino_linear` with DINO's
protocol as written (n = 4 class tokens for these width-64 backbones, batch 1024, lr 0.001·B/256,
100 epochs) and, as a second row, the same protocol at lr 0.1·B/256 (digits has 1,437 train
images, 900× fewer than ImageNet, so the protocol's lr × steps is 900× smaller)
(config_blocks.FEWSHOT_LINEAR_EVALS). The runs train with `python -m skipless_jax.sweep`'s
runner into kept folders under --root (default `<out>_runs`, git-ignored; `recipe=dino/...`,
`recipe=mae/...`; a rerun resumes), `--config.*` overrides passed to every run; `<out>.json` is
written from the finished ones; the table (mean ± sample std, ddof 1) is printed and written to
`<out>.md`.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

from skipless_jax import config_blocks, sweep

RECIPES = {"DINO": "dino_digits", "MAE": "mae_digits_pretrain"}
EVALS = config_blocks.FEWSHOT_LINEAR_EVALS


def runs(trainers: list[str], seeds: list[str]) -> dict[str, sweep.SweepRun]:
    """{result key: its sweep run}, each recipe's runs in the folder `recipe=<name>/`."""
    out = {}
    for t in trainers:
        config = f"configs/{RECIPES[t]}.py"  # relative to the checkout, where the sweep runs its runs
        module = sweep.load_config_module(os.path.join(sweep.ROOT, config))
        for s in seeds:
            run = sweep.one_run(config, f"evals=fewshot_linear,seed={s}", module)
            out[f"{t}|seed={s}"] = run._replace(name=f"recipe={t.lower()}/{run.name}")
    return out


def record(workdir: str, metrics: dict[str, float]) -> dict[str, float]:
    del workdir
    return {k: v for k, v in metrics.items() if k.startswith(tuple(EVALS)) or k.startswith("test_")}


def summarize(results: dict[str, dict], out: str) -> str:
    metrics = ["fewshot_digits_1shot", "fewshot_digits_5shot", "fewshot_digits_10shot", "fewshot_digits_25shot",
               "dino_linear_top1", "dino_linear_top5", "dino_linear_lr0p1_top1", "dino_linear_lr0p1_top5"]
    lines = ["| trainer | seeds | " + " | ".join(m.replace("fewshot_digits_", "").replace("_top", " top-")
                                                    for m in metrics) + " |",
             "|---|---|" + "---|" * len(metrics)]
    for trainer in RECIPES:
        runs = [v for k, v in results.items() if k.startswith(f"{trainer}|")]
        if not runs:
            continue
        cells = []
        for m in metrics:
            values = np.array([r[m] for r in runs if m in r]) * 100
            spread = values.std(ddof=1) if values.size > 1 else 0.0
            cells.append(f"{values.mean():.1f} ± {spread:.1f}" if values.size else "–")
        lines.append(f"| {trainer} | {len(runs)} | " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    with open(f"{out}.md", "w") as f:
        f.write(table + "\n")
    return table


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="docs/figures/fewshot_linear_digits")
    parser.add_argument("--root", default=None, help="the runs' folders (default <out>_runs)")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--trainers", default="DINO,MAE")
    parser.add_argument("--workers", type=int, default=1, help="runs at a time")
    args, rest = parser.parse_known_args()
    overrides = sweep.overrides_of(parser, rest)
    root = os.path.abspath(args.root or f"{args.out}_runs")
    grid = runs(args.trainers.split(","), args.seeds.split(","))
    results, status = sweep.train_and_collect(grid, root, overrides, args.workers, record, f"{args.out}.json")
    print(summarize(results, args.out))
    sys.exit(status)
