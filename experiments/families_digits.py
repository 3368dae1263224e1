r"""Model families on digits, 3 seeds (docs/results/families_digits.md):

    OPENBLAS_NUM_THREADS=1 python experiments/families_digits.py [--workers=2] [--root=DIR] [--config.x=y ...]

- ConvMixer with and without its one skip, depth 4 and 8 (configs/families_digits.py,
  family=convmixer, default init, AdamW): the paper's control, next to the ViT rows of the skip
  ablation (docs/results/skip_ablation.md, same data and optimizer).
- Swin and PVTv2 with and without DCT Token Graying (ε 0.95), both skips on.
- Per-layer log κ of ①, ①+②, ③, ③+④ (64 test images, float64 SVD; analyze.embedding_kappa)
  of every trained Swin, the hierarchical model whose stages change the token count.

Every run trains `--epochs` (default 15) epochs with `python -m skipless_jax.sweep`'s runner, one
kept folder per run under --root (default `<out>_runs`, git-ignored; a rerun resumes; at 15
epochs the folders are those of the config's named grid `families`, and
`python -m skipless_jax.report ROOT --mean_over=seed` tabulates them); `--config.*` overrides
pass to every run. Then `<out>.json` is written from the finished runs' folders, a Markdown
table to `<out>.md` and the κ figure to `<out>_kappa.png`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

from skipless_jax import sweep

CONFIG = "configs/families_digits.py"  # relative to the checkout, where the sweep runs its runs
SEEDS = (0, 1, 2)
ROWS = {  # row name -> config args of configs/families_digits.py
    "ConvMixer depth 4, with its skip": "family=convmixer,skip_sab=True,depth=4",
    "ConvMixer depth 4, without": "family=convmixer,skip_sab=False,depth=4",
    "ConvMixer depth 8, with its skip": "family=convmixer,skip_sab=True,depth=8",
    "ConvMixer depth 8, without": "family=convmixer,skip_sab=False,depth=8",
    "Swin, no TG": "family=swin,tg=none",
    "Swin, DCT-TG": "family=swin,tg=dct",
    "PVTv2, no TG": "family=pvt_v2,tg=none",
    "PVTv2, DCT-TG": "family=pvt_v2,tg=dct",
}


def runs(epochs: int, seeds=SEEDS) -> dict[str, sweep.SweepRun]:
    """{result key: its sweep run}."""
    module = sweep.load_config_module(os.path.join(sweep.ROOT, CONFIG))
    return {f"{row}|seed={s}": sweep.one_run(CONFIG, f"{arg},epochs={epochs},seed={s}", module)
            for row, arg in ROWS.items() for s in seeds}


def record(workdir: str, metrics: dict) -> dict:
    from skipless_jax import evaluate

    out = {k: metrics[k] for k in ("test_accuracy", "test_loss", "train_loss")}
    config = evaluate.resolve_config(workdir, None)  # the config the run saved with its checkpoint
    if config.model.name == "swin":
        from skipless_jax import analyze, checkpoint, models

        params = checkpoint.load_raw(workdir)[1]["params"]
        model = models.build(config.model, 10)
        kappa = analyze.embedding_kappa(model, params, analyze.probe_images(config, 64))
        out["log_kappa"] = {k: [float(x) for x in v] for k, v in kappa.items()}
    return out


def _mean_std(values: list[float]) -> str:
    return f"{100 * np.mean(values):.1f} ± {100 * np.std(values):.1f}" if values else "n/m"


def table(results: dict) -> str:
    lines = ["| model | test accuracy (%) | seeds 0, 1, 2 |", "|---|---|---|"]
    for row in ROWS:
        vals = [results[k]["test_accuracy"] for s in SEEDS if (k := f"{row}|seed={s}") in results]
        lines.append(f"| {row} | {_mean_std(vals)} | {', '.join(f'{100 * v:.1f}' for v in vals)} |")
    for row in ("Swin, no TG", "Swin, DCT-TG"):
        kappas = [results[k]["log_kappa"] for s in SEEDS if (k := f"{row}|seed={s}") in results]
        if kappas:
            lines += ["", f"{row}: log κ per layer (mean over seeds; layers 0-1 stage 1, 2-3 stage 2)", "",
                      "| point | " + " | ".join(f"layer {i}" for i in range(len(kappas[0]["sab"]))) + " |",
                      "|---|" + "---|" * len(kappas[0]["sab"])]
            for point in ("sab", "sab_skip", "ffn", "ffn_skip"):
                mean = np.mean([k[point] for k in kappas], axis=0)
                lines.append(f"| {point} | " + " | ".join(f"{v:.2f}" for v in mean) + " |")
    return "\n".join(lines)


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4), sharey=True)
    for ax, row in zip(axes, ("Swin, no TG", "Swin, DCT-TG")):
        kappas = [results[k]["log_kappa"] for s in SEEDS if (k := f"{row}|seed={s}") in results]
        if not kappas:
            continue
        for point, style in (("sab", "o-"), ("sab_skip", "o--"), ("ffn", "s-"), ("ffn_skip", "s--")):
            values = np.array([k[point] for k in kappas])
            ax.errorbar(np.arange(values.shape[1]), values.mean(0), yerr=values.std(0), fmt=style, label=point,
                        capsize=2)
        ax.axvline(1.5, color="grey", lw=0.8, ls=":")
        ax.set_title(f"{row} (3 seeds); stage 1 | stage 2")
        ax.set_xlabel("layer")
    axes[0].set_ylabel("log κ (mean over 64 test images)")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(sweep.ROOT, "docs", "figures", "families_digits"))
    parser.add_argument("--root", default=None, help="the runs' folders (default <out>_runs)")
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--seeds", default=",".join(map(str, SEEDS)))
    parser.add_argument("--workers", type=int, default=1, help="runs at a time")
    args, rest = parser.parse_known_args()
    overrides = sweep.overrides_of(parser, rest)
    root = os.path.abspath(args.root or f"{args.out}_runs")
    grid = runs(args.epochs, [int(s) for s in args.seeds.split(",")])
    results, status = sweep.train_and_collect(grid, root, overrides, args.workers, record, f"{args.out}.json")
    text = table(results)
    with open(f"{args.out}.md", "w") as f:
        f.write(text + "\n")
    plot(results, f"{args.out}_kappa.png")
    print(text)
    print(json.dumps({k: round(v["test_accuracy"], 4) for k, v in results.items()}))
    sys.exit(status)


if __name__ == "__main__":
    main()
