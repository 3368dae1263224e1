r"""Repeated augmentation and model EMA on digits: the quickstart's default (no skips, skipless
init, SOAP, 40 epochs) with repeated augmentation off (r = 1) and on (r = 3, DeiT's RASampler,
docs/method/recipes.md §21), each with a model EMA (decay 0.98, docs/method/recipes.md §22) evaluated beside the
model, 3 seeds; once with the quickstart as it is (no augmentation: the r copies are the same
image) and once with a ±1-pixel pad-and-crop augmentation (each copy differs).

    OPENBLAS_NUM_THREADS=1 python experiments/ra_ema_digits.py --out=docs/figures/ra_ema_digits \
        [--root=DIR] [--workers=2] [--config.x=y ...]

The runs are configs/quickstart.py's args `aug`, `repeats` and `ema` (its named grid `ra_ema`
for seeds 0-2), trained with `python -m skipless_jax.sweep`'s runner into kept folders under
--root (default `<out>_runs`, git-ignored; a rerun resumes; `python -m skipless_jax.report ROOT`
tabulates it), `--config.*` overrides passed to every run. The EMA does not act on training, so
one run gives both the model's accuracy (`test_accuracy`) and its EMA's (`ema_test_accuracy`).
Decay 0.98 averages over ~50 of the ~900 updates (1/(1 − d) = 5.6 % of the run; DeiT's 0.99996
is 6.7 % of its 375k updates). `<out>.json` is written from the finished runs, then `<out>.md`
holds the table.
"""

from __future__ import annotations

import argparse
import os
import sys

from skipless_jax import sweep

CONFIG = "configs/quickstart.py"  # relative to the checkout, where the sweep runs its runs
AUGS = {"none": "none", "pad-crop": "pad_crop"}  # row name -> configs/quickstart.py's arg aug
REPEATS = (1, 3)
EMA_DECAY = 0.98


def runs(seeds: list[int]) -> dict[str, sweep.SweepRun]:
    """{result key: its sweep run}."""
    module = sweep.load_config_module(os.path.join(sweep.ROOT, CONFIG))
    return {f"{aug_name}|r={repeats}|seed={seed}":
            sweep.one_run(CONFIG, f"aug={aug},repeats={repeats},ema={EMA_DECAY},seed={seed}", module)
            for aug_name, aug in AUGS.items() for repeats in REPEATS for seed in seeds}


def record(workdir: str, metrics: dict) -> dict:
    del workdir
    return {k: metrics[k] for k in ("test_accuracy", "ema_test_accuracy", "test_loss", "ema_test_loss", "step")}


def run_all(out: str, seeds: list[int], root: str | None = None, overrides: list[str] = (), workers: int = 1
            ) -> tuple[dict[str, dict], int]:
    """Trains the unfinished runs under `root` (default `<out>_runs`), writes `<out>.json` from
    the finished ones; (results, the sweep's exit status)."""
    root = os.path.abspath(root or f"{out}_runs")
    grid = runs(seeds)
    results, status = sweep.train_and_collect(grid, root, overrides, workers, record, f"{out}.json")
    return results, status


def summarize(results: dict[str, dict], out: str) -> str:
    import numpy as np

    def cell(a):
        return f"{a.mean():.1f} ± {a.std(ddof=1):.1f} ({', '.join(f'{x:.1f}' for x in a)})"

    lines = ["| augmentation | r | updates | model test accuracy (%) | EMA test accuracy (%) | EMA − model (points) |",
             "|---|---|---|---|---|---|"]
    for aug_name in AUGS:
        for repeats in REPEATS:
            rows = [v for k, v in sorted(results.items()) if k.startswith(f"{aug_name}|r={repeats}|")]
            if not rows:
                continue
            model = np.array([r["test_accuracy"] for r in rows]) * 100
            ema = np.array([r["ema_test_accuracy"] for r in rows]) * 100
            lines.append(f"| {aug_name} | {repeats} | {rows[0]['step']} | {cell(model)} | {cell(ema)} | "
                         f"{(ema - model).mean():+.2f} |")
    table = "\n".join(lines)
    with open(f"{out}.md", "w") as f:
        f.write(table + "\n")
    return table


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="docs/figures/ra_ema_digits")
    parser.add_argument("--root", default=None, help="the runs' folders (default <out>_runs)")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--workers", type=int, default=1, help="runs at a time")
    args, rest = parser.parse_known_args()
    overrides = sweep.overrides_of(parser, rest)
    results, status = run_all(args.out, [int(s) for s in args.seeds.split(",")], args.root, overrides, args.workers)
    print(summarize(results, args.out))
    sys.exit(status)
