r"""Few-shot (docs/method.md §17) and DINO's linear evaluation (§18) on the digits DINO and MAE
runs (configs/dino_digits.py, configs/mae_digits_pretrain.py), seeds 0-2, mean ± std.

    OPENBLAS_NUM_THREADS=1 python experiments/fewshot_linear_digits.py --out=docs/figures/fewshot_linear_digits

Each run trains its config as it is and evaluates at the last step only: `fewshot` (shots
1/5/10/25 × seeds 0-2 on digits) and `dino_linear` with DINO's protocol as written (n = 4 class
tokens for these width-64 backbones, batch 1024, lr 0.001·B/256, 100 epochs) and, as a second
row, the same protocol at lr 0.1·B/256 (digits has 1,437 train images, 900× fewer than ImageNet,
so the protocol's lr × steps is 900× smaller). Results go to `<out>.json` as runs finish (a
rerun skips them); the table (mean ± sample std, ddof 1) is printed and written to `<out>.md`.
"""

from __future__ import annotations

import argparse

import ml_collections
import numpy as np

import grid

RECIPES = {"DINO": "dino_digits", "MAE": "mae_digits_pretrain"}
EVALS = dict(
    fewshot=dict(type="fewshot", every_steps=0),
    dino_linear=dict(type="dino_linear", every_steps=0),
    dino_linear_lr0p1=dict(type="dino_linear", every_steps=0, lr=0.1),
)


def configure(config: ml_collections.ConfigDict) -> None:
    config.eval_at_start = False
    for name, entry in EVALS.items():
        config.evals[name] = ml_collections.ConfigDict(entry)


def record(metrics: dict[str, float], workdir: str, config) -> dict[str, float]:
    del workdir, config
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
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--trainers", default="DINO,MAE")
    grid.add_worker_args(parser)
    args = parser.parse_args()
    runs = [grid.Run(f"{t}|seed={s}", RECIPES[t], f"seed={s}")
            for t in args.trainers.split(",") for s in args.seeds.split(",")]
    results = grid.run_grid(f"{args.out}.json", runs, configure=configure, record=record, worker=args.worker,
                            workers=args.workers)
    print(summarize(results, args.out))
