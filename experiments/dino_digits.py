r"""DINO pre-training on digits, with and without skips (skipless with the skipless init), 3 seeds.

    OPENBLAS_NUM_THREADS=1 python experiments/dino_digits.py --out=docs/figures/dino_digits

Runs configs/dino_digits.py through `experiments/grid.py` (≈ 2 min of CPU each); results go
to `<out>.json` as runs finish (a rerun skips finished runs), then a table
(`<out>.md`) and a plot of the teacher entropies and kNN accuracy over training (`<out>.png`).
The kNN / linear accuracies at step 0 are the same network at initialization.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import grid

VARIANTS = {
    "both skips, default init": "skip_sab=True,skip_ffn=True,init=default",
    "no skips, skipless init": "skip_sab=False,skip_ffn=False,init=skipless",
}


def run_all(out: str, seeds: list[int], worker: int = 0, workers: int = 1) -> dict[str, dict]:
    """Every run not yet in `<out>.json` (this worker's share); returns all results."""
    clock: dict[str, float] = {}

    def configure(config):
        clock.update(wall=time.time(), cpu=time.process_time())

    def record(metrics, workdir, config):
        return {
            "final": {k: v for k, v in metrics.items() if "accuracy" in k or "entropy" in k},
            "history": [json.loads(line) for line in open(os.path.join(workdir, "history.jsonl"))],
            "wall_s": round(time.time() - clock["wall"], 1),
            "cpu_s": round(time.process_time() - clock["cpu"], 1),
            "log_k": math.log(config.dino.out_dim),
        }

    runs = [
        grid.Run(f"{name}|seed={seed}", "dino_digits", f"{arg},seed={seed}")
        for name, arg in VARIANTS.items()
        for seed in seeds
    ]
    return grid.run_grid(f"{out}.json", runs, configure=configure, record=record, worker=worker, workers=workers)


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
    cpu = sum(r["cpu_s"] for r in results.values())
    lines.append(
        f"\nlog K = {log_k:.2f} nats (uniform). {len(results)} runs, {cpu / 60:.1f} min of process CPU time in all."
    )
    table = "\n".join(lines)
    with open(f"{out}.md", "w") as fh:
        fh.write(table + "\n")
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="docs/figures/dino_digits")
    parser.add_argument("--seeds", default="0,1,2")
    grid.add_worker_args(parser)
    args = parser.parse_args()
    results = run_all(args.out, [int(s) for s in args.seeds.split(",")], args.worker, args.workers)
    print(summarize(results, args.out))


if __name__ == "__main__":
    main()
