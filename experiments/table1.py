r"""Cutting the Skip's Table 1 in miniature on digits: {with skips, skipless + default init,
skipless + skipless init} × {AdamW, SOAP}, 3 seeds, depth 8 (METHOD.md §1, §3, §5).

    OPENBLAS_NUM_THREADS=1 python experiments/table1.py --out=docs/figures/table1

Each run is the quickstart config (`configs/quickstart.py`: width 64, 16 tokens, 40 epochs)
through `experiments/grid.py`, one after another in this process. AdamW: lr 1e-3,
b2 0.999; SOAP: the paper's b1 0.9, b2 0.95, frequency 10, lr 3e-3; both weight decay 0.05,
clipping 1.0, warm-up + cosine. Results (test accuracy and the training-loss curve) are
added to `<out>_runs.json` as they finish, so a rerun skips finished runs; then the table
`<out>.md`, `<out>_accuracy.png` and `<out>_curves.png` are written. Tiny models use one core
badly: `--workers=2 --worker=0` and `--worker=1` in two processes share the grid.
On the 2-core CPU with two workers: about 15 minutes for the 9 SOAP runs, less for AdamW.
"""

from __future__ import annotations

import argparse

import grid

VARIANTS = {
    "with skips": "skip_sab=True,skip_ffn=True,init=default",
    "skipless, default init": "skip_sab=False,skip_ffn=False,init=default",
    "skipless + skipless init": "skip_sab=False,skip_ffn=False,init=skipless",
}
OPTIMIZERS = ("adamw", "soap")
# ImageNet-1k ViT-B/16, 300 epochs, top-1 (Cutting the Skip, Table 1; METHOD.md §1).
PAPER = {
    ("with skips", "adamw"): 80.3,
    ("with skips", "soap"): 80.1,
    ("skipless, default init", "adamw"): 61.4,
    ("skipless, default init", "soap"): 77.0,
    ("skipless + skipless init", "adamw"): 78.1,
    ("skipless + skipless init", "soap"): 80.8,
}


def run_all(out: str, depth: int, seeds: list[int], worker: int = 0, workers: int = 1) -> dict[str, dict]:
    """Every run not yet in `<out>_runs.json` (this worker's share); returns all results."""
    from util import read_scalars

    def configure(config):
        config.log_every_steps = 10  # a finer loss curve

    def record(metrics, workdir, config):
        losses = read_scalars(workdir)["train/loss"]
        steps = sorted(losses)
        result = {k: metrics[k] for k in ("test_accuracy", "test_loss", "train_loss")}
        return dict(result, depth=depth, steps=steps, losses=[losses[s] for s in steps])

    depths = {r["depth"] for r in grid.load(f"{out}_runs.json").values()}
    if depths - {depth}:  # the keys do not name the depth: one depth per results file
        raise ValueError(f"{out}_runs.json holds depth {sorted(depths)} runs; use another --out for --depth={depth}")
    runs = [
        grid.Run(f"{name}|{opt}|seed={seed}", "quickstart", f"{arg},opt={opt},depth={depth},seed={seed}")
        for opt in OPTIMIZERS
        for name, arg in VARIANTS.items()
        for seed in seeds
    ]
    return grid.run_grid(f"{out}_runs.json", runs, configure=configure, record=record, worker=worker, workers=workers)


def summarize(results: dict[str, dict], out: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    def runs(name: str, opt: str) -> list[dict]:
        return [v for k, v in results.items() if k.startswith(f"{name}|{opt}|")]

    lines = [
        "| model | optimizer | digits test accuracy (%) mean ± std | per seed | test loss | final train loss "
        "| paper, ImageNet ViT-B/16 (%) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in VARIANTS:
        for opt in OPTIMIZERS:
            rs = runs(name, opt)
            if not rs:
                continue
            acc = np.array([r["test_accuracy"] for r in rs]) * 100
            lines.append(
                f"| {name} | {'SOAP' if opt == 'soap' else 'AdamW'} | {acc.mean():.1f} ± {acc.std():.1f} | "
                f"{', '.join(f'{a:.1f}' for a in acc)} | {np.mean([r['test_loss'] for r in rs]):.3f} | "
                f"{np.mean([r['train_loss'] for r in rs]):.4f} | {PAPER[(name, opt)]} |"
            )
    table = "\n".join(lines)
    with open(f"{out}.md", "w") as f:
        f.write(table + "\n")

    colors = dict(zip(VARIANTS, ("tab:blue", "tab:red", "tab:green")))
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.38
    for oi, opt in enumerate(OPTIMIZERS):
        for vi, name in enumerate(VARIANTS):
            acc = np.array([r["test_accuracy"] for r in runs(name, opt)]) * 100
            if acc.size:
                ax.bar(vi + oi * width, acc.mean(), width, yerr=acc.std(), capsize=3, color=colors[name],
                       alpha=0.55 if opt == "adamw" else 1.0,
                       label=f"{'SOAP' if opt == 'soap' else 'AdamW'}" if vi == 0 else None)
                ax.scatter(np.full(acc.size, vi + oi * width), acc, color="k", s=8, zorder=3)
    ax.set_xticks(np.arange(len(VARIANTS)) + width / 2, list(VARIANTS))
    ax.set_ylabel("test accuracy (%)")
    ax.set_ylim(0, 100)
    ax.set_title("Table 1 in miniature: ViT depth 8 on digits, 3 seeds (light: AdamW, dark: SOAP)")
    ax.title.set_fontsize(9)
    fig.tight_layout()
    fig.savefig(f"{out}_accuracy.png", dpi=120)

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, opt in zip(axes, OPTIMIZERS):
        for name in VARIANTS:
            for i, r in enumerate(runs(name, opt)):
                ax.plot(r["steps"], r["losses"], color=colors[name], alpha=0.8, lw=1,
                        label=name if i == 0 else None)
        ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_title("SOAP (b1 0.9, b2 0.95, freq 10)" if opt == "soap" else "AdamW")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("training loss (mean over 10 steps)")
    axes[0].legend()
    fig.suptitle("Training loss, ViT depth 8 on digits, 3 seeds each")
    fig.tight_layout()
    fig.savefig(f"{out}_curves.png", dpi=120)
    return table


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="docs/figures/table1")
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--seeds", default="0,1,2")
    grid.add_worker_args(parser)
    args = parser.parse_args()
    results = run_all(args.out, args.depth, [int(s) for s in args.seeds.split(",")], args.worker, args.workers)
    print(summarize(results, args.out))
