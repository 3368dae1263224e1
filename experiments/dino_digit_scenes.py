r"""DINO on the digit scenes, with and without skips, AdamW and SOAP, 3 seeds: the dense
miniature of "Cutting the Skip" (docs/results.md, "Dense evaluation on digit scenes").

    OPENBLAS_NUM_THREADS=1 python experiments/dino_digit_scenes.py [--epochs=20 --soap_epochs=20] \
        [--worker=0 --workers=2] [--phase=all|train|evaluate|summarize]

Runs configs/dino_digit_scenes.py (kNN, the `lin` segmentation probe, TokenCut and the PCA
picture at the end, on the teacher) for {both skips + default init, no skips + skipless init}
× {AdamW, SOAP} × seeds 0-2. As in the paper, the probe is read from the AdamW runs and
TokenCut from the SOAP runs; the table reports every metric of every run anyway.

Pre-training first (kNN at the end only), each run's last checkpoint kept in `<out>_runs/`
(git-ignored), its record in `<out>.json`; then the dense evaluators on each kept checkpoint
through `skipless_jax.evaluate` (records in `<out>_eval.json`, pictures in `<out>_pictures/`).
A rerun skips what is done. Then a Markdown table to `<out>.md` and the PCA / TokenCut figure of
seed 0 to `<out>.png`.
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import time

import numpy as np

import grid

SEEDS = (0, 1, 2)
VARIANTS = {
    "both skips, default init": "skip_sab=True,skip_ffn=True,init=default",
    "no skips, skipless init": "skip_sab=False,skip_ffn=False,init=skipless",
}
OPTIMIZERS = ("adamw", "soap")
METRICS = {  # result key -> column title
    "test_knn_accuracy": "kNN (%)",
    "test_miou": "`lin` mIoU (%)",
    "test_pixel_accuracy": "pixel acc. (%)",
    "test_corloc": "TokenCut CorLoc (%)",
    "test_pca_explained_variance": "PCA top-3 share (%)",
}


def runs(epochs: dict[str, int]) -> list[grid.Run]:
    """epochs: optimizer -> epochs of its runs."""
    return [
        grid.Run(f"{name}|{opt}|seed={s}", "dino_digit_scenes", f"{arg},opt={opt},epochs={epochs[opt]},seed={s}")
        for opt in OPTIMIZERS
        for s in SEEDS
        for name, arg in VARIANTS.items()
    ]


def train_all(out: str, epochs: dict[str, int], worker: int = 0, workers: int = 1) -> dict[str, dict]:
    """Pre-trains every run of this worker's share not yet in `<out>.json`, keeping its last
    checkpoint under `<out>_runs/` (git-ignored); the kNN evaluation only (the dense ones run
    on the kept checkpoints, `evaluate_all`)."""
    clock: dict[str, float] = {}

    def configure(config):
        config.evals = {"knn": config.evals.knn}
        clock.update(wall=time.time(), cpu=time.process_time())

    def record(metrics, workdir, config):
        return {
            "train": {k: float(v) for k, v in metrics.items() if k.startswith(("test_", "train_"))},
            "wall_s": round(time.time() - clock["wall"], 1),
            "cpu_s": round(time.process_time() - clock["cpu"], 1),
            "epochs": int(config.total_epochs),
        }

    return grid.run_grid(f"{out}.json", runs(epochs), configure=configure, record=record,
                         worker=worker, workers=workers, keep_workdirs=f"{out}_runs")


def evaluate_all(out: str, epochs: dict[str, int], worker: int = 0, workers: int = 1) -> dict[str, dict]:
    """Runs the config's evaluators (kNN, `lin`, TokenCut, PCA) with `python -m skipless_jax.evaluate`'s
    function on every kept checkpoint of this worker's share not yet in `<out>_eval.json`."""
    from skipless_jax import evaluate

    path, pictures = f"{out}_eval.json", f"{out}_pictures"
    os.makedirs(pictures, exist_ok=True)
    for run in runs(epochs)[worker::workers]:
        workdir = grid.workdir_of(f"{out}_runs", run.key)
        if run.key in grid.load(path) or not os.path.exists(os.path.join(workdir, "final_metrics.json")):
            continue
        t = time.time()
        metrics = evaluate.evaluate(workdir, grid.load_config(run.config, run.arg))
        config = grid.load_config(run.config, run.arg)
        name = f"{'skips' if config.model.skip_sab else 'skipless'}_{config.optimizer.name}_seed{config.seed}"
        for png in glob.glob(os.path.join(workdir, "pictures", "*.png")):
            shutil.copy(png, os.path.join(pictures, f"{name}_{os.path.basename(png).split('_step')[0]}.png"))
        result = {"final": {k: float(metrics[k]) for k in METRICS if k in metrics},
                  "eval_wall_s": round(time.time() - t, 1)}
        print(run.key, result, flush=True)
        grid.merge_save(path, run.key, result)
    return grid.load(path)


def _mean_std(values: list[float]) -> str:
    return f"{100 * np.mean(values):.1f} ± {100 * np.std(values):.1f}" if values else "n/m"


def table(results: dict[str, dict], trained: dict[str, dict]) -> str:
    lines = [
        "| pre-training | optimizer | " + " | ".join(METRICS.values()) + " | seeds |",
        "|---|---|" + "---|" * len(METRICS) + "---|",
    ]
    for opt in OPTIMIZERS:
        for name in VARIANTS:
            rows = [v for k, v in results.items() if k.startswith(f"{name}|{opt}|")]
            cells = [_mean_std([r["final"][m] for r in rows if m in r["final"]]) for m in METRICS]
            lines.append(f"| {name} | {opt} | " + " | ".join(cells) + f" | {len(rows)} |")
    cpu = sum(r["cpu_s"] for r in trained.values()) / 60
    wall = sum(r["wall_s"] for r in trained.values()) / 60
    evals = sum(r["eval_wall_s"] for r in results.values()) / 60
    epochs = {opt: sorted({r["epochs"] for k, r in trained.items() if f"|{opt}|" in k}) for opt in OPTIMIZERS}
    lines.append(f"\n{len(results)} runs, epochs {epochs}; pre-training {wall:.0f} min wall-clock "
                 f"({cpu:.0f} min process CPU), evaluations {evals:.0f} min; mean ± std over seeds.")
    return "\n".join(lines)


def figure(out: str) -> str | None:
    """PCA pictures and TokenCut boxes of seed 0 (AdamW), skips above skipless."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pictures = f"{out}_pictures"
    cells = [(f"{v}_{opt}_seed0_{p}", f"{v}, {opt}: {title}")
             for v in ("skips", "skipless") for opt, p, title in
             (("adamw", "test_pca", "PCA of the patch features"), ("soap", "test", "TokenCut boxes"))]
    paths = [(os.path.join(pictures, f"{c}.png"), t) for c, t in cells]
    if not all(os.path.exists(p) for p, _ in paths):
        return None
    fig, axes = plt.subplots(2, 2, figsize=(13, 4.6))
    for ax, (path, title) in zip(axes.ravel(), paths, strict=True):
        ax.imshow(plt.imread(path), interpolation="nearest")
        ax.set_title(title, fontsize=9)
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(f"{out}.png", dpi=110)
    return f"{out}.png"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="docs/figures/dino_digit_scenes")
    parser.add_argument("--epochs", type=int, default=20, help="epochs of the AdamW runs")
    parser.add_argument("--soap_epochs", type=int, default=20, help="epochs of the SOAP runs")
    parser.add_argument("--phase", default="all", choices=("all", "train", "evaluate", "summarize"),
                        help="pre-train, evaluate the kept checkpoints, both (then summarize), or only summarize")
    grid.add_worker_args(parser)
    args = parser.parse_args()
    epochs = {"adamw": args.epochs, "soap": args.soap_epochs}
    if args.phase in ("all", "train"):
        train_all(args.out, epochs, args.worker, args.workers)
    if args.phase in ("all", "evaluate"):
        evaluate_all(args.out, epochs, args.worker, args.workers)
    text = table(grid.load(f"{args.out}_eval.json"), grid.load(f"{args.out}.json"))
    with open(f"{args.out}.md", "w") as f:
        f.write(text + "\n")
    print(text)
    print(figure(args.out) or "figure: pictures of seed 0 not all there yet")


if __name__ == "__main__":
    main()
