r"""The skip ablation on digits: both skips / no FFN skip / no SAB skip / no skips, 3 seeds,
at depth 4 and 8 (METHOD.md §1's ordering is the hypothesis), default init and AdamW; and no
skips with the skipless init (METHOD.md §3), still AdamW.

    OPENBLAS_NUM_THREADS=1 python experiments/skip_ablation.py --out=docs/figures/skip_ablation

Runs the quickstart config through `experiments/grid.py`: results go to `<out>.json` as runs
finish (a rerun skips finished runs; `--workers=2 --worker=i` in two processes share the grid),
then a table and a plot are written.
"""

from __future__ import annotations

import argparse

import grid

VARIANTS = {
    "both skips": "skip_sab=True,skip_ffn=True",
    "no FFN skip": "skip_sab=True,skip_ffn=False",
    "no SAB skip": "skip_sab=False,skip_ffn=True",
    "no skips": "skip_sab=False,skip_ffn=False",
    "no skips, skipless init": "skip_sab=False,skip_ffn=False,init=skipless",  # later args win
}


def run_all(out: str, depths: list[int], seeds: list[int], worker: int = 0, workers: int = 1) -> dict[str, dict]:
    """Every run not yet in `<out>.json` (this worker's share); returns all results."""
    runs = [
        grid.Run(
            f"depth={depth}|{name}|seed={seed}", "quickstart", f"init=default,opt=adamw,{arg},depth={depth},seed={seed}"
        )
        for depth in depths
        for name, arg in VARIANTS.items()
        for seed in seeds
    ]
    return grid.run_grid(f"{out}.json", runs, worker=worker, workers=workers)


def summarize(results: dict[str, dict], out: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    depths = sorted({int(k.split("|")[0].split("=")[1]) for k in results})
    lines = [
        "| depth | variant | test accuracy (%) mean ± std | per seed | test loss | final train loss |",
        "|---|---|---|---|---|---|",
    ]
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(VARIANTS)
    for vi, name in enumerate(VARIANTS):
        means, stds = [], []
        for depth in depths:
            runs = [v for k, v in results.items() if k.startswith(f"depth={depth}|{name}|")]
            acc = np.array([r["test_accuracy"] for r in runs]) * 100
            lines.append(
                f"| {depth} | {name} | {acc.mean():.1f} ± {acc.std():.1f} | {', '.join(f'{a:.1f}' for a in acc)} | "
                f"{np.mean([r['test_loss'] for r in runs]):.3f} | {np.mean([r['train_loss'] for r in runs]):.4f} |"
            )
            means.append(acc.mean())
            stds.append(acc.std())
        ax.bar(np.arange(len(depths)) + vi * width, means, width, yerr=stds, label=name, capsize=3)
    ax.set_xticks(np.arange(len(depths)) + width * (len(VARIANTS) - 1) / 2, [f"depth {d}" for d in depths])
    ax.set_ylabel("test accuracy (%)")
    ax.set_ylim(0, 100)
    ax.set_title("Skip ablation, ViT on digits (quickstart config, AdamW, 3 seeds)")
    ax.legend(loc="lower left")
    fig.tight_layout()
    fig.savefig(f"{out}.png", dpi=120)
    table = "\n".join(lines)
    with open(f"{out}.md", "w") as f:
        f.write(table + "\n")
    return table


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="docs/figures/skip_ablation")
    parser.add_argument("--depths", default="4,8")
    parser.add_argument("--seeds", default="0,1,2")
    grid.add_worker_args(parser)
    args = parser.parse_args()
    depths, seeds = [int(d) for d in args.depths.split(",")], [int(s) for s in args.seeds.split(",")]
    results = run_all(args.out, depths, seeds, args.worker, args.workers)
    print(summarize(results, args.out))
