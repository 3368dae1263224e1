r"""DINO on the digit scenes, with and without skips, AdamW and SOAP, 3 seeds: the dense
miniature of "Cutting the Skip" (docs/results/dense.md).

    OPENBLAS_NUM_THREADS=1 python experiments/dino_digit_scenes.py [--epochs=20 --soap_epochs=20] \
        [--workers=2] [--root=DIR] [--phase=all|train|evaluate|summarize] [--config.x=y ...]

Runs configs/dino_digit_scenes.py (kNN, the `lin` segmentation probe, TokenCut and the PCA
picture at the end, on the teacher) for {both skips + default init, no skips + skipless init}
× {AdamW, SOAP} × seeds 0-2. As in the paper, the probe is read from the AdamW runs and
TokenCut from the SOAP runs; the table reports every metric of every run anyway.

Pre-training first (the config's `evals=knn`: kNN at the end only) with
`python -m skipless_jax.sweep`'s runner, one kept folder per run under --root (default
`<out>_runs`, git-ignored; a rerun resumes; `python -m skipless_jax.report ROOT` tabulates
it), `--config.*` overrides passed to every run; their records go to `<out>.json`. Then the
dense evaluators on each kept checkpoint through `skipless_jax.evaluate` (each run's
`evaluation.json`; records in `<out>_eval.json`, pictures in `<out>_pictures/`). A rerun skips
what is done. Then a Markdown table to `<out>.md` and the PCA / TokenCut figure of seed 0 to
`<out>.png`.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import sys
import time

import numpy as np

from skipless_jax import report, sweep

CONFIG = "configs/dino_digit_scenes.py"  # relative to the checkout, where the sweep runs its runs
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


def args_of(epochs: dict[str, int]) -> dict[str, str]:
    """{result key: its config args}; epochs: optimizer -> epochs of its runs."""
    return {f"{name}|{opt}|seed={s}": f"{arg},opt={opt},epochs={epochs[opt]},seed={s}"
            for opt in OPTIMIZERS for s in SEEDS for name, arg in VARIANTS.items()}


def runs(epochs: dict[str, int]) -> dict[str, sweep.SweepRun]:
    """{result key: its sweep run}: the pre-training, with the kNN evaluation only (`evals=knn`)."""
    module = sweep.load_config_module(os.path.join(sweep.ROOT, CONFIG))
    return {key: sweep.one_run(CONFIG, f"{arg},evals=knn", module) for key, arg in args_of(epochs).items()}


def _load(path: str) -> dict:
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def _save(path: str, results: dict[str, dict]) -> None:
    with open(path, "w") as f:
        json.dump(results, f, indent=1)


def train_all(root: str, epochs: dict[str, int], overrides: list[str], workers: int = 1) -> int:
    """Pre-trains every unfinished run under `root`; the kNN evaluation only (the dense ones run
    on the kept checkpoints, `evaluate_all`). Returns the sweep's exit status."""
    return sweep.train(list(runs(epochs).values()), root, overrides, workers)


def trained(out: str, root: str, epochs: dict[str, int], overrides: list[str]) -> dict[str, dict]:
    """`<out>.json`, written from the finished pre-training runs under `root`."""
    from skipless_jax import evaluate

    def record(workdir, metrics):
        config = evaluate.resolve_config(workdir, None)  # the config the run saved with its checkpoint
        return {"train": {k: float(v) for k, v in metrics.items() if k.startswith(("test_", "train_"))},
                "core_hours": report.core_hours(workdir), "epochs": int(config.total_epochs)}

    results = sweep.collect(runs(epochs), root, overrides, record)
    _save(f"{out}.json", results)
    return results


def evaluate_all(out: str, root: str, epochs: dict[str, int], overrides: list[str]) -> dict[str, dict]:
    """Runs the config's evaluators (kNN, `lin`, TokenCut, PCA) with `python -m skipless_jax.evaluate`'s
    function on every finished run under `root` whose checkpoint has no `evaluation.json` yet;
    writes `<out>_eval.json` from every run's."""
    from skipless_jax import evaluate

    path, pictures = f"{out}_eval.json", f"{out}_pictures"
    os.makedirs(pictures, exist_ok=True)
    before, results = _load(path), {}
    module = sweep.load_config_module(os.path.join(sweep.ROOT, CONFIG))
    grid, args = runs(epochs), args_of(epochs)
    for key, run in grid.items():
        workdir = os.path.join(root, run.name)
        if not sweep.is_finished(workdir, run, overrides):
            continue
        done = os.path.join(workdir, "evaluation.json")
        step = _load(os.path.join(workdir, "final_metrics.json"))["step"]
        if _load(done).get("step") == step:
            metrics, wall = _load(done), before.get(key, {}).get("eval_wall_s")
        else:
            t = time.time()
            config = evaluate.resolve_config(workdir, None)  # as it trained (overrides too), with
            config.evals = module.get_config(args[key]).evals  # every evaluator of the config
            metrics = evaluate.evaluate(workdir, config)
            wall = round(time.time() - t, 1)
            name = f"{'skips' if config.model.skip_sab else 'skipless'}_{config.optimizer.name}_seed{config.seed}"
            for png in glob.glob(os.path.join(workdir, "pictures", "*.png")):
                shutil.copy(png, os.path.join(pictures, f"{name}_{os.path.basename(png).split('_step')[0]}.png"))
        results[key] = {"final": {k: float(metrics[k]) for k in METRICS if k in metrics}}
        if wall is not None:  # measured when this script evaluated it
            results[key]["eval_wall_s"] = wall
        print(key, results[key], flush=True)
    _save(path, results)
    return results


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
    evals = sum(r.get("eval_wall_s", 0.0) for r in results.values()) / 60
    epochs = {opt: sorted({r["epochs"] for k, r in trained.items() if f"|{opt}|" in k}) for opt in OPTIMIZERS}
    if trained and all("wall_s" in r and "cpu_s" in r for r in trained.values()):  # results made before the sweep
        cpu = sum(r["cpu_s"] for r in trained.values()) / 60
        wall = sum(r["wall_s"] for r in trained.values()) / 60
        cost = f"pre-training {wall:.0f} min wall-clock ({cpu:.0f} min process CPU)"
    else:  # the runs' own perf/core_hours_total: their training loops
        cost = f"pre-training {60 * sum(r.get('core_hours') or 0.0 for r in trained.values()):.0f} core-minutes"
    lines.append(f"\n{len(results)} runs, epochs {epochs}; {cost}, evaluations {evals:.0f} min; "
                 "mean ± std over seeds.")
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
    parser.add_argument("--root", default=None, help="the runs' folders (default <out>_runs)")
    parser.add_argument("--epochs", type=int, default=20, help="epochs of the AdamW runs")
    parser.add_argument("--soap_epochs", type=int, default=20, help="epochs of the SOAP runs")
    parser.add_argument("--phase", default="all", choices=("all", "train", "evaluate", "summarize"),
                        help="pre-train, evaluate the kept checkpoints, both (then summarize), or only summarize")
    parser.add_argument("--workers", type=int, default=1, help="pre-training runs at a time")
    args, rest = parser.parse_known_args()
    overrides = sweep.overrides_of(parser, rest)
    root = os.path.abspath(args.root or f"{args.out}_runs")
    epochs = {"adamw": args.epochs, "soap": args.soap_epochs}
    status = 0
    if args.phase in ("all", "train"):
        status = train_all(root, epochs, overrides, args.workers)
    if args.phase != "summarize":
        trained(args.out, root, epochs, overrides)
    if args.phase in ("all", "evaluate"):
        evaluate_all(args.out, root, epochs, overrides)
    text = table(_load(f"{args.out}_eval.json"), _load(f"{args.out}.json"))
    with open(f"{args.out}.md", "w") as f:
        f.write(text + "\n")
    print(text)
    print(figure(args.out) or "figure: pictures of seed 0 not all there yet")
    sys.exit(status)


if __name__ == "__main__":
    main()
