r"""DINO pre-training on digits, with and without skips (skipless with the skipless init), 3 seeds.

    OPENBLAS_NUM_THREADS=1 python experiments/dino_digits.py --out=docs/figures/dino_digits \
        [--root=docs/figures/dino_digits_runs] [--workers=2] [--config.x=y ...]

Trains configs/dino_digits.py's runs with `python -m skipless_jax.sweep`'s runner (≈ 2 min of
CPU each), one kept folder per run under --root (default `<out>_runs`, git-ignored; a rerun
resumes, and `python -m skipless_jax.report ROOT` tabulates it); `--config.*` overrides pass to
every run. Then `<out>.json` is written from the finished runs' folders, a table (`<out>.md`) and
a plot of the teacher entropies and kNN accuracy over training (`<out>.png`). The kNN / linear
accuracies at step 0 are the same network at initialization.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

from skipless_jax import report, sweep

CONFIG = "configs/dino_digits.py"  # relative to the checkout, where the sweep runs its runs
VARIANTS = {
    "both skips, default init": "skip_sab=True,skip_ffn=True,init=default",
    "no skips, skipless init": "skip_sab=False,skip_ffn=False,init=skipless",
}


def runs(seeds: list[int]) -> dict[str, sweep.SweepRun]:
    """{result key: its sweep run}."""
    module = sweep.load_config_module(os.path.join(sweep.ROOT, CONFIG))
    return {f"{name}|seed={seed}": sweep.one_run(CONFIG, f"{arg},seed={seed}", module)
            for name, arg in VARIANTS.items() for seed in seeds}


def record(workdir: str, metrics: dict) -> dict:
    from skipless_jax import evaluate

    config = evaluate.resolve_config(workdir, None)  # the config the run saved with its checkpoint
    return {
        "final": {k: v for k, v in metrics.items() if "accuracy" in k or "entropy" in k},
        "history": report.history(workdir),
        "core_hours": report.core_hours(workdir),
        "log_k": math.log(config.dino.out_dim),
    }


def run_all(out: str, seeds: list[int], root: str | None = None, overrides: list[str] = (), workers: int = 1
            ) -> tuple[dict[str, dict], int]:
    """Trains the unfinished runs under `root` (default `<out>_runs`), writes `<out>.json` from
    the finished ones; (results, the sweep's exit status)."""
    root = os.path.abspath(root or f"{out}_runs")
    grid = runs(seeds)
    results, status = sweep.train_and_collect(grid, root, overrides, workers, record, f"{out}.json")
    return results, status


def _series(history: list[dict], key: str) -> tuple[list[int], list[float]]:
    rows = [(h["step"], h[key]) for h in history if key in h]
    return [r[0] for r in rows], [r[1] for r in rows]


def summarize(results: dict[str, dict], out: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    def pct(values: list[float]) -> str:
        return f"{100 * np.mean(values):.1f} ± {100 * np.std(values):.1f}"

    lines = [
        "| variant | kNN at init (%) | kNN after DINO (%) | linear at init (%) | linear after DINO (%) "
        "| teacher entropy: peak / final (nats) | entropy of the batch mean: final (nats) "
        "| per-seed kNN init → final |",
        "|---|---|---|---|---|---|---|---|",
    ]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    colors = {name: c for name, c in zip(VARIANTS, ("tab:blue", "tab:red"), strict=True)}
    log_k = None
    for name in VARIANTS:
        runs = [v for k, v in results.items() if k.startswith(f"{name}|")]
        if not runs:
            continue
        log_k = runs[0]["log_k"]
        f = [r["final"] for r in runs]
        entropy_peak = [max(_series(r["history"], "train_teacher_entropy")[1]) for r in runs]
        entropy_end = [r["final"]["train_teacher_entropy"] for r in runs]
        marginal_end = [r["final"]["train_teacher_marginal_entropy"] for r in runs]
        seeds = ", ".join(f"{100 * x['init_test_knn_accuracy']:.1f} → {100 * x['test_knn_accuracy']:.1f}" for x in f)
        lines.append(
            f"| {name} | {pct([x['init_test_knn_accuracy'] for x in f])} | {pct([x['test_knn_accuracy'] for x in f])} "
            f"| {pct([x['init_test_linear_accuracy'] for x in f])} | {pct([x['test_linear_accuracy'] for x in f])} "
            f"| {np.mean(entropy_peak):.2f} / {np.mean(entropy_end):.2f} | {np.mean(marginal_end):.2f} | {seeds} |"
        )
        for i, r in enumerate(runs):
            label = name if i == 0 else None
            axes[0].plot(*_series(r["history"], "train_teacher_entropy"), color=colors[name], label=label)
            axes[0].plot(
                *_series(r["history"], "train_teacher_marginal_entropy"), color=colors[name], ls=":", alpha=0.7
            )
            steps, knn = _series(r["history"], "test_knn_accuracy")
            init = r["final"]["init_test_knn_accuracy"]
            axes[1].plot(
                [0, *steps], [100 * init] + [100 * v for v in knn], "o-", color=colors[name], label=label, ms=3
            )
    if log_k is not None:
        axes[0].axhline(log_k, color="gray", lw=0.8, ls="--", label=f"log K = {log_k:.2f} (uniform)")
    axes[0].set(
        xlabel="step", ylabel="teacher entropy (nats)", title="per-example (solid) and of the batch mean (dotted)"
    )
    axes[1].set(
        xlabel="step", ylabel="teacher kNN accuracy (%)", title="weighted kNN (k = 20, T = 0.07) on digits test"
    )
    for ax in axes:
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(f"{out}.png", dpi=120)
    lines.append(f"\nlog K = {log_k:.2f} nats (uniform). {len(results)} runs, {cost(results)}.")
    table = "\n".join(lines)
    with open(f"{out}.md", "w") as fh:
        fh.write(table + "\n")
    return table


def cost(results: dict[str, dict]) -> str:
    """The runs' time in all: process CPU minutes where every run has them (results made before
    the sweep ran them), else the training loops' core hours (each run's perf/core_hours_total)."""
    if results and all("cpu_s" in r for r in results.values()):
        return f"{sum(r['cpu_s'] for r in results.values()) / 60:.1f} min of process CPU time in all"
    hours = [r["core_hours"] for r in results.values() if r.get("core_hours") is not None]
    return f"{60 * sum(hours):.1f} core-minutes of training loops in all ({len(hours)} runs timed)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="docs/figures/dino_digits")
    parser.add_argument("--root", default=None, help="the runs' folders (default <out>_runs)")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--workers", type=int, default=1, help="runs at a time")
    args, rest = parser.parse_known_args()
    overrides = sweep.overrides_of(parser, rest)
    results, status = run_all(args.out, [int(s) for s in args.seeds.split(",")], args.root, overrides, args.workers)
    if results:
        print(summarize(results, args.out))
    sys.exit(status)


if __name__ == "__main__":
    main()
