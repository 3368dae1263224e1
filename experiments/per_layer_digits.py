r"""Per-layer kNN curves of the DINO and MAE digits runs, with and without skips (issue #52 item 7;
docs/method/per_layer_eval.md).

    OPENBLAS_NUM_THREADS=1 python experiments/per_layer_digits.py --root=/tmp/per_layer_digits \
        --out=docs/figures/per_layer_digits --seeds=0,1,2
    python experiments/per_layer_digits.py --out=docs/figures/per_layer_digits --plot_only

Trains each (recipe, variant, seed) of configs/dino_digits.py and configs/mae_digits_pretrain.py
into `<root>/<recipe>_<variant>_seed<s>` (a finished run is kept, not retrained), then runs its
`knn` entry with `layers='all'` on the final checkpoint (`skipless_jax.evaluate --only=knn`: one
forward pass, the curve PNG beside `eval/knn.json`). Writes `<out>.csv` (recipe, variant, seed,
block, knn_accuracy) and `<out>.png` (the mean kNN accuracy over seeds against the block, ± one
standard deviation; `--plot_only` redraws it from the CSV). The skipless
variant of each recipe takes that recipe's init (DINO: the paper's text; MAE: the authors' fork,
docs/method/authors_init.md §3).
"""

from __future__ import annotations

import argparse
import csv
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES = {"dino": "configs/dino_digits.py", "mae": "configs/mae_digits_pretrain.py"}
VARIANTS = {
    "skips": "skip_sab=True,skip_ffn=True,init=default",
    "no_skips": "skip_sab=False,skip_ffn=False,init=skipless",
}


def curve(recipe: str, variant: str, seed: int, root: str) -> list[tuple[int, float]]:
    """[(block, kNN accuracy), ...] of the run's final checkpoint (trained first if unfinished)."""
    from skipless_jax import checkpoint, evaluate, sweep, trainers
    from skipless_jax.evaluators import per_layer

    module = sweep.load_config_module(os.path.join(ROOT, RECIPES[recipe]))
    config = module.get_config(f"{VARIANTS[variant]},seed={seed}")
    workdir = os.path.join(root, f"{recipe}_{variant}_seed{seed}")
    if checkpoint.saved_config(workdir) is None or not os.path.exists(os.path.join(workdir, "final_metrics.json")):
        trainers.get(config.trainer).train_and_evaluate(config, workdir)
    config.evals.knn.layers = "all"
    metrics = evaluate.evaluate(workdir, config, only=["knn"])
    return per_layer.curves(metrics)["knn_accuracy"]


def plot(rows: list[tuple[str, str, int, int, float]], path: str) -> None:
    """One panel per recipe: the mean kNN accuracy over seeds against the block, ± one standard
    deviation (over seeds), one line per variant."""
    import numpy as np
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(8, 3.2))
    axes = fig.subplots(1, len(RECIPES), sharey=True)
    for ax, recipe in zip(axes, RECIPES):
        for variant in VARIANTS:
            mine = [r for r in rows if r[0] == recipe and r[1] == variant]
            blocks = sorted({r[3] for r in mine})
            values = [np.array([r[4] for r in mine if r[3] == b]) for b in blocks]
            mean = np.array([v.mean() for v in values])
            std = np.array([v.std(ddof=1) if len(v) > 1 else 0.0 for v in values])
            seeds = len({r[2] for r in mine})
            ax.errorbar(blocks, mean, yerr=std, marker="o", capsize=3,
                        label=f"{variant.replace('_', ' ')} ({seeds} seeds)")
        ax.set_title(f"{recipe.upper()} on digits ({RECIPES[recipe]})", fontsize=8)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("block")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_ylabel("kNN accuracy (test), mean ± std")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", help="the runs' folder (required unless --plot_only)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--plot_only", action="store_true", help="redraw <out>.png from <out>.csv")
    args = parser.parse_args(argv)
    if args.plot_only:
        with open(f"{args.out}.csv", newline="") as f:
            rows = [(r["recipe"], r["variant"], int(r["seed"]), int(r["block"]), float(r["knn_accuracy"]))
                    for r in csv.DictReader(f)]
        plot(rows, f"{args.out}.png")
        return 0
    if not args.root:
        parser.error("--root is required")
    rows = [(recipe, variant, seed, block, acc)
            for seed in (int(s) for s in args.seeds.split(","))
            for recipe in RECIPES for variant in VARIANTS
            for block, acc in curve(recipe, variant, seed, args.root)]
    with open(f"{args.out}.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["recipe", "variant", "seed", "block", "knn_accuracy"])
        writer.writerows(rows)
    plot(rows, f"{args.out}.png")
    for row in rows:
        print(*row, sep="\t")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
